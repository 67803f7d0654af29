"""Rotary position embedding, NeoX ``rotate_half`` convention (as LLaMA and HF DiffLlama).

For differential attention RoPE rotates each d-wide component (SPEC section 1), so the
rotation dim is the component head dim d.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for positions.

    :meth:`range` slices a table of positions ``0 .. max_positions - 1`` computed once per device and dtype (and
    again only if ``inv_freq`` changes); :meth:`forward` (any positions) and positions beyond the table are
    computed on the fly with the same arithmetic, so both give identical values.

    Args:
        dim: rotated dim (even).
        theta: base frequency.
        max_positions: table size.
    """

    def __init__(self, dim: int, theta: float = 10000.0, max_positions: int = 4096):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE dim must be even; got {dim}")
        self.dim, self.theta = dim, theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.max_positions = max_positions
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _compute(self, positions: torch.Tensor, ct: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.inv_freq.device, ct)[..., None] * self.inv_freq.to(ct)  # (..., N, dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]  # (..., N, 1, dim)
        return emb.cos(), emb.sin()

    def _table(self, ct: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.inv_freq
        key = (f.device, f.dtype, f.data_ptr(), f._version, ct)
        table = self._tables.get(key)
        if table is None:
            self._tables.clear()
            table = self._tables[key] = self._compute(torch.arange(self.max_positions, device=f.device), ct)
        return table

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (N,) or (B, N) int -> cos, sin of shape (..., N, 1, dim), ready to broadcast over heads."""
        cos, sin = self._compute(positions, torch.promote_types(dtype, torch.float32))
        return cos.to(dtype), sin.to(dtype)

    def range(self, start: int, length: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (length, 1, dim) for positions ``start .. start + length - 1`` (views of the table; no copy)."""
        ct = torch.promote_types(dtype, torch.float32)
        if 0 <= start and start + length <= self.max_positions:
            cos, sin = self._table(ct)
            cos, sin = cos[start:start + length], sin[start:start + length]
        else:
            cos, sin = self._compute(torch.arange(start, start + length, device=self.inv_freq.device), ct)
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}, max_positions={self.max_positions}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` = ``[x1 c1 - x2 s1, x2 c2 + x1 s2]``, or its transpose (the backward)
    ``[x1 c1 + x2 s2, x2 c2 - x1 s1]``, written half by half into one output in fp32 (fp64 for fp64 x)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    out = torch.empty(x.shape, dtype=ct, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    if transpose:
        torch.mul(x1, c1, out=o1).addcmul_(x2, s2)
        torch.mul(x2, c2, out=o2).addcmul_(x1, s1, value=-1.0)
    else:
        torch.mul(x1, c1, out=o1).addcmul_(x2, s1, value=-1.0)
        torch.mul(x2, c2, out=o2).addcmul_(x1, s2)
    return out if x.dtype == ct else out.to(x.dtype)


class _Rope(torch.autograd.Function):
    """RoPE with a hand-written backward (the inverse rotation): no autograd graph of six elementwise ops."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, True), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, N, H, dim) by cos/sin (N or B,N, 1, dim); computed in fp32 (fp64 for fp64 inputs)."""
    if cos.requires_grad or sin.requires_grad or torch.compiler.is_compiling():
        # differentiable tables (unusual), or under torch.compile (inductor fuses the plain formula): autograd
        ct = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(ct)
        return (xf * cos.to(ct) + rotate_half(xf) * sin.to(ct)).to(x.dtype)
    return _Rope.apply(x, cos, sin)
