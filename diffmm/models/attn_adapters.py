"""Call-convention adapters: let a diffmm attention layer stand where a block expects another layer's call.

diffmm layers are called ``layer(x, attn_mask=..., causal=...)``. The blocks we swap into call:

- ``nn.MultiheadAttention`` (open_clip ``ResidualAttentionBlock``): ``attn(q, k, v, need_weights=False,
  attn_mask=M)[0]``; bool masks are True where attention is *not* allowed; 3-dim masks are (B*heads, N, S).
- open_clip ``Attention`` (``CustomResidualAttentionBlock``): ``attn(x, attn_mask=M)``; same mask rules.
- timm ``Attention`` (``Block``): ``attn(x, attn_mask=M, is_causal=c)``; bool masks are True where attention
  *is* allowed (SDPA semantics).

An adapter is a subclass ``(ConventionMixin, LayerClass)``: the layer keeps its parameter names (``attn.q_proj``
and so on, no extra nesting) and only its ``forward`` signature changes. :func:`adapt` switches an instance's
class in place; the classes are created once per (convention, layer class) and kept in this module so that
pickling a whole model finds them.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn as nn


def _additive(mask: torch.Tensor, *, true_means_keep: bool, dtype: torch.dtype) -> torch.Tensor:
    """bool or float mask -> additive float mask (0 where attended, -inf where not)."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    blocked = ~mask if true_means_keep else mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(blocked, float("-inf"))


def _per_layer_heads(mask: torch.Tensor, layer_heads: int, who: str) -> torch.Tensor:
    """(B, Hm, N, S) -> (B, 1 or layer_heads, N, S); masks that differ across heads must have the layer's count."""
    if mask.dim() < 4 or mask.shape[1] in (1, layer_heads):
        return mask
    if bool((mask == mask[:, :1]).all()):
        return mask[:, :1]
    raise ValueError(f"{who}: per-head attention mask with {mask.shape[1]} heads cannot map onto a layer with "
                     f"{layer_heads} heads")


