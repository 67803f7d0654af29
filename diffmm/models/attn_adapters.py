"""Call-convention adapters: a diffmm attention layer where a block calls another library's attention.

diffmm layers are called ``layer(x, attn_mask=..., causal=...)`` (:class:`diffmm.nn.AttentionLayer`). The blocks
:func:`diffmm.swap_attention` swaps into call ``nn.MultiheadAttention`` (open_clip), open_clip's ``Attention``,
timm's ``Attention`` and Hugging Face BERT-family self-attention, each with its own mask meaning (the conventions:
the table in docs/models.md, ``swap_attention``).

The adapter of a layer class is the subclass ``(ConventionCall, LayerClass)`` made by :func:`adapter_class` for
*any* :class:`~diffmm.nn.AttentionLayer` (nothing to write per variant), named ``<Prefix><LayerClass>``
(``MHADiffAttention``, ``OpenClipDiffV2Attention``, ``TimmAttention``, ``HFBertUpcycledDiffAttention``, ...) and
importable from this module under that name, so a swapped model pickles. The layer keeps its parameter names
(``attn.q_proj`` and so on, nothing nested); only its ``forward`` signature changes. Each convention's
``native_args`` turns its call into the native one (the attention recorder reads it too). The timm adapters have
timm's constructor too, so they are timm ``attn_layer`` classes. The mask translation is an FX leaf
(``torch.fx.wrap``), so timm's and torchvision's FX feature extraction trace through the adapters.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx

from diffmm.nn import ATTENTION_LAYERS, AttentionLayer


def additive_mask(mask: torch.Tensor, *, true_means_keep: bool, dtype: torch.dtype) -> torch.Tensor:
    """bool or float mask -> additive float mask (0 where attended, -inf where not)."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    blocked = ~mask if true_means_keep else mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(blocked, float("-inf"))


