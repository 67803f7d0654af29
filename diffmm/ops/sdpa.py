"""The ``sdpa`` backend: PyTorch ``scaled_dot_product_attention`` (and, on CPU, its FLOP-lean sibling).

Five layouts for the differential call (FLOPs per head in units of N*S*d, forward):

- ``combined`` (4): the two maps are formed per query chunk and combined, ``(P1 - lam*P2) V``, before the one
  product with V (:mod:`diffmm.ops.combined`, pure PyTorch with a recomputing backward and the head norm fused).
  The FLOPs of standard attention of equal width and memory linear in N.
- ``split`` (8): V is cut into its two d-wide halves and the four (map, half) products are stacked as 4h heads
  of width d in one SDPA call. Equal q/k/v head dims make it eligible for the flash kernels (CPU and CUDA), so
  memory stays linear in N, but every QK^T is computed twice.
- ``halves`` (8): HF DiffLlama's layout, two flash-eligible SDPA calls over all 2h components, one per d-wide
  half of V (no stacking copy of Q and K).
- ``flash2d`` (8): one flash-eligible SDPA call over the 2h components with the whole 2d-wide V; q and k are
  zero-padded to 2d so the head dims match (the padding doubles the QK^T FLOPs, not the result).
- ``pair`` (6): two SDPA calls, one per map, each with the 2d-wide V. On CPU the flash kernel needs equal head
  dims, so this falls back to the math kernel (an N x S matrix); on CUDA the memory-efficient kernel takes it.

Which one runs: ``layout=`` / ``DIFFMM_SDPA_LAYOUT`` if given; for a few queries (KV-cache decoding,
N <= ``PAIR_MAX_QUERIES``) ``pair`` (the N x S matrix is tiny, and the other layouts would copy the whole cache);
on CPU the measured table of :mod:`diffmm.ops.tune` (``scripts/bench_attention.py --tune`` regenerates it);
else ``DEFAULT_LAYOUT`` of the device.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from diffmm.ops._validate import prepare_mask
from diffmm.ops.combined import combined_diff_attention
from diffmm.ops.epilogue import diff_epilogue
from diffmm.ops.tune import choose_layout, mask_kind

DEFAULT_LAYOUT = {"cpu": "combined", "cuda": "split"}
LAYOUTS = ("split", "pair", "combined", "halves", "flash2d")
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


def _blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, L, 2n, d) interleaved components -> (B, 2n, L, d) in block order (component m of head i at m*n + i)."""
    B, L, _, d = x.shape
    return x.view(B, L, n, 2, d).permute(0, 3, 2, 1, 4).reshape(B, 2 * n, L, d)


def _layout(q: torch.Tensor, layout: str | None, spec, B: int, N: int, S: int, h: int, d: int,
            grad: bool) -> str:
    """The layout for this call: ``layout=``, then ``DIFFMM_SDPA_LAYOUT``, then ``pair`` for a few queries
    (decoding), then (CPU) the measured table, then ``DEFAULT_LAYOUT`` of the device."""
    layout = layout or os.environ.get("DIFFMM_SDPA_LAYOUT")
    if layout is None and N <= PAIR_MAX_QUERIES:
        layout = "pair"  # decoding: no copy of the KV cache
    if layout is None and q.device.type == "cpu":
        layout = choose_layout(LAYOUTS, B=B, N=N, S=S, h=h, d=d, dtype=q.dtype, mask=mask_kind(spec), grad=grad)
    if layout is None:
        layout = DEFAULT_LAYOUT.get(q.device.type, "split")
    if layout not in LAYOUTS:
        raise ValueError(f"sdpa layout {layout!r} is unknown; expected one of {', '.join(LAYOUTS)}")
    return layout


