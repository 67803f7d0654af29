"""The ``flash`` backend: Dao-AILab flash-attn, when it is installed (``pip install diffmm[flash]``).

flash-attn needs equal q/k/v head dims, so the differential call uses the ``split`` layout of the
``sdpa`` backend (4h heads of width d, one call). It handles causal masks (bottom-right aligned,
as diffmm's contract) and GQA natively; key-padding and additive masks are not supported here,
so the dispatcher falls back for those calls.
"""
from __future__ import annotations

import torch

from diffmm.ops.epilogue import diff_epilogue

try:  # optional dependency
    from flash_attn import flash_attn_func as _flash_attn_func
except Exception:  # ImportError, or a broken CUDA build
    _flash_attn_func = None


def is_available() -> bool:
    return _flash_attn_func is not None and torch.cuda.is_available()


def unsupported_reason(q, attn_mask=None, head_dim=None) -> str | None:
    """None if flash-attn can run this call, else why not."""
    if _flash_attn_func is None:
        return "flash-attn is not installed (pip install 'diffmm[flash]')"
    if q.device.type != "cuda":
        return f"flash-attn runs on CUDA only; q is on {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16 or bfloat16; q is {q.dtype}"
    if attn_mask is not None:
        return "flash-attn backend does not take attn_mask (key padding or additive)"
    if (head_dim or q.shape[-1]) > 256:
        return f"flash-attn supports head dims up to 256; got {head_dim or q.shape[-1]}"
    return None


def diff_attention_flash(q, k, v, lam, *, causal=False, attn_mask=None, norm_weight=None,
                         lambda_init=None, eps=1e-5) -> torch.Tensor:
    """Differential attention with one flash-attn call. Shapes as in :func:`diffmm.ops.diff_attention`."""
    h, d = q.shape[2] // 2, q.shape[3]
    q1, q2 = q[:, :, 0::2], q[:, :, 1::2]  # (B, N, h, d)
    k1, k2 = k[:, :, 0::2], k[:, :, 1::2]  # (B, S, h_kv, d)
    va, vb = v[..., :d], v[..., d:]
    Q = torch.cat([q1, q1, q2, q2], dim=2)  # (B, N, 4h, d)
    K = torch.cat([k1, k1, k2, k2], dim=2).contiguous()
    V = torch.cat([va, vb, va, vb], dim=2).contiguous()
    out = _flash_attn_func(Q.contiguous(), K, V, softmax_scale=d ** -0.5, causal=causal)  # (B, N, 4h, d)
    out = out.transpose(1, 2)  # (B, 4h, N, d)
    o1 = torch.cat([out[:, :h], out[:, h:2 * h]], dim=-1)
    o2 = torch.cat([out[:, 2 * h:3 * h], out[:, 3 * h:]], dim=-1)
    return diff_epilogue(o1, o2, lam, norm_weight=norm_weight, lambda_init=lambda_init, eps=eps, out_dtype=q.dtype)


def attention_flash(q, k, v, *, causal=False, attn_mask=None, scale=None) -> torch.Tensor:
    """Standard attention with flash-attn. q (B, N, H, d), k/v (B, S, H_kv, d)."""
    return _flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
