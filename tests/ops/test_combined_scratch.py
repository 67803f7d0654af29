"""The ``combined`` layout's scratch buffers (``diffmm.ops.combined._scratch``): reused between calls, never read
before they are written, never returned, and usable after inference mode; every case against the float64
reference, forward and backward."""
import pytest
import torch

import diffmm.ops.combined as combined
from diffmm.ops import diff_attention_reference
from diffmm.ops.sdpa import diff_attention_sdpa

# (B, N, h, h_kv, d, causal, chunked): odd N (row lengths that are not multiples of 16), GQA, one chunk with the maps
# kept, and chunks that recompute the maps (causal and not)
CASES = {"kept-maps": (3, 13, 4, 2, 8, False, False), "kept-maps-causal": (2, 9, 2, 1, 8, True, False),
         "chunked-causal": (2, 16, 4, 2, 8, True, True), "chunked": (2, 11, 2, 2, 4, False, True)}


def _inputs(B, N, h, h_kv, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, 2 * h, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, N, 2 * h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, N, h_kv, 2 * d, generator=g, dtype=torch.float64)
    w = 1 + 0.1 * torch.randn(2 * d, generator=g, dtype=torch.float64)
    dy = torch.randn(B, N, h, 2 * d, generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v, torch.tensor(0.3, dtype=torch.float64), w)]
    return leaves, dy


def _run(fn, leaves, dy, causal):
    q, k, v, lam, w = leaves
    out = fn(q, k, v, lam, causal=causal, norm_weight=w, lambda_init=0.2)
    return out, torch.autograd.grad(out, leaves, dy)


def _combined(q, k, v, lam, **kw):
    return diff_attention_sdpa(q, k, v, lam, layout="combined", **kw)


def _check(case, seed, monkeypatch):
    B, N, h, h_kv, d, causal, chunked = CASES[case]
    if chunked:
        monkeypatch.setattr(combined, "CHUNK_ELEMENTS", 2 * B * h * N * 4)  # about 4 rows per chunk
        monkeypatch.setattr(combined, "SAVE_MAPS_ELEMENTS", 0)
    leaves, dy = _inputs(B, N, h, h_kv, d, seed)
    ref_out, ref_grads = _run(diff_attention_reference, leaves, dy, causal)
    out, grads = _run(_combined, leaves, dy, causal)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    for name, a, b in zip("q k v lam w".split(), grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"grad {n}: {m}")
    return out, grads


@pytest.mark.parametrize("case", list(CASES))
def test_scratch_is_never_read_before_written(case, monkeypatch):
    """A first call fills the scratch buffers; poisoned with NaN, a second call still matches the reference."""
    _check(case, 0, monkeypatch)
    bufs = combined._SCRATCH.bufs
    assert any(b.dtype == torch.float64 for b in bufs.values())
    for b in bufs.values():
        b.fill_(float("nan"))
    _check(case, 1, monkeypatch)


@pytest.mark.parametrize("case", list(CASES))
def test_results_do_not_alias_scratch(case, monkeypatch):
    """The output and the gradients of one call are left intact by the next call (none of them is a scratch view;
    h_kv = 1 makes dV's permute back a no-op)."""
    out, grads = _check(case, 0, monkeypatch)
    kept = [t.clone() for t in (out, *grads)]
    _check(case, 2, monkeypatch)
    for a, b in zip((out, *grads), kept):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_scratch_made_in_inference_mode_serves_training(monkeypatch):
    """Buffers first allocated under ``torch.inference_mode`` (generation) are normal tensors: a training call after
    it runs and matches the reference."""
    combined._SCRATCH.__dict__.clear()
    leaves, _ = _inputs(*CASES["chunked-causal"][:5], seed=3)
    with torch.inference_mode():
        _combined(*(t.detach() for t in leaves[:4]), causal=True, norm_weight=leaves[4].detach(), lambda_init=0.2)
    assert not any(b.is_inference() for b in combined._SCRATCH.bufs.values())
    _check("chunked-causal", 4, monkeypatch)
