"""diffmm's attention kernel contract: one place for every attention op and backend (and the fused LM-head loss,
``linear_cross_entropy``).

``import diffmm.ops`` needs only torch (and triton for the fused kernel, when installed).

    >>> from diffmm.ops import diff_attention
    >>> out = diff_attention(q, k, v, lam, causal=True)          # (B, N, h, 2d)
"""
from diffmm.ops import flash as _flash
from diffmm.ops.diff_v2 import diff_v2_attention
from diffmm.ops.functional import attention, diff_attention
from diffmm.ops.linear_cross_entropy import linear_cross_entropy
from diffmm.ops.reference import attention_reference, diff_attention_reference
from diffmm.ops.registry import (AUTO_ORDER, ENV_VAR, AttentionBackend, AttentionCall,
                                 get_backend, list_backends, register_backend, select_backend)
from diffmm.ops.sdpa import attention_sdpa, diff_attention_sdpa

register_backend(AttentionBackend(
    "reference", diff_attention_reference, attention_reference, lambda call: None,
    "eager math with fp32 softmax; the spec in code (N x S memory)"))
register_backend(AttentionBackend(
    "sdpa", diff_attention_sdpa, attention_sdpa, lambda call: None,
    "torch scaled_dot_product_attention; CPU: maps combined before V in chunks (standard-attention FLOPs)"))
register_backend(AttentionBackend(
    "flash", _flash.diff_attention_flash, _flash.attention_flash,
    lambda call: _flash.unsupported_reason(call.q, call.attn_mask, max(call.head_dim, call.value_dim)
                                           if call.op == "standard" else call.head_dim),
    "Dao-AILab flash-attn (optional extra 'flash'); CUDA, fp16/bf16, no attn_mask"))

try:  # the fused Triton kernel registers itself as backend "triton" when triton imports
    from diffmm.ops import triton_diff as _triton_diff  # noqa: F401
except ImportError:  # triton not installed, or the module not built yet
    pass

__all__ = [
    "diff_attention", "attention", "diff_v2_attention", "diff_attention_reference", "attention_reference",
    "diff_attention_sdpa", "attention_sdpa", "AttentionBackend", "AttentionCall", "register_backend",
    "get_backend", "list_backends", "select_backend", "AUTO_ORDER", "ENV_VAR", "linear_cross_entropy",
]