def native_mask(attn_mask: Optional[torch.Tensor], x: torch.Tensor, *, true_means_keep: bool,
                mask_heads: Optional[int], layer_heads: int, who: str,
                ignore: bool = False) -> Optional[torch.Tensor]:
    """Another library's mask -> the additive (B, 1 or layer_heads, N, S) mask of a diffmm layer (None: none or
    ``ignore``). 3-dim masks are (B * heads, N, S) with ``mask_heads`` heads (open_clip / torch); masks that differ
    across heads must have the layer's head count."""
    if attn_mask is None or ignore:
        return None
    m = additive_mask(attn_mask, true_means_keep=true_means_keep, dtype=x.dtype)
    B = x.shape[0]
    if m.dim() == 3 and m.shape[0] != 1:  # (B * heads, N, S) -> (B, heads, N, S)
        m = m.reshape(B, mask_heads or (m.shape[0] // B), *m.shape[-2:])
    if m.dim() < 4 or m.shape[1] in (1, layer_heads):
        return m
    if bool((m == m[:, :1]).all()):
        return m[:, :1]
    raise ValueError(f"{who}: per-head attention mask with {m.shape[1]} heads cannot map onto a layer with "
                     f"{layer_heads} heads")


torch.fx.wrap("native_mask")  # an FX leaf: it branches on the mask, which FX passes as a Proxy


class CallMixin:
    """What the adapters share; ``convention`` names the call a subclass accepts, ``prefix`` its class names."""

    convention = "native"
    prefix = ""
    mask_heads: Optional[int] = None  # heads of the replaced layer (open_clip folds them into 3-dim masks)

    def _native_mask(self, attn_mask, x, true_means_keep: bool, ignore: bool = False):
        return native_mask(attn_mask, x, true_means_keep=true_means_keep, mask_heads=self.mask_heads,
                           layer_heads=self.num_heads, who=type(self).__name__, ignore=ignore)


class MHACall(CallMixin):
    """``nn.MultiheadAttention``'s call (self-attention only); returns ``(out, None)``."""

    convention, prefix = "mha", "MHA"
    batch_first: bool = True

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = False,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        out = super().forward(**self.native_args(query, key, value, key_padding_mask, need_weights, attn_mask,
                                                 average_attn_weights, is_causal))
        return (out if self.batch_first else out.transpose(0, 1)), None

    def native_args(self, query, key=None, value=None, key_padding_mask=None, need_weights=False, attn_mask=None,
                    average_attn_weights=True, is_causal=False) -> dict:
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError(f"{type(self).__name__}: only self-attention (key is value is query) can be swapped")
        x = query if self.batch_first else query.transpose(0, 1)  # (B, N, E)
        mask = self._native_mask(attn_mask, x, true_means_keep=False)
        if key_padding_mask is not None:  # (B, S), True = ignore this key
            kpm = additive_mask(key_padding_mask, true_means_keep=False, dtype=x.dtype)[:, None, None, :]
            mask = kpm if mask is None else mask + kpm
        return dict(x=x, attn_mask=mask, causal=bool(is_causal and attn_mask is None))


class OpenClipCall(CallMixin):
    """open_clip ``Attention``'s call ``attn(x, attn_mask=None)``."""

    convention, prefix = "open_clip", "OpenClip"

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(**self.native_args(x, attn_mask))

    def native_args(self, x, attn_mask=None) -> dict:
        return dict(x=x, attn_mask=self._native_mask(attn_mask, x, true_means_keep=False))


class TimmCall(CallMixin):
    """timm ``Attention``'s constructor and call ``attn(x, attn_mask=None, is_causal=False)`` (bool masks:
    True = attend; ``is_causal`` takes precedence over the mask), so the class works as a timm ``attn_layer``.

    ``num_heads`` counts *standard* heads at this width, as everywhere in diffmm (a differential layer gets
    num_heads // 2; timm's own ``DiffAttention`` instead counts differential heads). timm passes ``depth`` only
    to subclasses of its own DiffAttention, and builds ``attn_layer`` with timm's arguments only, so models built
    with these classes call :func:`diffmm.models.timm_models.set_layer_depths` for a ``'depth'`` lambda_init, another
    lambda_init or a backend.
    """

    convention, prefix = "timm", "Timm"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.,
                 norm_layer=None, depth: int = 0, device=None, dtype=None, *, lambda_init: str | float = "depth",
                 backend: Optional[str] = None, **kwargs):
        unsupported = [n for n, on in (("qk_norm", qk_norm), ("scale_norm", scale_norm), ("attn_drop", attn_drop),
                                       ("proj_drop", proj_drop), *((k, True) for k in kwargs)) if on]
        if unsupported:
            raise ValueError(f"{type(self).__name__} (a diffmm attention layer) does not support "
                             f"{', '.join(unsupported)}")
        r = self.head_ratio
        if num_heads % r or dim % num_heads:
            raise ValueError(f"{type(self).__name__}: width {dim} and num_heads {num_heads} (standard heads) must "
                             f"give whole heads of {r} component(s)")
        super().__init__(dim, num_heads // r, head_dim=dim // num_heads, layer_idx=depth, lambda_init=lambda_init,
                         qkv_bias=qkv_bias, proj_bias=proj_bias, backend=backend)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    @classmethod
    def build(cls, dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None, layer_idx: int = 0,
              causal: bool = False, **kwargs):
        """As :meth:`diffmm.nn.AttentionLayer.build`, through timm's constructor (no GQA; not causal by default)."""
        if (num_kv_heads or num_heads) != num_heads or causal:
            raise ValueError(f"{cls.__name__}: a timm attention layer has no GQA and no default causal mask")
        return cls(dim, num_heads, depth=layer_idx, **kwargs)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        return super().forward(**self.native_args(x, attn_mask, is_causal))

    def native_args(self, x, attn_mask=None, is_causal=False) -> dict:
        # is_causal may be an FX Proxy: no Python branch on it here (native_mask is an FX leaf)
        return dict(x=x, attn_mask=self._native_mask(attn_mask, x, true_means_keep=True, ignore=is_causal),
                    causal=is_causal)


class HFBertCall(CallMixin):
    """Hugging Face BERT-family ``BertSelfAttention``'s call (self-attention only); returns ``(out, None)``.

    ``out`` is already through the output projection (``out_proj`` = the pretrained ``BertSelfOutput.dense``).
    The attention-probability dropout of the replaced layer is not reproduced (diffmm layers have none).
    """

    convention, prefix = "hf_bert", "HFBert"

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                encoder_hidden_states: Optional[torch.Tensor] = None, cache=None, **kwargs):
        return super().forward(**self.native_args(hidden_states, attention_mask, encoder_hidden_states,
                                                  cache)), None

    def native_args(self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None,
                    **kwargs) -> dict:
        if encoder_hidden_states is not None or cache is not None:
            raise ValueError(f"{type(self).__name__}: only encoder self-attention without a cache can be swapped "
                             f"(got encoder_hidden_states or a cache)")
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: attention mask of type {type(attention_mask).__name__} "
                            f"(use attn_implementation 'eager' or 'sdpa')")
        x = hidden_states
        return dict(x=x, attn_mask=self._native_mask(attention_mask, x, true_means_keep=True))


#: convention -> its call mixin
CONVENTIONS: dict[str, type[CallMixin]] = {c.convention: c for c in (MHACall, OpenClipCall, TimmCall, HFBertCall)}
_ADAPTERS: dict[tuple[str, type], type] = {}


def adapter_class(convention: str, layer_cls: type[AttentionLayer]) -> type:
    """The class of ``layer_cls`` (any :class:`~diffmm.nn.AttentionLayer`) called with ``convention``'s call
    (``'native'``: ``layer_cls`` itself); made once, then reused."""
    if convention == "native":
        return layer_cls
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown call convention {convention!r}; expected native or {', '.join(CONVENTIONS)}")
    if not (isinstance(layer_cls, type) and issubclass(layer_cls, AttentionLayer)):
        raise TypeError(f"{layer_cls!r} is not a diffmm.nn.AttentionLayer subclass")
    key = (convention, layer_cls)
    if key not in _ADAPTERS:
        mixin = CONVENTIONS[convention]
        name = mixin.prefix + layer_cls.__name__
        _ADAPTERS[key] = type(name, (mixin, layer_cls), {
            "__module__": __name__, "__qualname__": name,
            "__doc__": f"{layer_cls.__name__} with the {convention!r} call convention ({mixin.__name__})."})
    return _ADAPTERS[key]


def __getattr__(name: str) -> type:
    """``<Prefix><LayerClass>`` (e.g. ``TimmDiffAttention``): the adapter class, made on first use (pickle and
    imports find adapters by that name)."""
    for mixin in CONVENTIONS.values():
        if name.startswith(mixin.prefix):
            layers = [c for c in ATTENTION_LAYERS.values() if c.__name__ == name[len(mixin.prefix):]]
            if len(layers) == 1:
                return adapter_class(mixin.convention, layers[0])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
