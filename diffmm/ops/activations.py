"""QuickGELU with a one-pass backward: the activation of CLIP's text MLP.

Kept for its measured gain (docs/attention.md, section "CPU special paths"): the activation's forward+backward
is 1.35-1.9x faster than autograd of the plain formula, about 3 % of a DiffCLIP-Tiny training step at 2 threads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: ATen's fused SiLU derivative, ``dy * silu'(z)`` in one pass (a private operator: tests/ops/test_private_ops.py
#: checks its schema and its result against autograd).
_silu_backward = torch.ops.aten.silu_backward


class _QuickGELU(torch.autograd.Function):
    """``x * sigmoid(1.702 x) = silu(1.702 x) / 1.702``, so the derivative is ``silu'(1.702 x)``."""

    @staticmethod
    def forward(ctx, x):
        z = x * 1.702
        ctx.save_for_backward(z)
        return F.silu(z).mul_(1 / 1.702)

    @staticmethod
    def backward(ctx, dy):
        (z,) = ctx.saved_tensors
        return _silu_backward(dy, z)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` (equal to the plain formula up to rounding)."""
    if torch.compiler.is_compiling():  # inductor fuses the plain formula itself
        return x * torch.sigmoid(1.702 * x)
    return _QuickGELU.apply(x)
