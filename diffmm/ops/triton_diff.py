"""The ``triton`` backend: one fused Triton kernel for differential attention, forward and backward.

Both softmax maps are computed in a single pass over K/V (docs/kernels.md); the subtraction, the
per-head RMSNorm and the ``(1 - lambda_init)`` scale run in the kernel's fp32 epilogue. The
kernels live in :mod:`diffmm.ops.triton_diff_fwd` and :mod:`diffmm.ops.triton_diff_bwd`; this
module wraps them as two ``torch.library`` custom ops (so ``torch.compile`` treats them as opaque
nodes instead of graph-breaking), an ``autograd.Function`` tying the two together, and the
backend registration.

Importing this module needs triton; without it the ``ImportError`` propagates and
``diffmm.ops`` simply does not register the backend.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton  # noqa: F401  (ImportError here means: no triton backend)

from diffmm.ops import triton_diff_bwd as _bwd
from diffmm.ops import triton_diff_fwd as _fwd
from diffmm.ops.registry import AttentionBackend, AttentionCall, register_backend

HEAD_DIMS = (32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
Tensor = torch.Tensor


def _interpreting() -> bool:
    """True when the kernels were built for, and are running under, ``TRITON_INTERPRET=1``."""
    env = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return env and _fwd.INTERPRET and _bwd.INTERPRET


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def unsupported_reason(call: AttentionCall) -> Optional[str]:
    """None when the fused kernel can run ``call``, else a one-line reason."""
    if call.op != "diff":
        return "the triton backend implements differential attention only"
    q = call.q
    dev = q.device
    if dev.type == "cuda":
        if _fwd.INTERPRET:
            return "kernels were built for TRITON_INTERPRET=1; unset it before importing diffmm to run on CUDA"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        cap = _capability(dev.index if dev.index is not None else torch.cuda.current_device())
        if cap < (8, 0) and q.dtype == torch.bfloat16:
            return f"bfloat16 needs compute capability 8.0+; device has {cap[0]}.{cap[1]}"
    elif dev.type == "cpu":
        if not _interpreting():
            return "runs on CUDA; on CPU only under TRITON_INTERPRET=1 (set before importing diffmm)"
        if q.dtype == torch.bfloat16:
            return "the Triton interpreter computes bfloat16 wrongly; use float16/float32 on CPU"
    else:
        return f"runs on CUDA (or CPU under TRITON_INTERPRET=1); q is on {dev}"
    if q.dtype not in DTYPES:
        return f"needs float16, bfloat16 or float32; q is {str(q.dtype).replace('torch.', '')}"
    if call.head_dim not in HEAD_DIMS:
        return f"component head dim must be one of {HEAD_DIMS}; got {call.head_dim}"
    m = call.attn_mask
    if m is not None:
        if m.dtype != torch.bool:
            return "additive float attn_mask is not supported by the fused kernel (bool key padding is)"
        if m.dim() != 2:
            return f"bool attn_mask must be a (B, S) key-padding mask; got shape {tuple(m.shape)}"
    return None


# ---------------------------------------------------------------------------------------------
# custom ops: opaque to torch.compile, with fake (meta) implementations for tracing


@torch.library.custom_op("diffmm::triton_diff_fwd", mutates_args=())
def triton_diff_fwd(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, w: Optional[Tensor], key_mask: Optional[Tensor],
                    causal: bool, norm: bool, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward. Returns y (B, N, h, 2d), o1, o2 (B, h, N, 2d) fp32, lse1, lse2, rstd (B, h, N) fp32."""
    km = key_mask.view(torch.uint8) if key_mask is not None else None
    return _fwd.diff_attn_fwd(q, k, v, lam, w, km, causal, norm, eps)


@triton_diff_fwd.register_fake
def _(q, k, v, lam, w, key_mask, causal, norm, eps):
    B, N, H2, d = q.shape
    h = H2 // 2
    o = q.new_empty(B, h, N, 2 * d, dtype=torch.float32)
    stat = q.new_empty(B, h, N, dtype=torch.float32)
    return (q.new_empty(B, N, h, 2 * d), o, torch.empty_like(o), stat, torch.empty_like(stat),
            torch.empty_like(stat))


@torch.library.custom_op("diffmm::triton_diff_bwd", mutates_args=())
def triton_diff_bwd(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, w: Optional[Tensor],
                    key_mask: Optional[Tensor], o1: Tensor, o2: Tensor, lse1: Tensor, lse2: Tensor, rstd: Tensor,
                    causal: bool, norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward. Returns dq, dk, dv (input dtype), dlam () fp32, dw (2d,) fp32."""
    km = key_mask.view(torch.uint8) if key_mask is not None else None
    return _bwd.diff_attn_bwd(dy, q, k, v, lam, w, km, o1, o2, lse1, lse2, rstd, causal, norm)


@triton_diff_bwd.register_fake
def _(dy, q, k, v, lam, w, key_mask, o1, o2, lse1, lse2, rstd, causal, norm):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), lam.new_empty(()),
            q.new_empty(q.shape[-1] * 2, dtype=torch.float32))


class TritonDiffAttention(torch.autograd.Function):
    """Fused differential attention; ``apply(q, k, v, lam, w, key_mask, causal, norm, eps) -> y``."""

    @staticmethod
    def forward(ctx, q, k, v, lam, w, key_mask, causal, norm, eps):
        y, o1, o2, lse1, lse2, rstd = torch.ops.diffmm.triton_diff_fwd(q, k, v, lam, w, key_mask, causal, norm, eps)
        ctx.save_for_backward(q, k, v, lam, w, key_mask, o1, o2, lse1, lse2, rstd)
        ctx.causal, ctx.norm = causal, norm
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, lam, w, key_mask, o1, o2, lse1, lse2, rstd = ctx.saved_tensors
        dq, dk, dv, dlam, dw = torch.ops.diffmm.triton_diff_bwd(
            dy, q, k, v, lam, w, key_mask, o1, o2, lse1, lse2, rstd, ctx.causal, ctx.norm)
        return dq, dk, dv, dlam, (dw if w is not None else None), None, None, None, None


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def diff_attention_triton(q, k, v, lam, *, causal=False, attn_mask=None, norm_weight=None, lambda_init=None,
                          eps=1e-5) -> Tensor:
    """Differential attention with the fused kernel. Shapes and semantics as in :func:`diffmm.ops.diff_attention`."""
    d = q.shape[-1]
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    lam = lam.to(device=q.device, dtype=torch.float32).reshape(())
    norm = lambda_init is not None
    w = None
    if norm:  # fold (1 - lambda_init) into the weight; autograd carries it to norm_weight (and lambda_init)
        base = norm_weight.to(torch.float32) if norm_weight is not None else q.new_ones(2 * d, dtype=torch.float32)
        w = (base * (1.0 - lambda_init)).contiguous()
    key_mask = attn_mask.contiguous() if attn_mask is not None else None
    return TritonDiffAttention.apply(q, k, v, lam, w, key_mask, bool(causal), norm, float(eps))


register_backend(AttentionBackend(
    "triton", diff_attention_triton, None, unsupported_reason,
    "fused Triton kernel: both maps in one pass, fused RMSNorm epilogue; CUDA (CPU under TRITON_INTERPRET=1)"))
