"""diff_v2_attention against an eager float64 reference written from the DIFF V2 formula (unilm's
Diff-Transformer-V2: head_i = softmax(Q_2i K^T) V - sigmoid(lam_i) softmax(Q_2i+1 K^T) V), on every CPU backend
that runs standard attention."""
import math

import pytest
import torch

from diffmm.ops import AttentionCall, diff_v2_attention, get_backend, list_backends


def cpu_standard_backends():
    call = AttentionCall("standard", torch.empty(1, 1, 2, 64, dtype=torch.float64), None, False, 64, 64)
    return [b for b in list_backends("standard") if get_backend(b).unsupported(call) is None]


def v2_eager(q, k, v, lam_logits, *, causal=False, pad=None, add_mask=None):
    """DIFF V2 head by head: head_i = A_2i V_g - sigmoid(lam_i) A_2i+1 V_g, g = j // (2h / h_kv)."""
    B, N, H2, d = q.shape
    S, hkv = k.shape[1], k.shape[2]
    group = H2 // hkv
    heads = []
    for i in range(H2 // 2):
        outs = []
        for j in (2 * i, 2 * i + 1):
            g = j // group
            s = torch.einsum("bnd,bsd->bns", q[:, :, j], k[:, :, g]) / math.sqrt(d)  # (B, N, S)
            if causal:
                keep = torch.tensor([[sj <= ni + S - N for sj in range(S)] for ni in range(N)])
                s = s.masked_fill(~keep, float("-inf"))
            if pad is not None:
                s = s.masked_fill(~pad[:, None, :], float("-inf"))
            if add_mask is not None:
                s = s + add_mask[:, i]
            outs.append(torch.einsum("bns,bsd->bnd", torch.softmax(s, dim=-1), v[:, :, g]))
        heads.append(outs[0] - torch.sigmoid(lam_logits[:, :, i:i + 1]) * outs[1])
    return torch.stack(heads, dim=2)  # (B, N, h, d)


def make(B, N, S, h, hkv, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return r(B, N, 2 * h, d), r(B, S, hkv, d), r(B, S, hkv, d), r(B, N, h)


@pytest.mark.parametrize("backend", cpu_standard_backends())
@pytest.mark.parametrize("h,hkv", [(2, 2), (4, 2), (4, 4), (4, 1)])  # 2h/h_kv in {2, 4, 8}
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_matches_eager_fp64_forward_and_grad(backend, h, hkv, causal, padding):
    B, N, d = 2, 7, 8
    q, k, v, lam = make(B, N, N, h, hkv, d)
    pad = None
    if padding:
        pad = torch.ones(B, N, dtype=torch.bool)
        pad[1, -3:] = False
    inputs = [t.clone().requires_grad_() for t in (q, k, v, lam)]
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v, lam)]
    out = diff_v2_attention(*inputs, causal=causal, attn_mask=pad, backend=backend)
    ref = v2_eager(*ref_inputs, causal=causal, pad=pad)
    assert out.shape == (B, N, h, d) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), inputs)
    want = torch.autograd.grad((ref * w).sum(), ref_inputs)
    for a, b, name in zip(got, want, "q k v lam".split()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"grad of {name}")


@pytest.mark.parametrize("backend", cpu_standard_backends())
def test_kv_cache_shape_causal_and_per_head_additive_mask(backend):
    B, N, S, h, hkv, d = 2, 3, 9, 4, 2, 8
    q, k, v, lam = make(B, N, S, h, hkv, d, seed=1)
    torch.testing.assert_close(diff_v2_attention(q, k, v, lam, causal=True, backend=backend),
                               v2_eager(q, k, v, lam, causal=True), rtol=1e-10, atol=1e-10)
    add = torch.randn(B, h, N, S, dtype=torch.float64)  # one mask per output head, shared by its two maps
    torch.testing.assert_close(diff_v2_attention(q, k, v, lam, attn_mask=add, backend=backend),
                               v2_eager(q, k, v, lam, add_mask=add), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("h,hkv", [(2, 2), (4, 2)])
def test_pairs_stay_inside_gqa_group(h, hkv):
    """With constant values per kv head, map j returns g(j)+1 exactly; head i must read kv head i // (h / h_kv)
    for both maps. Pairing across groups (e.g. maps i and i+h) would give a different number."""
    B, N, d = 1, 5, 4
    q, k, _, _ = make(B, N, N, h, hkv, d, seed=2)
    v = torch.arange(1, hkv + 1, dtype=torch.float64)[None, None, :, None].expand(B, N, hkv, d).contiguous()
    lam = torch.zeros(B, N, h, dtype=torch.float64)  # sigmoid = 0.5
    out = diff_v2_attention(q, k, v, lam)
    expect = torch.tensor([0.5 * (i // (h // hkv) + 1) for i in range(h)], dtype=torch.float64)
    torch.testing.assert_close(out, expect[None, None, :, None].expand_as(out))
    if hkv > 1:  # the wrong (cross-group) pairing really differs here, so the test can fail
        wrong = torch.tensor([(i // (2 * h // hkv)) + 1 - 0.5 * ((i + h) // (2 * h // hkv) + 1) for i in range(h)])
        assert not torch.allclose(wrong.double(), expect)


def test_pairing_with_distinct_keys_differs_from_cross_group():
    """Keys of the two groups differ: moving query map 1 to the other group must change head 0."""
    B, N, h, hkv, d = 1, 6, 2, 2, 8
    q, k, v, lam = make(B, N, N, h, hkv, d, seed=3)
    out = diff_v2_attention(q, k, v, lam)
    q_swapped = q.clone()
    q_swapped[:, :, [1, 2]] = q[:, :, [2, 1]]  # map 1 now sits in group 1, map 2 in group 0
    assert not torch.allclose(diff_v2_attention(q_swapped, k, v, lam)[:, :, 0], out[:, :, 0])


def test_low_precision_epilogue_in_fp32():
    q, k, v, lam = make(1, 16, 16, 4, 2, 16, dtype=torch.float32, seed=4)
    ref = diff_v2_attention(q, k, v, lam, causal=True)
    out = diff_v2_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lam.bfloat16(), causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


def test_bad_inputs_one_line_errors():
    q, k, v, lam = make(1, 4, 4, 3, 2, 8)  # 2h = 6 over 2 kv heads: group 3 is odd, a pair would straddle groups
    with pytest.raises(ValueError, match="even group size"):
        diff_v2_attention(q, k, v, lam)
    q, k, v, lam = make(1, 4, 4, 2, 1, 8)
    with pytest.raises(ValueError, match=r"lam_logits has shape \(1, 4\); expected \(B, N, h\)"):
        diff_v2_attention(q, k, v, lam[..., 0])
    with pytest.raises(ValueError, match="4-dim"):
        diff_v2_attention(q[0], k, v, lam)
    with pytest.raises(ValueError, match="even, positive number of query maps") as e:
        diff_v2_attention(q[:, :, :3], k, v, lam)
    assert "\n" not in str(e.value)
