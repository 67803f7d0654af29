"""Pre-norm Transformer blocks of the two CLIP towers, with attention from the ``diffmm.nn`` registry.

Parameter names follow the official DiffCLIP checkpoint (github hammoudhasan/DiffCLIP): vision blocks
``norm1 / attn / norm2 / mlp.fc1 / mlp.fc2`` (timm-style), text blocks ``ln_1 / attn / ln_2 / mlp.c_fc /
mlp.c_proj`` (open_clip-style).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from diffmm.nn import LayerNorm, create_act


Rows = Union[int, torch.Tensor, None]


def pick_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Tokens (B, N, W) -> the (B, W) row of each sample that ``rows`` names: one index for all samples (an int) or
    one per sample ((B,) long); ``x`` itself when ``rows`` is None."""
    if rows is None:
        return x
    if isinstance(rows, int):
        return x[:, rows]
    return x[torch.arange(x.shape[0], device=x.device), rows]


class LayerScale(nn.Module):
    """A learned per-channel scale of a residual branch (timm's ``LayerScale``: parameter ``gamma``; DINOv2)."""

    def __init__(self, width: int, init_value: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((width,), float(init_value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class VisionBlock(nn.Module):
    """``x + ls1(attn(norm1(x)))``, then ``x + ls2(mlp(norm2(x)))`` with an ``fc1 / act / fc2`` MLP; ``ls1`` /
    ``ls2`` are :class:`LayerScale` when ``layer_scale_init`` is set (DINOv2), else identities without weights."""

    def __init__(self, width: int, attn: nn.Module, mlp_ratio: float, act: str, eps: float,
                 layer_scale_init: Optional[float] = None):
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.norm1 = LayerNorm(width, eps=eps)
        self.attn = attn
        self.norm2 = LayerNorm(width, eps=eps)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", nn.Linear(width, hidden))
        self.mlp.add_module("act", create_act(act))
        self.mlp.add_module("fc2", nn.Linear(hidden, width))
        scaled = layer_scale_init is not None
        self.ls1 = LayerScale(width, layer_scale_init) if scaled else nn.Identity()
        self.ls2 = LayerScale(width, layer_scale_init) if scaled else nn.Identity()

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, rows: Rows = None) -> torch.Tensor:
        """(B, N, W) -> (B, N, W); with ``rows`` (:func:`pick_rows`) only those tokens leave the block, (B, W), and
        the MLP runs on them alone (a pooling tower's last block: the other tokens' MLP would be discarded)."""
        x = pick_rows(x + self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask)), rows)
        return x + self.ls2(self.mlp(self.norm2(x)))


class TextBlock(nn.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` with a ``c_fc / act / c_proj`` MLP."""

    def __init__(self, width: int, attn: nn.Module, mlp_ratio: float, act: str, eps: float):
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.ln_1 = LayerNorm(width, eps=eps)
        self.attn = attn
        self.ln_2 = LayerNorm(width, eps=eps)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(width, hidden))
        self.mlp.add_module("act", create_act(act))
        self.mlp.add_module("c_proj", nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, rows: Rows = None) -> torch.Tensor:
        """As :meth:`VisionBlock.forward`."""
        x = pick_rows(x + self.attn(self.ln_1(x), attn_mask=attn_mask), rows)
        return x + self.mlp(self.ln_2(x))
