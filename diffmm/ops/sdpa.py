"""The ``sdpa`` backend: PyTorch ``scaled_dot_product_attention`` (and, on CPU, its FLOP-lean sibling).

Three layouts for the differential call (their FLOPs, memory and measurements: docs/attention.md, "Backends"):
``combined``, the two maps combined per query chunk before the one product with V (:mod:`diffmm.ops.combined`;
the CPU default); ``split``, V cut into its d-wide halves and the four (map, half) products stacked as 4h heads in
one flash-eligible SDPA call (the CUDA default); ``pair``, two SDPA calls with the 2d-wide V. Which one runs:
``layout=`` / ``DIFFMM_SDPA_LAYOUT`` if given; else ``combined`` on CPU; on CUDA ``pair`` for few queries
(KV-cache decoding, N <= ``PAIR_MAX_QUERIES``: ``split`` would copy the whole cache twice per token), else ``split``.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from diffmm.ops._validate import prepare_mask
from diffmm.ops.combined import combined_diff_attention
from diffmm.ops.epilogue import diff_epilogue

LAYOUTS = ("combined", "split", "pair")
PAIR_MAX_QUERIES = 16


def _sdpa(q, k, v, spec, scale, gqa: bool):
    """q (B, Hq, N, d), k/v (B, Hk, S, *) -> (B, Hq, N, d_v)."""
    mask = spec.mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
        if mask.shape[1] not in (1, q.shape[1]):  # per-head float mask over stacked heads
            mask = mask.repeat(1, q.shape[1] // mask.shape[1], 1, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=spec.is_causal, scale=scale,
                                          enable_gqa=gqa)


def _layout(layout: str | None, device: torch.device, N: int) -> str:
    """``layout=``, then ``DIFFMM_SDPA_LAYOUT``, then the device's default."""
    layout = layout or os.environ.get("DIFFMM_SDPA_LAYOUT")
    if layout is None:
        if device.type == "cpu":
            return "combined"
        return "pair" if N <= PAIR_MAX_QUERIES else "split"
    if layout not in LAYOUTS:
        raise ValueError(f"sdpa layout {layout!r} is unknown; expected one of {', '.join(LAYOUTS)}")
    return layout


def diff_attention_sdpa(q, k, v, lam, *, causal=False, attn_mask=None, norm_weight=None,
                        lambda_init=None, eps=1e-5, layout=None) -> torch.Tensor:
    """Differential attention through SDPA. Shapes as in :func:`diffmm.ops.diff_attention`."""
    B, N, H2, d = q.shape
    S, h, h_kv = k.shape[1], H2 // 2, k.shape[2] // 2
    spec = prepare_mask(attn_mask, causal, B, h, N, S, q.device, q.dtype)
    chosen = _layout(layout, q.device, N)
    if chosen == "combined":
        return combined_diff_attention(q, k, v, lam, spec, attn_mask=attn_mask, causal=causal, norm_weight=norm_weight,
                                       lambda_init=lambda_init, eps=eps)  # (B, N, h, 2d)
    # (B, 2h, N, d) (B, 2h_kv, S, d) (B, h_kv, S, 2d)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q1, q2 = qt[:, 0::2], qt[:, 1::2]  # (B, h, N, d)
    k1, k2 = kt[:, 0::2], kt[:, 1::2]  # (B, h_kv, S, d)
    scale, gqa = d ** -0.5, h != h_kv
    if chosen == "split":
        va, vb = vt[..., :d], vt[..., d:]  # (B, h_kv, S, d)
        Q = torch.cat([q1, q1, q2, q2], dim=1)  # (B, 4h, N, d)
        K = torch.cat([k1, k1, k2, k2], dim=1)  # (B, 4h_kv, S, d): block b of Q pairs with block b of K
        V = torch.cat([va, vb, va, vb], dim=1)
        out = _sdpa(Q, K, V, spec, scale, gqa)  # (B, 4h, N, d)
        o1 = torch.cat([out[:, :h], out[:, h:2 * h]], dim=-1)  # (B, h, N, 2d)
        o2 = torch.cat([out[:, 2 * h:3 * h], out[:, 3 * h:]], dim=-1)
    else:
        o1 = _sdpa(q1, k1, vt, spec, scale, gqa)  # (B, h, N, 2d)
        o2 = _sdpa(q2, k2, vt, spec, scale, gqa)
    return diff_epilogue(o1, o2, lam, norm_weight=norm_weight, lambda_init=lambda_init, eps=eps,
                         empty_rows=spec.empty_rows, out_dtype=q.dtype)


def attention_sdpa(q, k, v, *, causal=False, attn_mask=None, scale=None) -> torch.Tensor:
    """Standard attention through SDPA. q (B, N, H, d), k (B, S, H_kv, d), v (B, S, H_kv, d_v)."""
    B, N, H, d = q.shape
    spec = prepare_mask(attn_mask, causal, B, H, N, k.shape[1], q.device, q.dtype)
    o = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec,
              d ** -0.5 if scale is None else scale, H != k.shape[2])
    if spec.empty_rows is not None:
        o = o.masked_fill(spec.empty_rows, 0.0)
    return o.transpose(1, 2)
