"""``torch.compile(fullgraph=True)`` through the attention ops: the sdpa backend's layouts (the combined one is a
pair of custom ops with fake implementations) and the reference, compiled, against the float64 reference in eager,
forward and backward; the custom ops pass ``torch.library.opcheck``. (aot_eager: the tracing and the autograd
graph; inductor's code generation runs in tests/models/test_compile_models.py); DIFF V2 compiled too."""
import pytest
import torch

import diffmm.ops as ops
from diffmm.ops.sdpa import diff_attention_sdpa
from test_backends import make_inputs, run_and_grads

TOL = dict(atol=1e-10, rtol=1e-10)
CASES = [("combined", dict(causal=True)), ("combined", dict(pad=True, norm=True)),
         ("combined", dict(h_kv=1, pad=True, causal=True)), ("split", dict(causal=True, norm=True)),
         ("pair", dict(S=21, pad=True)), ("reference", dict(causal=True, pad=True))]


def attention(layout):
    if layout == "reference":
        return ops.diff_attention_reference
    return lambda *a, **kw: diff_attention_sdpa(*a, layout=layout, **kw)


@pytest.mark.parametrize("layout,case", CASES, ids=[f"{lay}-{'-'.join(c)}" for lay, c in CASES])
def test_fullgraph_compile_matches_reference_fp64(layout, case):
    case = dict(case)
    causal, norm = case.pop("causal", False), case.pop("norm", False)
    q, k, v, lam, mask = make_inputs(**{"h_kv": 2, **case})
    extra = dict(norm_weight=torch.rand(2 * q.shape[-1], dtype=q.dtype) + 0.5, lambda_init=0.356) if norm else {}
    torch._dynamo.reset()
    fn = torch.compile(attention(layout), fullgraph=True, backend="aot_eager")
    out, grads = run_and_grads(fn, q, k, v, lam, causal=causal, attn_mask=mask, **extra)
    ref_out, ref_grads = run_and_grads(ops.diff_attention_reference, q, k, v, lam, causal=causal, attn_mask=mask,
                                       **extra)
    torch.testing.assert_close(out, ref_out, **TOL)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("keep_maps", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_combined_custom_ops_pass_opcheck(keep_maps, norm, monkeypatch):
    """Schemas, fake implementations (shapes, dtypes, strides) and no aliasing, for both ops."""
    import diffmm.ops.combined as combined

    if not keep_maps:
        monkeypatch.setattr(combined, "SAVE_MAPS_ELEMENTS", 0)
        monkeypatch.setattr(combined, "CHUNK_ELEMENTS", 2 * 2 * 4 * 5 * 13)  # several chunks
    q, k, v, lam, _ = make_inputs(B=2, N=13, h=4, h_kv=2, d=8, dtype=torch.float32)
    q, k, v, lam = (t.detach() for t in (q, k, v, lam))
    w = torch.rand(16) + 0.5 if norm else None
    mask = torch.zeros(2, 1, 1, 13).masked_fill_(torch.rand(2, 1, 1, 13) > 0.7, -1e30)
    mask[..., -1] = 0.0
    empty = torch.zeros(2, 1, 13, 1, dtype=torch.bool)
    fwd_args = (q, k, v, lam, w, mask, empty, False, norm, 1e-5, True)
    torch.library.opcheck(torch.ops.diffmm.combined_diff_fwd, fwd_args)
    y, q12, k12, vt, a, rstd, maps, comb = torch.ops.diffmm.combined_diff_fwd(*fwd_args)
    assert (maps.numel() > 0) == keep_maps and (a.numel() > 0) == norm
    bwd_args = (torch.randn_like(y), q12, k12, vt, lam, w, a, rstd, maps, comb, mask, empty, False, norm)
    torch.library.opcheck(torch.ops.diffmm.combined_diff_bwd, bwd_args)


def test_diff_v2_fullgraph_compile_matches_eager_fp64():
    """DIFF V2 (one standard sdpa call and its epilogue) under causal + key padding."""
    from test_diff_v2 import make, v2_eager

    q, k, v, lam = make(2, 7, 7, 4, 2, 8)
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, -3:] = False
    inputs = [t.clone().requires_grad_() for t in (q, k, v, lam)]
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v, lam)]
    torch._dynamo.reset()
    out = torch.compile(ops.diff_v2_attention, fullgraph=True, backend="aot_eager")(*inputs, causal=True,
                                                                                     attn_mask=pad, backend="sdpa")
    ref = v2_eager(*ref_inputs, causal=True, pad=pad)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn(out.shape, dtype=out.dtype)
    for a, b in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, ref_inputs, g)):
        torch.testing.assert_close(a, b, **TOL)


def test_combined_compiles_with_dynamic_shapes():
    """One graph with symbolic sizes serves several sequence lengths (the fake implementation's chunk geometry)."""
    torch._dynamo.reset()
    fn = torch.compile(attention("combined"), fullgraph=True, backend="aot_eager", dynamic=True)
    for N in (13, 29):
        q, k, v, lam, _ = make_inputs(N=N, seed=N)
        out, grads = run_and_grads(fn, q, k, v, lam, causal=True, lambda_init=0.2)
        ref_out, ref_grads = run_and_grads(ops.diff_attention_reference, q, k, v, lam, causal=True, lambda_init=0.2)
        torch.testing.assert_close(out, ref_out, **TOL)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, **TOL)
