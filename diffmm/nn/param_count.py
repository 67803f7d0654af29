"""Attention parameter accounting at equal width: what DIFF V1 and V2 cost relative to standard attention.

Closed forms (E = width, H standard heads, d = E / H, H_kv kv heads, no biases):

    standard  q E*E + k,v 2*E*H_kv*d + out E*E                      = 2E^2 + 2E*H_kv*d
    diff (V1) the same projections (H/2 heads of 2 components)  + 6d  (lambda_q1/k1/q2/k2, norm weight 2d)
    diff_v2   q 2E*E + k,v 2*E*H_kv*d + out E*E + lambda E*H        = 3E^2 + 2E*H_kv*d + E*H
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from diffmm.nn.factory import create_attention

DEFAULT_TYPES = ("standard", "diff", "diff_v2")


def attention_param_report(dim: int, num_heads: int, num_kv_heads: Optional[int] = None, *,
                           qkv_bias: bool = False, proj_bias: bool = False,
                           attn_types: Sequence[str] = DEFAULT_TYPES) -> list[dict]:
    """Parameters of one attention layer per type, built by ``create_attention`` at the same width.

    Args:
        dim: width E.
        num_heads / num_kv_heads: heads of the standard Transformer at this width (as ``create_attention``).
        qkv_bias / proj_bias: projection biases.
        attn_types: registered attention types to report (any ``diffmm.nn.AttentionLayer`` subclass: its
            parameters are counted on the meta device, its ``query_maps`` read from the layer).

    Returns:
        One dict per type: ``attn_type``, ``heads``, ``query_maps``, ``kv_heads``, ``head_dim``, ``params``,
        ``vs_standard`` (params / standard params, None if standard is not in ``attn_types``), ``breakdown``
        (parameter name -> count), ``note`` (why a type cannot be built at this shape; its numbers are None).
    """
    rows = []
    for t in attn_types:
        try:
            with torch.device("meta"):  # shapes only, no memory
                m = create_attention(t, dim, num_heads, num_kv_heads=num_kv_heads, qkv_bias=qkv_bias,
                                     proj_bias=proj_bias)
        except ValueError as e:  # e.g. V1 cannot halve an odd number of kv heads
            rows.append(dict(attn_type=t, heads=None, query_maps=None, kv_heads=None, head_dim=None, params=None,
                             breakdown={}, note=str(e)))
            continue
        breakdown = {n: p.numel() for n, p in m.named_parameters()}
        rows.append(dict(attn_type=t, heads=m.num_heads, query_maps=m.query_maps, kv_heads=m.num_kv_heads,
                         head_dim=m.head_dim, params=sum(breakdown.values()), breakdown=breakdown, note=""))
    base = next((r["params"] for r in rows if r["attn_type"] == "standard"), None)
    for r in rows:
        r["vs_standard"] = None if base is None or r["params"] is None else r["params"] / base
    return rows
