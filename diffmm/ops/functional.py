"""The two public attention ops. Shapes and the layout of components are the contract every
backend implements (docs/attention.md)."""
from __future__ import annotations

import torch

from diffmm.ops._validate import check_attn_inputs, check_diff_inputs
from diffmm.ops.registry import AttentionCall, select_backend


def diff_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor | float, *,
                   causal: bool = False, attn_mask: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, lambda_init: float | torch.Tensor | None = None,
                   eps: float = 1e-5, backend: str | None = None) -> torch.Tensor:
    """Differential attention ``(softmax(Q1 K1^T) - lam * softmax(Q2 K2^T)) V`` for every head.

    Args:
        q: (B, N, 2h, d). Head i uses query components 2i and 2i+1 (the official interleaved layout).
        k: (B, S, 2h_kv, d). kv group g = i // (h / h_kv) uses key components 2g and 2g+1.
        v: (B, S, h_kv, 2d). kv group g uses value g.
        lam: scalar lambda (differentiable 0-d tensor, or a float).
        causal: causal mask aligned bottom-right (query i sees keys j <= i + S - N), as a KV cache needs.
        attn_mask: bool key-padding mask (B, S), True where the key takes part, or an additive
            float mask broadcastable to (B, h, N, S). Query rows that see no key output 0.
        norm_weight: (2d,) weight of the per-head RMSNorm; needs ``lambda_init``.
        lambda_init: when given, the head output is ``RMSNorm(A) * norm_weight * (1 - lambda_init)``.
        eps: RMSNorm epsilon.
        backend: a registered backend name; default ``DIFFMM_ATTN_BACKEND`` or automatic.

    Returns:
        (B, N, h, 2d) in q's dtype. Softmax, subtraction and norm run in fp32 (or fp64).
    """
    lam = check_diff_inputs(q, k, v, lam, norm_weight, lambda_init)
    d = q.shape[-1]
    impl = select_backend(AttentionCall("diff", q, attn_mask, causal, d, 2 * d), backend)
    return impl.diff(q, k, v, lam, causal=causal, attn_mask=attn_mask, norm_weight=norm_weight,
                     lambda_init=lambda_init, eps=eps)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              attn_mask: torch.Tensor | None = None, scale: float | None = None,
              backend: str | None = None) -> torch.Tensor:
    """Standard softmax attention with GQA.

    Args:
        q: (B, N, H, d); k: (B, S, H_kv, d); v: (B, S, H_kv, d_v); query head j uses kv head j // (H / H_kv).
        causal, attn_mask, backend: as in :func:`diff_attention`.
        scale: softmax scale, default d**-0.5.

    Returns:
        (B, N, H, d_v) in q's dtype.
    """
    check_attn_inputs(q, k, v)
    impl = select_backend(AttentionCall("standard", q, attn_mask, causal, q.shape[-1], v.shape[-1]), backend)
    return impl.standard(q, k, v, causal=causal, attn_mask=attn_mask, scale=scale)
