"""Every diffmm attention backend against the float64 reference, forward and backward."""
import functools

import pytest
import torch

import diffmm.ops as ops
from diffmm.ops.sdpa import LAYOUTS, diff_attention_sdpa

F64 = torch.float64


def make_inputs(B=2, N=13, S=None, h=4, h_kv=2, d=8, dtype=F64, pad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = N if S is None else S
    q = torch.randn(B, N, 2 * h, d, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, 2 * h_kv, d, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(B, S, h_kv, 2 * d, generator=g, dtype=dtype, requires_grad=True)
    lam = torch.tensor(0.37, dtype=dtype, requires_grad=True)
    mask = None
    if pad:
        mask = torch.rand(B, S, generator=g) > 0.35
        mask[:, -1] = True  # every query row keeps at least one key under causal alignment
    return q, k, v, lam, mask


def run_and_grads(fn, q, k, v, lam, **kw):
    out = fn(q, k, v, lam, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(123), dtype=out.dtype)  # same for every call
    grads = torch.autograd.grad((out * g).sum(), (q, k, v, lam))
    return out, grads


def _layout_fn(layout):
    return lambda *a, **kw: diff_attention_sdpa(*a, layout=layout, **kw)


UNFUSED = [(f"sdpa-{lay}", _layout_fn(lay)) for lay in LAYOUTS] + [
    ("sdpa-dispatch", lambda *a, **kw: ops.diff_attention(*a, backend="sdpa", **kw))]


@pytest.mark.parametrize("name,fn", UNFUSED, ids=[n for n, _ in UNFUSED])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["plain", "gqa", "pad", "cross", "norm"])
def test_backend_matches_reference_fp64(name, fn, causal, case):
    kw = dict(N=13, h=4, h_kv=4)
    if case == "gqa":
        kw.update(h_kv=2)
    if case == "pad":
        kw.update(pad=True, h_kv=1)
    if case == "cross":
        kw.update(S=21, pad=True, h_kv=2)
    q, k, v, lam, mask = make_inputs(**kw)
    extra = {}
    if case == "norm":
        extra = dict(norm_weight=torch.rand(2 * q.shape[-1], dtype=F64) + 0.5, lambda_init=0.356)
    ref_out, ref_grads = run_and_grads(ops.diff_attention_reference, q, k, v, lam, causal=causal, attn_mask=mask,
                                       **extra)
    out, grads = run_and_grads(fn, q, k, v, lam, causal=causal, attn_mask=mask, **extra)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    for n, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda m, n=n: f"grad {n}: {m}")
    torch.testing.assert_close(grads[3], ref_grads[3], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", ["none", "causal", "padding", "additive"])
@pytest.mark.parametrize("h,d", [(2, 32), (8, 64)])
def test_every_layout_matches_reference_with_norm_weight(layout, mask, h, d):
    """Every sdpa layout against the float64 reference at the head dims of diffmm's models, for each mask kind,
    with GQA and the fused head norm: the output and the gradients of q, k, v, lam and the norm weight."""
    g = torch.Generator().manual_seed(h + d)
    B, N, h_kv = 2, 48, h // 2
    q = torch.randn(B, N, 2 * h, d, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(B, N, 2 * h_kv, d, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(B, N, h_kv, 2 * d, generator=g, dtype=F64, requires_grad=True)
    lam = torch.tensor(0.37, dtype=F64, requires_grad=True)
    w = (torch.rand(2 * d, generator=g, dtype=F64) + 0.5).requires_grad_()
    attn_mask = None
    if mask == "padding":
        attn_mask = torch.rand(B, N, generator=g) > 0.3
        attn_mask[0, :3] = False  # left padding: the first causal rows of sequence 0 see no key
    elif mask == "additive":
        attn_mask = torch.randn(B, h, N, N, generator=g, dtype=F64)
    kw = dict(causal=mask in ("causal", "padding"), attn_mask=attn_mask, norm_weight=w, lambda_init=0.3)
    dy = torch.randn(B, N, h, 2 * d, generator=g, dtype=F64)
    ref = ops.diff_attention_reference(q, k, v, lam, **kw)
    out = diff_attention_sdpa(q, k, v, lam, layout=layout, **kw)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for n, a, b in zip(["q", "k", "v", "lam", "w"], torch.autograd.grad((out * dy).sum(), (q, k, v, lam, w)),
                       torch.autograd.grad((ref * dy).sum(), (q, k, v, lam, w))):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda m, n=n: f"grad {n}: {m}")


def test_combined_chunks_never_read_unwritten_memory(monkeypatch):
    """Causal chunks write each key row of dK/dV before accumulating into it: with every fresh buffer filled with
    NaN the gradients still match the reference (a row read before it is written would turn NaN)."""
    import diffmm.ops.combined as combined
    monkeypatch.setattr(combined, "CHUNK_ELEMENTS", 2 * 2 * 4 * 16 * 4)  # 4 rows per chunk (B=2, h=4, S=16)
    monkeypatch.setattr(combined, "SAVE_MAPS_ELEMENTS", 0)
    q, k, v, lam, _ = make_inputs(N=16, h=4, h_kv=2)
    ref_out, ref_grads = run_and_grads(ops.diff_attention_reference, q, k, v, lam, causal=True)
    empty_like, new_empty = torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **kw: new_empty(t, *a, **kw).fill_(float("nan")))
    out, grads = run_and_grads(_layout_fn("combined"), q, k, v, lam, causal=True)
    monkeypatch.undo()
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    for n, a, b in zip(["q", "k", "v", "lam"], grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda m, n=n: f"grad {n}: {m}")


@pytest.mark.parametrize("chunks", [1, 3])
def test_combined_layout_ignores_autocast(monkeypatch, chunks):
    """Under bf16 autocast (Lightning's bf16-mixed) the ``combined`` node still computes in fp32: its output and
    gradients equal those of the same bf16 inputs without autocast."""
    import diffmm.ops.combined as combined
    if chunks > 1:
        monkeypatch.setattr(combined, "CHUNK_ELEMENTS", 2 * 2 * 4 * 12 * 4)  # 4 rows per chunk
        monkeypatch.setattr(combined, "SAVE_MAPS_ELEMENTS", 0)
    q, k, v, lam, _ = make_inputs(N=12, h=4, h_kv=2, d=8, dtype=torch.float32)
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    w = torch.ones(16, requires_grad=True)
    results = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = diff_attention_sdpa(q, k, v, lam, causal=True, norm_weight=w, lambda_init=0.2, layout="combined")
        results.append((out, *torch.autograd.grad(out.float().sum(), (q, k, v, lam, w))))
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["gqa", "pad", "float-mask"])
def test_combined_layout_in_many_chunks_matches_reference(monkeypatch, causal, case):
    """The ``combined`` layout walks the queries in chunks (here 1-3 rows); chunk seams and causal key
    truncation must not change anything, nor may a per-head additive mask."""
    import diffmm.ops.combined as combined
    monkeypatch.setattr(combined, "CHUNK_ELEMENTS", 2 * 2 * 4 * 17)  # rows per chunk: 1 (B=2, h=4, S=17)
    q, k, v, lam, mask = make_inputs(N=17, h=4, h_kv=4 if case == "pad" else 2, pad=case == "pad")
    if case == "float-mask":
        g = torch.Generator().manual_seed(5)
        mask = torch.randn(2, 4, 17, 17, generator=g, dtype=F64)
        mask[0, 1, 3] = float("-inf")  # one empty row in one head
    extra = dict(norm_weight=torch.rand(2 * q.shape[-1], dtype=F64) + 0.5, lambda_init=0.2)
    ref_out, ref_grads = run_and_grads(ops.diff_attention_reference, q, k, v, lam, causal=causal, attn_mask=mask,
                                       **extra)
    out, grads = run_and_grads(lambda *a, **kw: diff_attention_sdpa(*a, layout="combined", **kw), q, k, v, lam,
                               causal=causal, attn_mask=mask, **extra)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    for n, a, b in zip(["q", "k", "v", "lam"], grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda m, n=n: f"grad {n}: {m}")