@torch.compiler.disable  # runs eagerly under torch.compile: layout dispatch (table lookup) and the combined node
def diff_attention_sdpa(q, k, v, lam, *, causal=False, attn_mask=None, norm_weight=None,
                        lambda_init=None, eps=1e-5, layout=None, shapes=None) -> torch.Tensor:
    """Differential attention through SDPA. Shapes as in :func:`diffmm.ops.diff_attention`."""
    B, N, H2, d = q.shape
    S, h, h_kv = k.shape[1], H2 // 2, k.shape[2] // 2
    spec = prepare_mask(attn_mask, causal, B, h, N, S, q.device, q.dtype)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, lam))
    chosen = _layout(q, layout, spec, B, N, S, h, d, grad)
    if chosen == "combined":
        return combined_diff_attention(q, k, v, lam, spec, attn_mask=attn_mask, causal=causal, norm_weight=norm_weight,
                                       lambda_init=lambda_init, eps=eps)  # (B, N, h, 2d)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, 2h, N, d) (B, 2h_kv, S, d) (B, h_kv, S, 2d)
    q1, q2 = qt[:, 0::2], qt[:, 1::2]  # (B, h, N, d)
    k1, k2 = kt[:, 0::2], kt[:, 1::2]  # (B, h_kv, S, d)
    scale, gqa = d ** -0.5, h != h_kv
    if chosen == "split":
        va, vb = vt[..., :d], vt[..., d:]  # (B, h_kv, S, d)
        Q = torch.cat([q1, q1, q2, q2], dim=1)  # (B, 4h, N, d)
        K = torch.cat([k1, k1, k2, k2], dim=1)  # (B, 4h_kv, S, d): block b of Q pairs with block b of K
        V = torch.cat([va, vb, va, vb], dim=1)
        O = _sdpa(Q, K, V, spec, scale, gqa)  # (B, 4h, N, d)
        o1 = torch.cat([O[:, :h], O[:, h:2 * h]], dim=-1)  # (B, h, N, 2d)
        o2 = torch.cat([O[:, 2 * h:3 * h], O[:, 3 * h:]], dim=-1)
    elif chosen == "halves":
        Q, K = _blocks(q, h), _blocks(k, h_kv)  # (B, 2h, N, d), (B, 2h_kv, S, d): component m of head i at m*h + i
        va, vb = (x.repeat(1, 2, 1, 1) for x in (vt[..., :d], vt[..., d:]))  # (B, 2h_kv, S, d)
        Oa, Ob = _sdpa(Q, K, va, spec, scale, gqa), _sdpa(Q, K, vb, spec, scale, gqa)  # (B, 2h, N, d)
        o1 = torch.cat([Oa[:, :h], Ob[:, :h]], dim=-1)  # (B, h, N, 2d)
        o2 = torch.cat([Oa[:, h:], Ob[:, h:]], dim=-1)
    elif chosen == "flash2d":
        Q = F.pad(_blocks(q, h), (0, d))  # (B, 2h, N, 2d): zero-padded so q, k, v share a head dim (flash)
        K = F.pad(_blocks(k, h_kv), (0, d))
        O = _sdpa(Q, K, vt.repeat(1, 2, 1, 1), spec, scale, gqa)  # (B, 2h, N, 2d)
        o1, o2 = O[:, :h], O[:, h:]
    else:
        o1 = _sdpa(q1, k1, vt, spec, scale, gqa)  # (B, h, N, 2d)
        o2 = _sdpa(q2, k2, vt, spec, scale, gqa)
    return diff_epilogue(o1, o2, lam, norm_weight=norm_weight, lambda_init=lambda_init, eps=eps,
                         empty_rows=spec.empty_rows, out_dtype=q.dtype)


def attention_sdpa(q, k, v, *, causal=False, attn_mask=None, scale=None, shapes=None) -> torch.Tensor:
    """Standard attention through SDPA. q (B, N, H, d), k (B, S, H_kv, d), v (B, S, H_kv, d_v)."""
    B, N, H, d = q.shape
    spec = prepare_mask(attn_mask, causal, B, H, N, k.shape[1], q.device, q.dtype)
    o = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec,
              d ** -0.5 if scale is None else scale, H != k.shape[2])
    if spec.empty_rows is not None:
        o = o.masked_fill(spec.empty_rows, 0.0)
    return o.transpose(1, 2)
