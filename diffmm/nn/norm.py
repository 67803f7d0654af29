"""RMSNorm computed in fp32, with a hand-written backward."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn


class _RMSNormFn(torch.autograd.Function):
    """``y = x * rsqrt(mean(x^2) + eps) * w``: the forward of the plain formula, a fused backward
    (``dx = rstd * (g - x * rstd^2 * mean(g * x))`` with ``g = dy * w``) instead of an autograd graph of 7 ops."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float):
        ct = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(ct)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = xf * rstd
        if weight is not None:
            y = y * weight.to(ct)
        ctx.save_for_backward(x, rstd, weight)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        ct = rstd.dtype
        xf, g = x.to(ct), dy.to(ct)
        dw = None
        if weight is not None:
            t = g * xf  # (..., D)
            if ctx.needs_input_grad[1]:
                dw = (rstd.reshape(1, -1) @ t.reshape(-1, t.shape[-1])).reshape(-1).to(weight.dtype)
            wc = weight.to(ct)
            dot = t @ wc  # rowsum(dy * w * x)
            g = g * wc
        else:
            dot = (g * xf).sum(-1)
        coef = rstd.pow(3).mul_(dot.unsqueeze(-1)).div_(-x.shape[-1])  # -rstd^3 * mean(g * x)
        dx = g.mul_(rstd).addcmul_(xf, coef) if g is not dy else g.mul(rstd).addcmul_(xf, coef)
        return dx.to(x.dtype), dw, None


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 (fp64 for fp64 inputs), returned in x's dtype."""
    return _RMSNormFn.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim: ``x * rsqrt(mean(x^2) + eps) * weight``.

    Args:
        dim: size of the normalised (last) dim.
        eps: added to the mean square.
        elementwise_affine: learn a per-feature weight (init 1).
    """

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm input has last dim {x.shape[-1]}; expected {self.dim}")
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