@pytest.mark.parametrize("path", ["maps-kept", "chunked"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lambda_init", [0.8, "tensor"])
def test_combined_paths_with_norm_weight_match_reference(monkeypatch, path, causal, lambda_init):
    """Both paths of ``combined`` (one chunk whose maps stay for the backward; chunks recomputed in the backward)
    with GQA, a per-head additive mask with an empty row, and the fused head norm: output and gradients of q, k,
    v, lam, the norm weight (and a tensor lambda_init) against the reference."""
    import diffmm.ops.combined as combined
    if path == "chunked":
        monkeypatch.setattr(combined, "CHUNK_ELEMENTS", 2 * 2 * 4 * 11 * 3)  # 3 rows per chunk
        monkeypatch.setattr(combined, "SAVE_MAPS_ELEMENTS", 0)
    q, k, v, lam, _ = make_inputs(N=11, h=4, h_kv=2, d=8, seed=3)
    g = torch.Generator().manual_seed(7)
    mask = torch.randn(2, 4, 11, 11, generator=g, dtype=F64)
    mask[1, 2, 4] = float("-inf")  # one empty row in one head
    w = (torch.rand(16, generator=g, dtype=F64) + 0.5).requires_grad_()
    li = torch.tensor(0.3, dtype=F64, requires_grad=True) if lambda_init == "tensor" else lambda_init
    leaves = (q, k, v, lam, w) + ((li,) if lambda_init == "tensor" else ())
    outs = []
    for fn in (ops.diff_attention_reference, lambda *a, **kw: diff_attention_sdpa(*a, layout="combined", **kw)):
        out = fn(q, k, v, lam, causal=causal, attn_mask=mask, norm_weight=w, lambda_init=li)
        gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
        outs.append((out, *torch.autograd.grad((out * gy).sum(), leaves)))
    for name, a, b in zip(["out", "q", "k", "v", "lam", "w", "lambda_init"], outs[1], outs[0]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


def test_combined_layout_memory_does_not_store_maps(monkeypatch):
    """Above ``SAVE_MAPS_ELEMENTS`` the autograd graph of the ``combined`` layout keeps q, k, v, lam and the
    (N, h, 2d) pre-norm output, not the N x S maps; below it the maps are kept (and reused by the backward)."""
    import diffmm.ops.combined as combined
    q, k, v, lam, _ = make_inputs(B=1, N=64, h=2, h_kv=2, d=8)
    w = (torch.rand(16, dtype=F64) + 0.5).requires_grad_()

    def saved_sizes():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = diff_attention_sdpa(q, k, v, lam, layout="combined", norm_weight=w, lambda_init=0.3)
        return saved, out

    monkeypatch.setattr(combined, "SAVE_MAPS_ELEMENTS", 0)
    saved, _ = saved_sizes()
    assert saved and max(saved) <= q.numel()
    monkeypatch.setattr(combined, "SAVE_MAPS_ELEMENTS", 1 << 21)
    saved, out = saved_sizes()
    assert max(saved) == 2 * 2 * 64 * 64  # both maps of both heads
    ref = ops.diff_attention_reference(q, k, v, lam, norm_weight=w, lambda_init=0.3)
    g = torch.randn(out.shape, dtype=F64)
    torch.testing.assert_close(torch.autograd.grad((out * g).sum(), (q, k, v, lam, w)),
                               torch.autograd.grad((ref * g).sum(), (q, k, v, lam, w)), atol=1e-9, rtol=1e-9)


def naive_diff_attention(q, k, v, lam, causal=False, mask=None, norm_weight=None, lambda_init=None, eps=1e-5):
    """Loop-per-head implementation written directly from the paper's formula (DIFF Transformer, arXiv 2410.05258,
    eq. 1 and the per-head GroupNorm as RMSNorm), independent of diffmm's reference."""
    B, N, H2, d = q.shape
    S, h, h_kv = k.shape[1], H2 // 2, k.shape[2] // 2
    out = torch.zeros(B, N, h, 2 * d, dtype=q.dtype)
    for b in range(B):
        for i in range(h):
            g = i // (h // h_kv)
            maps = []
            for j in range(2):
                s = q[b, :, 2 * i + j] @ k[b, :, 2 * g + j].T / d ** 0.5  # (N, S)
                if causal:
                    s = s.masked_fill(torch.ones(N, S, dtype=torch.bool).tril(S - N).logical_not(), float("-inf"))
                if mask is not None:
                    s = s.masked_fill(~mask[b][None, :], float("-inf"))
                maps.append(torch.softmax(s, -1))
            o = (maps[0] - lam * maps[1]) @ v[b, :, g]  # (N, 2d)
            if lambda_init is not None:
                o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_weight * (1 - lambda_init)
            out[b, :, i] = o
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_naive_loop(causal):
    q, k, v, lam, mask = make_inputs(B=2, N=7, S=9, h=4, h_kv=2, d=4, pad=True)
    w = torch.rand(8, dtype=F64) + 0.5
    ref = ops.diff_attention_reference(q, k, v, lam, causal=causal, attn_mask=mask, norm_weight=w, lambda_init=0.2)
    torch.testing.assert_close(ref, naive_diff_attention(q, k, v, lam, causal, mask, w, 0.2))


def test_fp32_and_bf16_outputs_close_to_fp64():
    q, k, v, lam, _ = make_inputs(N=33, h=2, h_kv=2, d=16)
    ref = ops.diff_attention_reference(q, k, v, lam, causal=True)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)]:
        out = ops.diff_attention(q.to(dtype), k.to(dtype), v.to(dtype), lam.float(), causal=True, backend="sdpa")
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_fully_masked_rows_are_zero_and_gradients_finite():
    q, k, v, lam, _ = make_inputs(B=1, N=4, S=4, h=2, h_kv=2, d=4)
    mask = torch.tensor([[False, False, True, True]])  # left padding: causal rows 0 and 1 see no key
    for backend in ["reference", "sdpa"]:
        out, grads = run_and_grads(functools.partial(ops.diff_attention, backend=backend), q, k, v, lam,
                                   causal=True, attn_mask=mask)
        assert torch.all(out[:, :2] == 0)
        assert all(torch.isfinite(g).all() for g in grads)


def test_additive_float_mask_equals_bool_mask():
    q, k, v, lam, mask = make_inputs(N=9, h=2, h_kv=2, pad=True)
    add = torch.zeros(mask.shape, dtype=F64).masked_fill(~mask, float("-inf"))[:, None, None, :]
    for backend in ["reference", "sdpa"]:
        a = ops.diff_attention(q, k, v, lam, attn_mask=mask, backend=backend)
        b = ops.diff_attention(q, k, v, lam, attn_mask=add, backend=backend)
        torch.testing.assert_close(a, b)


def test_causal_with_kv_cache_alignment():
    """The last N queries against S keys equal the last N rows of the full square causal call."""
    q, k, v, lam, _ = make_inputs(N=10, h=2, h_kv=1)
    full = ops.diff_attention(q, k, v, lam, causal=True, backend="sdpa")
    tail = ops.diff_attention(q[:, -3:], k, v, lam, causal=True, backend="sdpa")
    torch.testing.assert_close(tail, full[:, -3:])


def test_standard_attention_backends_match_reference():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 11, 8, 8, dtype=F64, generator=g)
    k = torch.randn(2, 15, 2, 8, dtype=F64, generator=g)
    v = torch.randn(2, 15, 2, 12, dtype=F64, generator=g)
    mask = torch.rand(2, 15, generator=g) > 0.3
    mask[:, -1] = True
    for causal in [False, True]:
        ref = ops.attention(q, k, v, causal=causal, attn_mask=mask, backend="reference")
        torch.testing.assert_close(ops.attention(q, k, v, causal=causal, attn_mask=mask, backend="sdpa"), ref)
        kk, vv = k.repeat_interleave(4, 2), v.repeat_interleave(4, 2)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
            attn_mask=mask[:, None, None, :] & torch.ones(11, 15, dtype=torch.bool).tril(4)
            if causal else mask[:, None, None, :]).transpose(1, 2)
        torch.testing.assert_close(ref, want)


