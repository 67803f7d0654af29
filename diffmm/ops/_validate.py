"""Input checks and mask preparation shared by every attention backend.

Every error is one line naming the tensor and what was expected.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fmt(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {str(t.dtype).replace('torch.', '')}, device {t.device}"


def check_4d(**tensors: torch.Tensor) -> None:
    """Each argument is a 4-dim tensor; an FX ``Proxy`` gets its own message (call the op as an FX leaf)."""
    for name, t in tensors.items():
        if isinstance(t, torch.fx.Proxy):
            raise TypeError(f"{name} is an FX Proxy: diffmm ops take real tensors; call them from a diffmm layer "
                            f"(FX leaves) or torch.fx.wrap the op in the module that calls it")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has {_fmt(t)}; expected 4 dims")


def _check_same(name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {ref.dtype} like q")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}; expected {ref.device} like q")


def check_diff_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor | float,
    norm_weight: torch.Tensor | None, lambda_init,
) -> torch.Tensor:
    """Validate a ``diff_attention`` call. Returns ``lam`` as a 0-d tensor."""
    check_4d(q=q, k=k, v=v)
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; expected one of float16, bfloat16, float32, float64")
    B, N, H2, d = q.shape
    if d == 0 or H2 == 0:
        raise ValueError(f"q has shape {tuple(q.shape)}; expected (B, N, 2*h, d) with h >= 1 and head dim d >= 1")
    if H2 % 2:
        raise ValueError(f"q has shape {tuple(q.shape)}; expected (B, N, 2*h, d) with an even number of components")
    h = H2 // 2
    if k.shape[0] != B or k.shape[3] != d or k.shape[2] % 2:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected (B={B}, S, 2*h_kv, d={d})")
    S, h_kv = k.shape[1], k.shape[2] // 2
    if tuple(v.shape) != (B, S, h_kv, 2 * d):
        raise ValueError(f"v has shape {tuple(v.shape)}; expected (B={B}, S={S}, h_kv={h_kv}, 2*d={2 * d})")
    if h_kv == 0 or h % h_kv:
        raise ValueError(f"q has {h} differential heads and k has {h_kv}; expected h divisible by h_kv")
    _check_same("k", k, q)
    _check_same("v", v, q)
    if not isinstance(lam, torch.Tensor):
        if isinstance(lam, bool) or not isinstance(lam, (int, float)):
            raise TypeError(f"lam is a {type(lam).__name__} ({lam!r:.40}); expected a float or a 0-d tensor")
        lam = torch.tensor(float(lam), device=q.device)
    if not lam.is_floating_point():
        raise TypeError(f"lam has dtype {lam.dtype}; expected a floating-point tensor")
    if lam.numel() != 1:
        raise ValueError(f"lam has shape {tuple(lam.shape)}; expected a scalar tensor")
    if lam.device != q.device:
        raise ValueError(f"lam is on {lam.device}; expected {q.device} like q")
    lam = lam.reshape(())
    if norm_weight is not None:
        if lambda_init is None:
            raise ValueError("norm_weight was given without lambda_init; pass both to fuse the per-head RMSNorm")
        if tuple(norm_weight.shape) != (2 * d,):
            raise ValueError(f"norm_weight has shape {tuple(norm_weight.shape)}; expected (2*d,) = ({2 * d},)")
        if norm_weight.device != q.device:
            raise ValueError(f"norm_weight is on {norm_weight.device}; expected {q.device} like q")
    return lam


def check_attn_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Validate a standard ``attention`` call: q (B, N, H, d), k (B, S, H_kv, d), v (B, S, H_kv, d_v)."""
    check_4d(q=q, k=k, v=v)
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; expected one of float16, bfloat16, float32, float64")
    B, N, H, d = q.shape
    if d == 0 or H == 0:
        raise ValueError(f"q has shape {tuple(q.shape)}; expected (B, N, H, d) with H >= 1 and head dim d >= 1")
    if k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected (B={B}, S, H_kv, d={d})")
    S, H_kv = k.shape[1], k.shape[2]
    if v.shape[:3] != (B, S, H_kv):
        raise ValueError(f"v has shape {tuple(v.shape)}; expected (B={B}, S={S}, H_kv={H_kv}, d_v)")
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"q has {H} heads and k has {H_kv}; expected H divisible by H_kv")
    _check_same("k", k, q)
    _check_same("v", v, q)