class _ConventionMixin:
    convention = "native"
    mask_heads: Optional[int] = None  # heads of the replaced layer (open_clip folds them into 3-dim masks)

    def _mask(self, attn_mask: Optional[torch.Tensor], B: int, x: torch.Tensor, true_means_keep: bool):
        if attn_mask is None:
            return None
        m = _additive(attn_mask, true_means_keep=true_means_keep, dtype=x.dtype)
        if m.dim() == 3 and m.shape[0] != 1:  # (B * heads, N, S) -> (B, heads, N, S)
            heads = self.mask_heads or (m.shape[0] // B)
            m = m.reshape(B, heads, *m.shape[-2:])
        return _per_layer_heads(m, self.num_heads, type(self).__name__)


class MHACallMixin(_ConventionMixin):
    """``nn.MultiheadAttention``'s call (self-attention only); returns ``(out, None)``."""

    convention = "mha"
    batch_first: bool = True

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = False,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError(f"{type(self).__name__}: only self-attention (key is value is query) can be swapped")
        x = query if self.batch_first else query.transpose(0, 1)  # (B, N, E)
        B, N, _ = x.shape
        mask = self._mask(attn_mask, B, x, true_means_keep=False)
        if key_padding_mask is not None:  # (B, S), True = ignore this key
            kpm = _additive(key_padding_mask, true_means_keep=False, dtype=x.dtype)[:, None, None, :]
            mask = kpm if mask is None else mask + kpm
        causal = bool(is_causal and attn_mask is None)
        out = super().forward(x, attn_mask=mask, causal=causal)
        return (out if self.batch_first else out.transpose(0, 1)), None


class OpenClipCallMixin(_ConventionMixin):
    """open_clip ``Attention``'s call ``attn(x, attn_mask=None)``."""

    convention = "open_clip"

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(x, attn_mask=self._mask(attn_mask, x.shape[0], x, true_means_keep=False))


class TimmCallMixin(_ConventionMixin):
    """timm ``Attention``'s constructor and call ``attn(x, attn_mask=None, is_causal=False)`` (bool masks:
    True = attend), so the class works as a timm ``attn_layer``.

    ``num_heads`` counts *standard* heads at this width, as everywhere in diffmm (a differential layer gets
    num_heads // 2; timm's own ``DiffAttention`` instead counts differential heads). timm passes ``depth`` only
    to subclasses of its own DiffAttention, so models built with these layers call
    :func:`diffmm.models.timm_models.set_layer_depths` for ``'depth'`` lambda_init.
    """

    convention = "timm"
    default_lambda_init: str | float = "depth"
    default_backend: Optional[str] = None

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.,
                 norm_layer=None, depth: int = 0, device=None, dtype=None, **kwargs):
        from diffmm.nn import ATTENTION_LAYERS

        unsupported = [n for n, on in (("qk_norm", qk_norm), ("scale_norm", scale_norm), ("attn_drop", attn_drop),
                                       ("proj_drop", proj_drop), *((k, True) for k in kwargs)) if on]
        if unsupported:
            raise ValueError(f"{type(self).__name__} (a diffmm attention layer) does not support "
                             f"{', '.join(unsupported)}")
        comps = next((c for cls, c in ATTENTION_LAYERS.values() if cls is self._adapted_from), 1)
        if num_heads % comps or dim % num_heads:
            raise ValueError(f"{type(self).__name__}: width {dim} and num_heads {num_heads} (standard heads) must "
                             f"give whole heads of {comps} component(s)")
        super().__init__(dim, num_heads // comps, head_dim=dim // num_heads, layer_idx=depth,
                         lambda_init=self.default_lambda_init, qkv_bias=qkv_bias, proj_bias=proj_bias,
                         backend=self.default_backend)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                **kwargs) -> torch.Tensor:
        if is_causal:  # timm: is_causal takes precedence over the mask
            return super().forward(x, causal=True)
        return super().forward(x, attn_mask=self._mask(attn_mask, x.shape[0], x, true_means_keep=True))


MIXINS: dict[str, type] = {"mha": MHACallMixin, "open_clip": OpenClipCallMixin, "timm": TimmCallMixin}
_CLASSES: dict[tuple[str, type], type] = {}


def adapter_class(convention: str, layer_cls: type) -> type:
    """The class ``(Mixin, layer_cls)`` for ``convention`` (created once, stored in this module)."""
    if convention == "native":
        return layer_cls
    base = getattr(layer_cls, "_adapted_from", layer_cls)
    key = (convention, base)
    if key not in _CLASSES:
        if convention not in MIXINS:
            raise ValueError(f"unknown call convention {convention!r}; expected native or {', '.join(MIXINS)}")
        name = f"{MIXINS[convention].__name__.replace('CallMixin', '')}_{base.__name__}"
        cls = type(name, (MIXINS[convention], base), {"_adapted_from": base, "__module__": __name__})
        setattr(sys.modules[__name__], name, cls)
        _CLASSES[key] = cls
    return _CLASSES[key]


def adapt(layer: nn.Module, convention: str, **attrs) -> nn.Module:
    """Switch ``layer`` in place to the adapter class of ``convention``; set ``attrs`` (e.g. batch_first)."""
    layer.__class__ = adapter_class(convention, type(layer))
    for k, v in attrs.items():
        setattr(layer, k, v)
    return layer


def register_known_layers() -> None:
    """Create the adapter classes of every registered attention layer now (so pickles can find them)."""
    from diffmm.nn import ATTENTION_LAYERS

    for cls, _ in list(ATTENTION_LAYERS.values()):
        for conv in MIXINS:
            adapter_class(conv, cls)


def _register_on_import() -> None:
    import diffmm.models.upcycle  # noqa: F401  (registers 'diff_upcycled')

    register_known_layers()


_register_on_import()
