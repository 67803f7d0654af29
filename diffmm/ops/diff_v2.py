"""DIFF V2 attention (unilm's ``Diff-Transformer-V2``): one standard attention call over 2h query heads, then a
pairwise epilogue ``O[2i] - sigmoid(lam_i) * O[2i+1]`` in fp32.

Because the heavy work is a plain GQA attention call, V2 runs on every backend that implements
:func:`diffmm.ops.attention` (reference, sdpa, flash, ...); no differential kernel is needed.
"""
from __future__ import annotations

import torch

from diffmm.ops.epilogue import compute_dtype
from diffmm.ops.functional import attention


def check_v2_heads(q_heads: int, kv_heads: int, who: str = "diff_v2_attention") -> None:
    """One-line error unless ``q_heads`` query maps pair up inside GQA groups of ``kv_heads`` kv heads."""
    if q_heads <= 0 or q_heads % 2:
        raise ValueError(f"{who}: needs an even, positive number of query maps (2h); got {q_heads}")
    if kv_heads <= 0 or q_heads % kv_heads or (q_heads // kv_heads) % 2:
        raise ValueError(f"{who}: 2h={q_heads} query maps over h_kv={kv_heads} kv heads must give an even group "
                         f"size 2h/h_kv so each pair (2i, 2i+1) shares one kv head; use h divisible by h_kv")


def diff_v2_epilogue(o: torch.Tensor, lam_logits: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``o[:, :, 2i] - sigmoid(lam_logits[..., i]) * o[:, :, 2i+1]`` in fp32 (fp64 for fp64 inputs).

    Args:
        o: (B, N, 2h, d_v) output of the standard attention call.
        lam_logits: (B, N, h) pre-sigmoid lambda.
    Returns:
        (B, N, h, d_v) in ``out_dtype`` (default o's dtype).
    """
    ct = compute_dtype(torch.promote_types(o.dtype, lam_logits.dtype))
    of = o.to(ct)
    lam = torch.sigmoid(lam_logits.to(ct)).unsqueeze(-1)  # (B, N, h, 1)
    return torch.addcmul(of[:, :, 0::2], lam, of[:, :, 1::2], value=-1.0).to(out_dtype or o.dtype)


def diff_v2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam_logits: torch.Tensor, *,
                      causal: bool = False, attn_mask: torch.Tensor | None = None,
                      backend: str | None = None) -> torch.Tensor:
    """DIFF V2 attention for every head.

    Args:
        q: (B, N, 2h, d). Head i subtracts query map 2i+1 from query map 2i.
        k: (B, S, h_kv, d). Query map j uses kv head j // (2h / h_kv); 2h / h_kv must be even so that
            both maps of a pair share a kv head (pairing across GQA groups is the wrong implementation).
        v: (B, S, h_kv, d_v) (d_v = d in the paper).
        lam_logits: (B, N, h) per-token, per-head lambda logits (``x @ W_lambda``); sigmoid is applied here.
        causal: bottom-right aligned causal mask (KV-cache friendly), as :func:`diffmm.ops.attention`.
        attn_mask: bool key padding (B, S), True = attend; or an additive float mask broadcastable to
            (B, 2h, N, S). A 4-dim float mask with h heads (B, h, N, S) is expanded to both maps of each head.
        backend: any backend implementing standard attention; default ``DIFFMM_ATTN_BACKEND`` or automatic.

    Returns:
        (B, N, h, d_v) in q's dtype; the subtraction runs in fp32 (or fp64).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-dim tensor (B, N, 2h, d); got {getattr(q, 'shape', type(q).__name__)}")
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        raise ValueError(f"k must be a 4-dim tensor (B, S, h_kv, d); got {getattr(k, 'shape', type(k).__name__)}")
    B, N, H2, _ = q.shape
    check_v2_heads(H2, k.shape[2])
    h = H2 // 2
    if not isinstance(lam_logits, torch.Tensor) or tuple(lam_logits.shape) != (B, N, h):
        raise ValueError(f"lam_logits has shape {tuple(getattr(lam_logits, 'shape', ()))}; "
                         f"expected (B, N, h) = ({B}, {N}, {h})")
    if not lam_logits.is_floating_point() or lam_logits.device != q.device:
        raise ValueError(f"lam_logits must be a float tensor on {q.device}; "
                         f"got {lam_logits.dtype} on {lam_logits.device}")
    if (attn_mask is not None and attn_mask.is_floating_point() and attn_mask.dim() == 4
            and attn_mask.shape[1] == h and h > 1):
        attn_mask = attn_mask.repeat_interleave(2, dim=1)  # (B, 2h, N, S): one mask per query map
    o = attention(q, k, v, causal=causal, attn_mask=attn_mask, backend=backend)  # (B, N, 2h, d_v)
    return diff_v2_epilogue(o, lam_logits, out_dtype=q.dtype)
