"""lambda_init schedules of differential attention (SPEC section 1)."""
from __future__ import annotations

import math

import torch


def lambda_init_depth(layer: int) -> float:
    """``0.8 - 0.6 * exp(-0.3 * layer)`` for 0-based ``layer``: 0.2, 0.356, 0.471, ..."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


def resolve_lambda_init(spec: str | float, layer: int) -> float:
    """``'depth'`` -> the depth schedule, ``'constant'`` -> 0.8 (DiffCLIP), a number -> itself."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return float(spec)
    if spec == "depth":
        return lambda_init_depth(layer)
    if spec == "constant":
        return 0.8
    raise ValueError(f"lambda_init {spec!r} is unknown; expected 'depth', 'constant' or a number")


class _LambdaFull(torch.autograd.Function):
    """``exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` as one autograd node (the eager graph has ten)."""

    @staticmethod
    def forward(ctx, lq1, lk1, lq2, lk2, lambda_init: float):
        ct = torch.promote_types(lq1.dtype, torch.float32)
        vecs = [t.to(ct) for t in (lq1, lk1, lq2, lk2)]
        e1 = torch.dot(vecs[0], vecs[1]).exp_()
        e2 = torch.dot(vecs[2], vecs[3]).exp_()
        ctx.save_for_backward(*vecs, e1, e2)
        ctx.dtypes = (lq1.dtype, lk1.dtype, lq2.dtype, lk2.dtype)
        return e1 - e2 + lambda_init

    @staticmethod
    def backward(ctx, g):
        q1, k1, q2, k2, e1, e2 = ctx.saved_tensors
        g1, g2 = g * e1, -g * e2
        dt = ctx.dtypes
        return (k1.mul(g1).to(dt[0]), q1.mul(g1).to(dt[1]), k2.mul(g2).to(dt[2]), q2.mul(g2).to(dt[3]), None)


def lambda_full(lq1: torch.Tensor, lk1: torch.Tensor, lq2: torch.Tensor, lk2: torch.Tensor,
                lambda_init: float) -> torch.Tensor:
    """SPEC section 1's re-parameterised lambda as a 0-d tensor in fp32 (fp64 for fp64 vectors); differentiable."""
    return _LambdaFull.apply(lq1, lk1, lq2, lk2, float(lambda_init))
