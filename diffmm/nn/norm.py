"""RMSNorm computed in fp32 (fp64 for fp64 inputs); a LayerNorm that runs in its weights' dtype under mixed
precision."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


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
        ct = torch.promote_types(x.dtype, torch.float32)
        w = None if self.weight is None else self.weight.to(ct)
        return F.rms_norm(x.to(ct), (self.dim,), w, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that also takes inputs of another float dtype than its weights: it then normalises in the
    weights' dtype and returns the input's (open_clip's ``LayerNormFp32`` under its mixed ``fp16`` / ``bf16``
    precision, where norms keep fp32 weights and activations are low precision). Same dtype: plain LayerNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or x.dtype == self.weight.dtype:
            return super().forward(x)
        return F.layer_norm(x.to(self.weight.dtype), self.normalized_shape, self.weight, self.bias,
                            self.eps).to(x.dtype)