@dataclass
class MaskSpec:
    """A prepared mask.

    Attributes:
        mask: None, a bool mask (True = attend) or an additive float mask, broadcastable to
            (B, heads, N, S). Rows that would see no key are opened to all keys (so no backend
            produces NaN) and listed in ``empty_rows``.
        is_causal: True when the only masking is a square causal mask (backends may use a fast flag).
        empty_rows: None (no mask) or bool (B or 1, 1 or heads, N, 1): query rows with no visible key (possibly
            none); their output is 0.
    """

    mask: torch.Tensor | None
    is_causal: bool
    empty_rows: torch.Tensor | None


def causal_keep(N: int, S: int, device) -> torch.Tensor:
    """Bool (N, S) causal mask aligned bottom-right: query i sees key j iff j <= i + S - N.

    With S == N this is the usual lower triangle; with S > N (a KV cache) the N new queries are
    the last N positions.
    """
    i = torch.arange(N, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    return j <= i + (S - N)


def mask_floor(*dtypes: torch.dtype) -> float:
    """Additive mask values at or below this count as masked (-inf): the least negative of ``finfo(dtype).min``
    over the call's and the mask's dtypes and float32 (so HF-style ``finfo(float32).min`` rows mask in every
    backend and dtype, and a float16 mask's -65504 does too)."""
    return max(torch.finfo(t).min for t in (torch.float32, *dtypes))


def prepare_mask(attn_mask: torch.Tensor | None, causal: bool, B: int, heads: int, N: int, S: int,
                 device, dtype: torch.dtype = torch.float32) -> MaskSpec:
    """Check ``attn_mask`` and combine it with ``causal``.

    Args:
        attn_mask: None; a bool key-padding mask (B, S), True where the key takes part; or an
            additive float mask broadcastable to (B, heads, N, S). Additive values at or below
            :func:`mask_floor` (e.g. ``finfo(float32).min``, or ``finfo(float16).min`` for a float16 call)
            mean "masked" and become -inf, so every backend and dtype agrees on them.
        causal: apply a bottom-right aligned causal mask.
        dtype: the dtype of q (it sets the floor for additive masks).
    """
    if attn_mask is None:
        if not causal:
            return MaskSpec(None, False, None)
        if N == S:
            return MaskSpec(None, True, None)
        keep = causal_keep(N, S, device)[None, None]  # (1, 1, N, S)
        return _open_empty_bool(keep)
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor; got {type(attn_mask).__name__}")
    if attn_mask.device != torch.device(device) and attn_mask.device.type != torch.device(device).type:
        raise ValueError(f"attn_mask is on {attn_mask.device}; expected {device} like q")
    if attn_mask.dtype == torch.bool:
        if tuple(attn_mask.shape) != (B, S):
            raise ValueError(
                f"attn_mask (bool key-padding) has shape {tuple(attn_mask.shape)}; expected (B, S) = ({B}, {S})")
        keep = attn_mask.to(device)[:, None, None, :]  # (B, 1, 1, S)
        if causal:
            keep = keep & causal_keep(N, S, device)[None, None]
        return _open_empty_bool(keep)
    if not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask has dtype {attn_mask.dtype}; expected bool (key padding) or float (additive)")
    if attn_mask.dim() > 4:
        raise ValueError(f"attn_mask has shape {tuple(attn_mask.shape)}; expected at most 4 dims (B, h, N, S)")
    try:
        full = torch.broadcast_shapes(attn_mask.shape, (B, heads, N, S))
    except RuntimeError:
        full = None
    if full != (B, heads, N, S):
        raise ValueError(
            f"attn_mask (additive float) has shape {tuple(attn_mask.shape)}; expected broadcastable to "
            f"(B, h, N, S) = ({B}, {heads}, {N}, {S})")
    mask = attn_mask.to(device)
    while mask.dim() < 4:
        mask = mask[None]
    # No data-dependent branch below (``bool(t.any())``): torch.compile traces it in one graph and FakeTensorMode
    # runs it; filling nothing costs one pass over the mask.
    mask = mask.masked_fill(mask <= mask_floor(dtype, mask.dtype), float("-inf"))
    if causal:
        mask = mask.masked_fill(~causal_keep(N, S, device)[None, None], float("-inf"))
    empty = torch.isneginf(mask).all(dim=-1, keepdim=True)
    return MaskSpec(mask.masked_fill(empty, 0.0), False, empty)


def _open_empty_bool(keep: torch.Tensor) -> MaskSpec:
    empty = ~keep.any(dim=-1, keepdim=True)
    return MaskSpec(keep | empty, False, empty)
