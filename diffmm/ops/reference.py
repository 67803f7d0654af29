"""The ``reference`` backend: eager math with an fp32 (or wider) softmax. It is the formula of the DIFF
Transformer paper (arXiv 2410.05258, eq. 1 and its per-head norm) in code, and the oracle every other backend is
tested against."""
from __future__ import annotations

import torch

from diffmm.ops._validate import prepare_mask
from diffmm.ops.epilogue import compute_dtype, diff_epilogue


def _masked_softmax(scores: torch.Tensor, spec) -> torch.Tensor:
    if spec.mask is not None:
        if spec.mask.dtype == torch.bool:
            scores = scores.masked_fill(~spec.mask, float("-inf"))
        else:
            scores = scores + spec.mask.to(scores.dtype)
    elif spec.is_causal:
        N, S = scores.shape[-2:]
        keep = torch.ones(N, S, dtype=torch.bool, device=scores.device).tril(S - N)
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1)


def diff_attention_reference(q, k, v, lam, *, causal=False, attn_mask=None, norm_weight=None,
                             lambda_init=None, eps=1e-5) -> torch.Tensor:
    """Differential attention by the book. Shapes as in :func:`diffmm.ops.diff_attention`."""
    B, N, H2, d = q.shape
    S, h, h_kv = k.shape[1], H2 // 2, k.shape[2] // 2
    rep = h // h_kv
    ct = compute_dtype(q.dtype)
    spec = prepare_mask(attn_mask, causal, B, h, N, S, q.device, q.dtype)
    qt = q.to(ct).transpose(1, 2)  # (B, 2h, N, d)
    kt = k.to(ct).transpose(1, 2)  # (B, 2h_kv, S, d)
    k1 = kt[:, 0::2].repeat_interleave(rep, dim=1)  # (B, h, S, d): key component 2g for head i, g = i // rep
    k2 = kt[:, 1::2].repeat_interleave(rep, dim=1)
    vv = v.to(ct).transpose(1, 2).repeat_interleave(rep, dim=1)  # (B, h, S, 2d)
    scale = d ** -0.5
    p1 = _masked_softmax(qt[:, 0::2] @ k1.transpose(-1, -2) * scale, spec)  # (B, h, N, S)
    p2 = _masked_softmax(qt[:, 1::2] @ k2.transpose(-1, -2) * scale, spec)
    o1, o2 = p1 @ vv, p2 @ vv  # (B, h, N, 2d)
    return diff_epilogue(o1, o2, lam, norm_weight=norm_weight, lambda_init=lambda_init, eps=eps,
                         empty_rows=spec.empty_rows, out_dtype=q.dtype)


def attention_reference(q, k, v, *, causal=False, attn_mask=None, scale=None) -> torch.Tensor:
    """Standard softmax attention. q (B, N, H, d), k (B, S, H_kv, d), v (B, S, H_kv, d_v) -> (B, N, H, d_v)."""
    B, N, H, d = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    rep = H // H_kv
    ct = compute_dtype(q.dtype)
    spec = prepare_mask(attn_mask, causal, B, H, N, S, q.device, q.dtype)
    qt = q.to(ct).transpose(1, 2)
    kt = k.to(ct).transpose(1, 2).repeat_interleave(rep, dim=1)
    vt = v.to(ct).transpose(1, 2).repeat_interleave(rep, dim=1)
    scale = d ** -0.5 if scale is None else scale
    o = _masked_softmax(qt @ kt.transpose(-1, -2) * scale, spec) @ vt  # (B, H, N, d_v)
    if spec.empty_rows is not None:
        o = o.masked_fill(spec.empty_rows, 0.0)
    return o.transpose(1, 2).to(q.dtype)
