"""The attention-layer registry: ``attn_type`` string -> layer class, and ``create_attention``."""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from diffmm.nn.attention import Attention
from diffmm.nn.diff_attention import DiffAttention

# Each entry: (class, components per head). A differential layer at the same width has half the heads.
ATTENTION_LAYERS: dict[str, tuple[type[nn.Module], int]] = {
    "standard": (Attention, 1),
    "diff": (DiffAttention, 2),
}


def register_attention(name: str, cls: type[nn.Module], components: int) -> None:
    """Make ``cls`` buildable as ``attn_type=name``. ``components`` = query maps per head (1 or 2)."""
    ATTENTION_LAYERS[name] = (cls, components)


def create_attention(attn_type: str, dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                     **kwargs) -> nn.Module:
    """Build an attention layer for a Transformer of width ``dim`` with ``num_heads`` standard heads.

    A differential layer (``components == 2``) gets ``num_heads // 2`` heads of dim ``dim // num_heads``
    (as in the DIFF Transformer paper, arXiv 2410.05258: a DIFF model has half the heads of the Transformer it
    replaces, at the same width).

    Args:
        attn_type: a key of ``ATTENTION_LAYERS`` (``'standard'``, ``'diff'``, ...).
        num_heads / num_kv_heads: heads of the standard Transformer at this width.
        kwargs: passed to the layer (layer_idx, lambda_init, causal, use_rope, qkv_bias, proj_bias, backend...).
    """
    try:
        cls, comps = ATTENTION_LAYERS[attn_type]
    except KeyError:
        raise ValueError(f"unknown attention type {attn_type!r}; "
                         f"expected one of {', '.join(ATTENTION_LAYERS)}") from None
    num_kv_heads = num_kv_heads or num_heads
    if comps > 1 and (num_heads % comps or num_kv_heads % comps):
        raise ValueError(f"attention type {attn_type!r} needs num_heads ({num_heads}) and num_kv_heads "
                         f"({num_kv_heads}) divisible by {comps}")
    if dim % num_heads:
        raise ValueError(f"width {dim} is not divisible by num_heads {num_heads}")
    return cls(dim, num_heads // comps, num_kv_heads=num_kv_heads // comps, head_dim=dim // num_heads, **kwargs)