# ---- dispatch and errors -------------------------------------------------------------------------


def test_unknown_backend_lists_available():
    q, k, v, lam, _ = make_inputs()
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'; available: auto, .*reference.*sdpa"):
        ops.diff_attention(q, k, v, lam, backend="nope")


def test_env_var_selects_backend(monkeypatch):
    q, k, v, lam, _ = make_inputs()
    monkeypatch.setenv("DIFFMM_ATTN_BACKEND", "nope")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        ops.diff_attention(q, k, v, lam)
    monkeypatch.setenv("DIFFMM_ATTN_BACKEND", "reference")
    call = ops.AttentionCall("diff", q, None, False, 8, 16)
    assert ops.select_backend(call).name == "reference"
    assert ops.select_backend(call, "sdpa").name == "sdpa"  # the per-module argument wins


def test_auto_dispatch_on_cpu_is_sdpa(monkeypatch):
    monkeypatch.delenv("DIFFMM_ATTN_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, *_ = make_inputs(dtype=torch.float32)
    assert ops.select_backend(ops.AttentionCall("diff", q, None, False, 8, 16)).name == "sdpa"


def test_forcing_flash_without_it_says_why():
    q, k, v, lam, _ = make_inputs()
    with pytest.raises(RuntimeError, match="attention backend 'flash' cannot run this call: "):
        ops.diff_attention(q, k, v, lam, backend="flash")


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q[..., :-1], k, v), r"k has shape \(2, 13, 8, 8\); expected \(B=2, S, 2\*h_kv, d=7\)"),
    (lambda q, k, v: (q, k, v[..., :-1]), r"v has shape \(2, 13, 4, 15\); expected \(B=2, S=13, h_kv=4, 2\*d=16\)"),
    (lambda q, k, v: (q[:, :, :-1], k, v), r"q has shape .*expected \(B, N, 2\*h, d\)"),
    (lambda q, k, v: (q[:, :, :6], k, v), r"q has 3 differential heads and k has 4; expected h divisible by h_kv"),
    (lambda q, k, v: (q, k.float(), v), r"k has dtype torch.float32; expected torch.float64 like q"),
    (lambda q, k, v: (q[0], k, v), r"q has shape \(13, 8, 8\).*expected 4 dims"),
])
def test_bad_shapes_give_one_line_errors(bad, match):
    q, k, v, lam, _ = make_inputs(h=4, h_kv=4)
    with pytest.raises((ValueError, TypeError), match=match) as e:
        ops.diff_attention(*bad(q, k, v), lam)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mask,match", [
    (torch.ones(2, 12, dtype=torch.bool),
     r"attn_mask \(bool key-padding\) has shape \(2, 12\); expected \(B, S\) = \(2, 13\)"),
    (torch.zeros(3, 1, 13, 13), r"attn_mask \(additive float\) has shape \(3, 1, 13, 13\); expected broadcastable"),
    (torch.ones(2, 13, dtype=torch.int64), r"attn_mask has dtype torch.int64; expected bool"),
])
def test_bad_masks(mask, match):
    q, k, v, lam, _ = make_inputs()
    with pytest.raises((ValueError, TypeError), match=match):
        ops.diff_attention(q, k, v, lam, attn_mask=mask)


