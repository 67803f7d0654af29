"""The differential epilogue every unfused backend shares: subtract the two maps' outputs,
then the optional per-head RMSNorm and (1 - lambda_init) scale. Always computed in fp32 or wider."""
from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, else the input dtype (fp32 stays fp32, fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def diff_epilogue(o1: torch.Tensor, o2: torch.Tensor, lam: torch.Tensor, *, norm_weight=None,
                  lambda_init=None, eps: float = 1e-5, empty_rows=None, out_dtype=None) -> torch.Tensor:
    """``A = o1 - lam * o2``; then ``RMSNorm(A) * norm_weight * (1 - lambda_init)`` if lambda_init is given.

    Args:
        o1, o2: (B, h, N, 2d) outputs of the two softmax maps applied to V.
        lam: 0-d tensor.
        empty_rows: bool mask broadcastable to (B, h, N, 1) of rows that see no key (output 0).
    Returns:
        (B, N, h, 2d) in ``out_dtype`` (default o1's dtype).
    """
    ct = compute_dtype(o1.dtype)
    a = o1.to(ct) - lam.to(ct) * o2.to(ct)  # (B, h, N, 2d)
    if lambda_init is not None:
        a = a * torch.rsqrt(a.pow(2).mean(dim=-1, keepdim=True) + eps)
        if norm_weight is not None:
            a = a * norm_weight.to(a.dtype)
        a = a * (1.0 - lambda_init)
    if empty_rows is not None:
        a = a.masked_fill(empty_rows, 0.0)
    return a.transpose(1, 2).to(out_dtype or o1.dtype)
