"""Additive float masks mean the same thing in every backend and dtype (issue 14, item 7).

Semantics: an additive value at or below ``diffmm.ops._validate.mask_floor`` (``finfo(float32).min``, or
``finfo(float16).min`` for a float16 call or mask) masks its key like -inf; a query row whose every key is
masked outputs 0 and gets finite (zero) gradients.
"""
import pytest
import torch

import diffmm.ops as ops
from diffmm.ops.sdpa import LAYOUTS, diff_attention_sdpa

B, N, H, HKV, D = 2, 6, 2, 2, 8


def backends():
    out = [("reference", lambda *a, **kw: ops.diff_attention(*a, backend="reference", **kw))]
    for lay in LAYOUTS:
        out.append((f"sdpa-{lay}", lambda *a, lay=lay, **kw: diff_attention_sdpa(*a, layout=lay, **kw)))
    return out


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, 2 * H, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, N, 2 * HKV, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, N, HKV, 2 * D, generator=g).to(dtype).requires_grad_()
    lam = torch.tensor(0.4, dtype=torch.float64 if dtype == torch.float64 else torch.float32, requires_grad=True)
    return q, k, v, lam


def hostile_mask(dtype, mask_dtype):
    """(B, h, N, S) additive mask: row 1 all finfo(float32).min, row 2 all finfo(call dtype).min, row 3 all -inf,
    row 4 half masked with finfo(float32).min, row 5 small finite biases; other rows open."""
    m = torch.zeros(B, H, N, N, dtype=mask_dtype)
    m[:, :, 1] = max(torch.finfo(torch.float32).min, torch.finfo(mask_dtype).min)
    m[:, :, 2] = max(torch.finfo(dtype).min, torch.finfo(mask_dtype).min)
    m[:, :, 3] = float("-inf")
    m[:, :, 4, ::2] = max(torch.finfo(torch.float32).min, torch.finfo(mask_dtype).min)
    m[:, :, 5] = torch.linspace(-2, 2, N, dtype=mask_dtype)
    return m


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mask_dtype", ["same", torch.float32], ids=str)
def test_masked_rows_agree_across_backends(dtype, mask_dtype):
    mask_dtype = dtype if mask_dtype == "same" else mask_dtype
    mask = hostile_mask(dtype, mask_dtype)
    q, k, v, lam = inputs(dtype)
    dy = torch.randn(B, N, H, 2 * D, generator=torch.Generator().manual_seed(1)).to(dtype)
    # The oracle: the float64 reference with the masked entries written as -inf.
    m64 = mask.double().masked_fill(mask <= max(torch.finfo(torch.float32).min, torch.finfo(mask_dtype).min,
                                                torch.finfo(dtype).min), float("-inf"))
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v, lam)]
    ref = ops.diff_attention_reference(*x64, attn_mask=m64, norm_weight=None, lambda_init=0.3)
    ref_grads = torch.autograd.grad((ref * dy.double()).sum(), x64)
    assert torch.all(ref[:, 1:4] == 0)
    tol = {torch.float16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
    for name, fn in backends():
        out = fn(q, k, v, lam, attn_mask=mask, lambda_init=0.3)
        grads = torch.autograd.grad((out * dy).sum(), (q, k, v, lam))
        assert torch.all(out[:, 1:4] == 0), f"{name}: fully masked rows must output 0"
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")
        for n, a, b in zip("qkvl", grads, ref_grads):
            assert torch.isfinite(a).all(), f"{name}: grad {n} not finite"
            torch.testing.assert_close(a.double(), b, atol=tol * 5, rtol=tol * 5,
                                       msg=lambda m, name=name, n=n: f"{name} grad {n}: {m}")
        assert torch.all(grads[0][:, 1:4] == 0), f"{name}: masked rows must get zero dq"


def test_mask_floor_is_the_least_negative_min():
    from diffmm.ops._validate import mask_floor
    f32 = torch.finfo(torch.float32).min
    assert mask_floor(torch.float64) == f32
    assert mask_floor(torch.float32) == f32
    assert mask_floor(torch.float16) == torch.finfo(torch.float16).min
    assert mask_floor(torch.bfloat16) == torch.finfo(torch.bfloat16).min
    assert mask_floor(torch.float64, torch.float16) == torch.finfo(torch.float16).min


def test_triton_refuses_additive_masks_in_one_line():
    if "triton" not in ops.list_backends():
        pytest.skip("triton is not installed")
    q, k, v, lam = inputs(torch.float32)
    with pytest.raises(RuntimeError, match="attention backend 'triton' cannot run this call") as e:
        ops.diff_attention(q, k, v, lam, attn_mask=hostile_mask(torch.float32, torch.float32), backend="triton")
    assert "\n" not in str(e.value)