def test_norm_weight_needs_lambda_init_and_right_shape():
    q, k, v, lam, _ = make_inputs()
    with pytest.raises(ValueError, match="norm_weight was given without lambda_init"):
        ops.diff_attention(q, k, v, lam, norm_weight=torch.ones(16, dtype=F64))
    with pytest.raises(ValueError, match=r"norm_weight has shape \(8,\); expected \(2\*d,\) = \(16,\)"):
        ops.diff_attention(q, k, v, lam, norm_weight=torch.ones(8, dtype=F64), lambda_init=0.2)
    with pytest.raises(ValueError, match=r"lam has shape \(2,\); expected a scalar tensor"):
        ops.diff_attention(q, k, v, torch.ones(2, dtype=F64))


@pytest.mark.parametrize("lam,match", [([0.3], r"lam is a list \(\[0.3\]\); expected a float or a 0-d tensor"),
                                       ("0.5", r"lam is a str \('0.5'\); expected a float or a 0-d tensor"),
                                       (True, r"lam is a bool"),
                                       (torch.tensor(1), r"lam has dtype torch.int64; expected a floating-point")])
def test_bad_lam_is_a_one_line_error(lam, match):
    q, k, v, _, _ = make_inputs()
    with pytest.raises(TypeError, match=match) as e:
        ops.diff_attention(q, k, v, lam)
    assert "\n" not in str(e.value)


def test_zero_head_dim_is_a_one_line_error():
    q, k, v, lam, _ = make_inputs()
    with pytest.raises(ValueError, match=r"q has shape \(2, 13, 8, 0\); expected .* head dim d >= 1"):
        ops.diff_attention(q[..., :0], k[..., :0], v[..., :0], lam)
    with pytest.raises(ValueError, match=r"q has shape \(2, 13, 8, 0\); expected .* head dim d >= 1"):
        ops.attention(q[..., :0], k[..., :0], v[..., :0])
