"""A preallocated key/value cache for incremental decoding (one per attention layer)."""
from __future__ import annotations

import torch


class KVCache:
    """Holds keys (B, S_max, Hk, dk) and values (B, S_max, Hv, dv) written so far.

    Args:
        max_len: capacity in positions.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k (B, n, Hk, dk), v (B, n, Hv, dv); return all cached keys and values so far."""
        B, n = k.shape[:2]
        if self.k is None:
            self.k = k.new_empty(B, self.max_len, *k.shape[2:])
            self.v = v.new_empty(B, self.max_len, *v.shape[2:])
        if self.length + n > self.max_len:
            raise ValueError(f"KVCache is full: {self.length} + {n} positions > max_len {self.max_len}")
        if k.shape[0] != self.k.shape[0] or k.shape[2:] != self.k.shape[2:]:
            raise ValueError(f"KVCache got k of shape {tuple(k.shape)}; expected (B={self.k.shape[0]}, n, "
                             f"{', '.join(map(str, self.k.shape[2:]))})")
        self.k[:, self.length:self.length + n] = k
        self.v[:, self.length:self.length + n] = v
        self.length += n
        return self.k[:, :self.length], self.v[:, :self.length]

    def reset(self) -> None:
        self.length = 0
