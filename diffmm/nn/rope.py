"""Rotary position embedding, NeoX ``rotate_half`` convention (as LLaMA and HF DiffLlama).

For differential attention RoPE rotates each d-wide query/key component (as the official DIFF Transformer
code), so the rotation dim is the component head dim d.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class RotaryEmbedding(nn.Module):
    """Cos/sin of positions, computed per call in fp32 (fp64 for a fp64 ``dtype``) and returned in ``dtype``.

    Args:
        dim: rotated dim (even).
        theta: base frequency.
    """

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE dim must be even; got {dim}")
        self.dim, self.theta = dim, theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (N,) or (B, N) int -> cos, sin of shape (..., N, 1, dim), ready to broadcast over heads."""
        ct = torch.promote_types(dtype, torch.float32)
        freqs = positions.to(self.inv_freq.device, ct)[..., None] * self.inv_freq.to(ct)  # (..., N, dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]  # (..., N, 1, dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def range(self, start: int, length: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (length, 1, dim) for positions ``start .. start + length - 1``."""
        return self(torch.arange(start, start + length, device=self.inv_freq.device), dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, N, H, dim) by cos/sin (N or B,N, 1, dim); computed in fp32 (fp64 for fp64 inputs)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    return (xf * cos.to(ct) + rotate_half(xf) * sin.to(ct)).to(x.dtype)
