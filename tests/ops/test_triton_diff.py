"""The fused Triton kernel (backend ``triton``) against the ``reference`` backend.

On CPU the kernels run under ``TRITON_INTERPRET=1``. Triton decides interpretation when the
``triton`` package is imported (its own ``tl.zeros`` etc. are jitted then), so it cannot be
switched on inside a pytest process that already imported triton. When this module is collected
without the variable, ``test_kernels_under_interpreter`` reruns it in a subprocess with
``TRITON_INTERPRET=1`` (same marker expression) and every other CPU test here is skipped in the
parent; an interpreted ``triton`` backend must not win automatic dispatch for other test modules.
bf16 is GPU-only (the interpreter computes it wrongly): see ``test_cuda_matches_reference``.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import diffmm.ops as ops  # noqa: E402
from diffmm.ops import triton_diff  # noqa: E402
from diffmm.ops.registry import AttentionCall, select_backend  # noqa: E402

INTERPRETING = triton_diff._interpreting()
needs_interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")


@pytest.mark.skipif(INTERPRETING, reason="this process already interprets")
def test_kernels_under_interpreter(request):
    """Run this file again with TRITON_INTERPRET=1 set before triton is imported."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    markexpr = request.config.getoption("markexpr")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-m", markexpr or ""]
    res = subprocess.run(cmd, env=env, cwd=str(request.config.rootpath), capture_output=True, text=True,
                         timeout=900)
    tail = (res.stdout + res.stderr)[-6000:]
    assert res.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail


def test_forced_on_cpu_without_interpreter_is_one_line_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = torch.randn(1, 8, 4, 32), torch.randn(1, 8, 4, 32), torch.randn(1, 8, 2, 64)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET") as err:
        ops.diff_attention(q, k, v, 0.5, backend="triton")
    assert "\n" not in str(err.value)
    assert select_backend(AttentionCall("diff", q, None, False, 32, 64)).name != "triton"


def _inputs(B, N, S, h, h_kv, d, dtype, pad, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, 2 * h, d, generator=g).to(dtype)
    k = torch.randn(B, S, 2 * h_kv, d, generator=g).to(dtype)
    v = torch.randn(B, S, h_kv, 2 * d, generator=g).to(dtype)
    lam = torch.tensor(0.37)
    w = torch.rand(2 * d, generator=g) + 0.5
    km = None
    if pad:
        km = torch.rand(B, S, generator=g) > 0.3
        km[0, -3:] = False  # padding at the end, as batching produces
        if B > 1:
            km[1, :] = False  # a sequence with no key at all: every row outputs 0
    dy = torch.randn(B, N, h, 2 * d, generator=g).to(dtype)
    return q, k, v, lam, w, km, dy


def _run(backend, q, k, v, lam, w, km, dy, causal, norm):
    """Forward + backward; returns the output and the gradients of q, k, v, lam, norm weight."""
    xs = [t.clone().requires_grad_() for t in (q, k, v, lam, w)]
    y = ops.diff_attention(xs[0], xs[1], xs[2], xs[3], causal=causal, attn_mask=km,
                           norm_weight=xs[4] if norm == "weight" else None,
                           lambda_init=0.2 if norm else None, backend=backend)
    y.backward(dy)
    return [y] + [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]


def _assert_matches(got, want, tol):
    names = ["y", "dq", "dk", "dv", "dlam", "dnorm_weight"]
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        a, b = a.double(), b.double()
        assert torch.isfinite(a).all(), name
        err = (a - b).abs().max().item()
        scale = max(b.abs().max().item(), 1e-3)
        assert err <= tol * scale, f"{name}: max abs err {err:.3g} vs scale {scale:.3g}"


TOL = {torch.float32: 2e-5, torch.float16: 1e-2}

# (B, N, S, h, h_kv, d, causal, pad, norm): odd sizes cross several 16-wide tiles.
CASES = [
    pytest.param(2, 37, 37, 2, 2, 32, False, False, "weight", id="plain-odd"),
    pytest.param(1, 37, 37, 2, 2, 32, True, False, None, id="causal-nonorm"),
    pytest.param(1, 33, 33, 4, 2, 32, True, False, "weight", id="causal-gqa2"),
    pytest.param(1, 29, 29, 4, 1, 32, False, True, "plain", id="gqa4-pad-unweighted-norm"),
    pytest.param(2, 21, 45, 2, 1, 32, True, True, "weight", id="causal-kvcache-S>N-pad"),
    pytest.param(1, 45, 19, 2, 1, 32, True, False, "weight", id="causal-S<N-empty-rows"),
    pytest.param(1, 19, 45, 2, 2, 32, False, False, None, id="cross-S>N"),
    pytest.param(1, 31, 31, 1, 1, 64, True, True, "weight", id="d64-causal-pad"),
]


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("B,N,S,h,h_kv,d,causal,pad,norm", CASES)
def test_forward_backward_match_reference(B, N, S, h, h_kv, d, causal, pad, norm, dtype):
    args = _inputs(B, N, S, h, h_kv, d, dtype, pad)
    want = _run("reference", *args, causal, norm)
    got = _run("triton", *args, causal, norm)
    _assert_matches(got, want, TOL[dtype])


@needs_interp
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_128(causal, dtype):
    args = _inputs(1, 35, 35, 2, 1, 128, dtype, True)
    _assert_matches(_run("triton", *args, causal, "weight"), _run("reference", *args, causal, "weight"), TOL[dtype])


