"""``create_attention``: an attention layer by its registered ``attn_type`` (:data:`ATTENTION_LAYERS`)."""
from __future__ import annotations

from typing import Optional

from diffmm.nn.attention_layer import ATTENTION_LAYERS, AttentionLayer


def get_attention_class(attn_type: str) -> type[AttentionLayer]:
    """The layer class registered as ``attn_type``; a one-line error listing the known types otherwise."""
    try:
        return ATTENTION_LAYERS[attn_type]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention type {attn_type!r}; "
                         f"expected one of {', '.join(ATTENTION_LAYERS)}") from None


def create_attention(attn_type: str, dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                     **kwargs) -> AttentionLayer:
    """Build an attention layer for a Transformer of width ``dim`` with ``num_heads`` standard heads.

    A differential layer (``head_ratio == 2``) gets ``num_heads // 2`` heads of dim ``dim // num_heads``
    (as in the DIFF Transformer paper, arXiv 2410.05258: a DIFF model has half the heads of the Transformer it
    replaces, at the same width).

    Args:
        attn_type: a key of ``ATTENTION_LAYERS`` (``'standard'``, ``'diff'``, ...).
        num_heads / num_kv_heads: heads of the standard Transformer at this width.
        kwargs: passed to the layer (layer_idx, lambda_init, causal, use_rope, qkv_bias, proj_bias, backend...).
    """
    return get_attention_class(attn_type).build(dim, num_heads, num_kv_heads=num_kv_heads, **kwargs)
