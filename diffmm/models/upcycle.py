"""Function-preserving conversion ("upcycling") of a pretrained standard attention layer: each attention type
says how in :meth:`diffmm.nn.AttentionLayer.load_standard` (the math of ``'diff'``:
:mod:`diffmm.nn.upcycled_diff_attention`). This module keeps the names it had before that move."""
from __future__ import annotations

from diffmm.nn.attention_layer import UPCYCLE_TYPES, StdAttnWeights
from diffmm.nn.upcycled_diff_attention import UpcycledDiffAttention

#: the attention type that reproduces a pretrained standard layer (``init='upcycle'`` of ``'diff'``)
UPCYCLED = UpcycledDiffAttention.attn_type

__all__ = ["UPCYCLED", "UPCYCLE_TYPES", "StdAttnWeights", "UpcycledDiffAttention"]