@needs_interp
def test_rows_without_keys_give_zero_output_and_gradients():
    q, k, v, lam, w, km, dy = _inputs(2, 24, 24, 2, 1, 32, torch.float32, pad=True)
    y, dq, dk, dv, dlam, dw = _run("triton", q, k, v, lam, w, km, dy, causal=True, norm="weight")
    assert (y[1] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (dk[0][~km[0]] == 0).all() and (dv[0][~km[0]] == 0).all()  # padded keys get no gradient
    assert y[0].abs().sum() > 0 and dlam != 0


@needs_interp
def test_backward_is_deterministic():
    args = _inputs(1, 40, 40, 4, 1, 32, torch.float16, pad=False)
    a = _run("triton", *args, True, "weight")
    b = _run("triton", *args, True, "weight")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@needs_interp
def test_strided_inputs_from_fused_projection():
    B, N, h, d = 1, 26, 2, 32
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(B, N, 2 * h * d * 3, generator=g)  # x @ [Wq; Wk; Wv]: q, k, v are strided views
    q = qkv[..., : 2 * h * d].view(B, N, 2 * h, d)
    k = qkv[..., 2 * h * d: 4 * h * d].view(B, N, 2 * h, d)
    v = qkv[..., 4 * h * d:].view(B, N, h, 2 * d)
    assert not q.is_contiguous()
    lam = torch.tensor(0.5)
    ref = ops.diff_attention(q, k, v, lam, causal=True, backend="reference")
    out = ops.diff_attention(q, k, v, lam, causal=True, backend="triton")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_interp
def test_lambda_init_tensor_and_lam_float():
    q, k, v, lam, w, km, dy = _inputs(1, 20, 20, 2, 2, 32, torch.float32, pad=False)
    li = torch.tensor(0.3, requires_grad=True)
    out = ops.diff_attention(q, k, v, 0.25, norm_weight=w, lambda_init=li, backend="triton")
    ref = ops.diff_attention(q, k, v, 0.25, norm_weight=w, lambda_init=0.3, backend="reference")
    torch.testing.assert_close(out, ref.detach(), atol=2e-5, rtol=2e-5)
    out.sum().backward()
    assert li.grad is not None and torch.isfinite(li.grad)


@needs_interp
def test_torch_compile_has_no_graph_break():
    q, k, v, lam, w, km, dy = _inputs(1, 20, 20, 2, 1, 32, torch.float32, pad=True)
    xs = [t.clone().requires_grad_() for t in (q, k, v, lam, w)]

    def f(q, k, v, lam, w):
        return ops.diff_attention(q, k, v, lam, causal=True, attn_mask=km, norm_weight=w, lambda_init=0.2,
                                  backend="triton")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    (compiled(*xs) * dy).sum().backward()
    want = _run("triton", q, k, v, lam, w, km, dy, True, "weight")[1:]
    for a, x in zip(want, xs):
        torch.testing.assert_close(x.grad, a)


@needs_interp
def test_custom_op_registration_is_consistent():
    q, k, v, lam, w, km, dy = _inputs(1, 18, 18, 2, 1, 32, torch.float32, pad=True)
    torch.library.opcheck(torch.ops.diffmm.triton_diff_fwd.default, (q, k, v, lam, w, km, True, True, 1e-5))


@needs_interp
def test_auto_dispatch_picks_triton_under_interpreter():
    q = torch.randn(1, 8, 4, 32)
    assert select_backend(AttentionCall("diff", q, None, False, 32, 64)).name == "triton"


@needs_interp
@pytest.mark.parametrize("what,expect", [
    ("headdim", "head dim"), ("float_mask", "additive float"), ("bf16", "bfloat16"), ("fp64", "float64"),
    ("no_interpreter", "TRITON_INTERPRET"),
])
def test_forced_unsupported_is_one_line_error_and_auto_falls_back(what, expect, monkeypatch, caplog):
    d, dtype, mask = 32, torch.float32, None
    if what == "headdim":
        d = 16
    elif what == "bf16":
        dtype = torch.bfloat16
    elif what == "fp64":
        dtype = torch.float64
    elif what == "float_mask":
        mask = torch.zeros(1, 1, 8, 8)
    elif what == "no_interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 8, 4, d, dtype=dtype)
    k, v = torch.randn(1, 8, 4, d, dtype=dtype), torch.randn(1, 8, 2, 2 * d, dtype=dtype)
    with pytest.raises(RuntimeError) as err:
        ops.diff_attention(q, k, v, 0.5, attn_mask=mask, backend="triton")
    msg = str(err.value)
    assert "\n" not in msg and expect in msg and "'triton'" in msg
    with caplog.at_level(logging.DEBUG, logger="diffmm.ops"):
        out = ops.diff_attention(q, k, v, 0.5, attn_mask=mask)
    assert any("triton skipped" in r.getMessage() for r in caplog.records)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out, ops.diff_attention(q, k, v, 0.5, attn_mask=mask, backend="reference"),
                               atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs CUDA (compiled kernels)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("d,causal,pad,h_kv", [(64, False, False, 4), (64, True, True, 2), (128, True, False, 1),
                                                (32, False, True, 4)])
def test_cuda_matches_reference(d, causal, pad, h_kv, dtype):
    """Compiled kernels on GPU against the fp32 reference fed the same (rounded) inputs."""
    q, k, v, lam, w, km, dy = _inputs(2, 301, 333, 4, h_kv, d, dtype, pad)
    dev = [t.cuda() if t is not None else None for t in (q, k, v, lam, w, km, dy)]
    got = _run("triton", *dev, causal, "weight")
    f32 = [t.float() if t is not None and t.is_floating_point() else t for t in dev]
    want = _run("reference", *f32, causal, "weight")
    _assert_matches([g.float() for g in got], want, 3e-2 if dtype != torch.float32 else 1e-4)
