"""Call-convention adapters: a diffmm attention layer where a block calls another library's attention.

diffmm layers are called ``layer(x, attn_mask=..., causal=...)``. The blocks :func:`diffmm.swap_attention` swaps
into call:

- ``nn.MultiheadAttention`` (open_clip ``ResidualAttentionBlock``): ``attn(q, k, v, need_weights=False,
  attn_mask=M)[0]``; bool masks are True where attention is *not* allowed; 3-dim masks are (B*heads, N, S).
- open_clip ``Attention`` (``CustomResidualAttentionBlock``): ``attn(x, attn_mask=M)``; same mask rules.
- timm ``Attention`` (``Block``): ``attn(x, attn_mask=M, is_causal=c)``; bool masks are True where attention
  *is* allowed (SDPA semantics).
- Hugging Face BERT-family self-attention (``BertAttention.self``, transformers 5.x):
  ``self(hidden_states, attention_mask=M, encoder_hidden_states=None, cache=None, **kwargs)`` returning
  ``(out, attn_weights)``; M is the model's prepared 4-dim mask (eager: additive float, sdpa: bool True where
  attention *is* allowed) or None. The swapped layer includes the output projection, so ``swap_attention``
  sets the sibling ``BertSelfOutput.dense`` to ``nn.Identity`` (its dropout and LayerNorm stay).

An adapter is an ordinary subclass ``(CallMixin, LayerClass)`` defined below, e.g.
``class OpenClipDiffAttention(OpenClipCall, DiffAttention)``: the layer keeps its parameter names (``attn.q_proj``
and so on, nothing nested) and only its ``forward`` signature changes. ``swap_attention`` builds the new layer as
the adapter class from the start (:func:`adapter_class`); the timm adapters have timm's constructor too, so they
are timm ``attn_layer`` classes. All are module-level classes, so a whole swapped model pickles.
"""
from __future__ import annotations

from typing import Optional

import torch

from diffmm.models.upcycle import UpcycledDiffAttention
from diffmm.nn import ATTENTION_LAYERS, Attention, DiffAttention, DiffV2Attention


def additive_mask(mask: torch.Tensor, *, true_means_keep: bool, dtype: torch.dtype) -> torch.Tensor:
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


def components_of(layer_cls: type) -> int:
    """Query/key components per head (2: differential) of a registered attention class or of a subclass of one."""
    for base in layer_cls.__mro__:
        for cls, comps in ATTENTION_LAYERS.values():
            if cls is base:
                return comps
    raise ValueError(f"{layer_cls.__name__} is not a registered attention layer (diffmm.nn.ATTENTION_LAYERS)")


class CallMixin:
    """The mask handling the adapters share; ``convention`` names the call a subclass accepts."""

    convention = "native"
    mask_heads: Optional[int] = None  # heads of the replaced layer (open_clip folds them into 3-dim masks)

    def _mask(self, attn_mask: Optional[torch.Tensor], B: int, x: torch.Tensor, true_means_keep: bool):
        if attn_mask is None:
            return None
        m = additive_mask(attn_mask, true_means_keep=true_means_keep, dtype=x.dtype)
        if m.dim() == 3 and m.shape[0] != 1:  # (B * heads, N, S) -> (B, heads, N, S)
            heads = self.mask_heads or (m.shape[0] // B)
            m = m.reshape(B, heads, *m.shape[-2:])
        return _per_layer_heads(m, self.num_heads, type(self).__name__)


class MHACall(CallMixin):
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
            kpm = additive_mask(key_padding_mask, true_means_keep=False, dtype=x.dtype)[:, None, None, :]
            mask = kpm if mask is None else mask + kpm
        causal = bool(is_causal and attn_mask is None)
        out = super().forward(x, attn_mask=mask, causal=causal)
        return (out if self.batch_first else out.transpose(0, 1)), None


class OpenClipCall(CallMixin):
    """open_clip ``Attention``'s call ``attn(x, attn_mask=None)``."""

    convention = "open_clip"

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(x, attn_mask=self._mask(attn_mask, x.shape[0], x, true_means_keep=False))


class TimmCall(CallMixin):
    """timm ``Attention``'s constructor and call ``attn(x, attn_mask=None, is_causal=False)`` (bool masks:
    True = attend), so the class works as a timm ``attn_layer``.

    ``num_heads`` counts *standard* heads at this width, as everywhere in diffmm (a differential layer gets
    num_heads // 2; timm's own ``DiffAttention`` instead counts differential heads). timm passes ``depth`` only
    to subclasses of its own DiffAttention, and builds ``attn_layer`` with timm's arguments only, so models built
    with these classes call :func:`diffmm.models.timm_models.set_layer_depths` for a ``'depth'`` lambda_init, another
    lambda_init or a backend.
    """

    convention = "timm"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.,
                 norm_layer=None, depth: int = 0, device=None, dtype=None, *, lambda_init: str | float = "depth",
                 backend: Optional[str] = None, **kwargs):
        unsupported = [n for n, on in (("qk_norm", qk_norm), ("scale_norm", scale_norm), ("attn_drop", attn_drop),
                                       ("proj_drop", proj_drop), *((k, True) for k in kwargs)) if on]
        if unsupported:
            raise ValueError(f"{type(self).__name__} (a diffmm attention layer) does not support "
                             f"{', '.join(unsupported)}")
        comps = components_of(type(self))
        if num_heads % comps or dim % num_heads:
            raise ValueError(f"{type(self).__name__}: width {dim} and num_heads {num_heads} (standard heads) must "
                             f"give whole heads of {comps} component(s)")
        super().__init__(dim, num_heads // comps, head_dim=dim // num_heads, layer_idx=depth, lambda_init=lambda_init,
                         qkv_bias=qkv_bias, proj_bias=proj_bias, backend=backend)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                **kwargs) -> torch.Tensor:
        if is_causal:  # timm: is_causal takes precedence over the mask
            return super().forward(x, causal=True)
        return super().forward(x, attn_mask=self._mask(attn_mask, x.shape[0], x, true_means_keep=True))


class HFBertCall(CallMixin):
    """Hugging Face BERT-family ``BertSelfAttention``'s call (self-attention only); returns ``(out, None)``.

    ``out`` is already through the output projection (``out_proj`` = the pretrained ``BertSelfOutput.dense``).
    The attention-probability dropout of the replaced layer is not reproduced (diffmm layers have none).
    """

    convention = "hf_bert"

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                encoder_hidden_states: Optional[torch.Tensor] = None, cache=None, **kwargs):
        if encoder_hidden_states is not None or cache is not None:
            raise ValueError(f"{type(self).__name__}: only encoder self-attention without a cache can be swapped "
                             f"(got encoder_hidden_states or a cache)")
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: attention mask of type {type(attention_mask).__name__} "
                            f"(use attn_implementation 'eager' or 'sdpa')")
        x = hidden_states
        return super().forward(x, attn_mask=self._mask(attention_mask, x.shape[0], x, true_means_keep=True)), None


# ------------------------------------------------------------------------- the adapters of diffmm's layers
class MHAAttention(MHACall, Attention):
    """Standard attention called like ``nn.MultiheadAttention``."""


class MHADiffAttention(MHACall, DiffAttention):
    """Differential attention called like ``nn.MultiheadAttention``."""


class MHADiffV2Attention(MHACall, DiffV2Attention):
    """DIFF V2 attention called like ``nn.MultiheadAttention``."""


class MHAUpcycledDiffAttention(MHACall, UpcycledDiffAttention):
    """Upcycled differential attention called like ``nn.MultiheadAttention``."""


class OpenClipAttention(OpenClipCall, Attention):
    """Standard attention called like open_clip's ``Attention``."""


class OpenClipDiffAttention(OpenClipCall, DiffAttention):
    """Differential attention called like open_clip's ``Attention``."""


class OpenClipDiffV2Attention(OpenClipCall, DiffV2Attention):
    """DIFF V2 attention called like open_clip's ``Attention``."""


class OpenClipUpcycledDiffAttention(OpenClipCall, UpcycledDiffAttention):
    """Upcycled differential attention called like open_clip's ``Attention``."""


class TimmAttention(TimmCall, Attention):
    """Standard attention built and called like timm's ``Attention``."""


class TimmDiffAttention(TimmCall, DiffAttention):
    """Differential attention built and called like timm's ``Attention``."""


class TimmDiffV2Attention(TimmCall, DiffV2Attention):
    """DIFF V2 attention built and called like timm's ``Attention``."""


class TimmUpcycledDiffAttention(TimmCall, UpcycledDiffAttention):
    """Upcycled differential attention built and called like timm's ``Attention``."""


class HFBertAttention(HFBertCall, Attention):
    """Standard attention called like Hugging Face ``BertSelfAttention`` (with the output projection)."""


class HFBertDiffAttention(HFBertCall, DiffAttention):
    """Differential attention called like Hugging Face ``BertSelfAttention`` (with the output projection)."""


class HFBertDiffV2Attention(HFBertCall, DiffV2Attention):
    """DIFF V2 attention called like Hugging Face ``BertSelfAttention`` (with the output projection)."""


class HFBertUpcycledDiffAttention(HFBertCall, UpcycledDiffAttention):
    """Upcycled differential attention called like Hugging Face ``BertSelfAttention`` (with the output
    projection)."""


ADAPTERS: dict[str, dict[type, type]] = {
    "mha": {Attention: MHAAttention, DiffAttention: MHADiffAttention, DiffV2Attention: MHADiffV2Attention,
            UpcycledDiffAttention: MHAUpcycledDiffAttention},
    "open_clip": {Attention: OpenClipAttention, DiffAttention: OpenClipDiffAttention,
                  DiffV2Attention: OpenClipDiffV2Attention, UpcycledDiffAttention: OpenClipUpcycledDiffAttention},
    "timm": {Attention: TimmAttention, DiffAttention: TimmDiffAttention, DiffV2Attention: TimmDiffV2Attention,
             UpcycledDiffAttention: TimmUpcycledDiffAttention},
    "hf_bert": {Attention: HFBertAttention, DiffAttention: HFBertDiffAttention,
                DiffV2Attention: HFBertDiffV2Attention, UpcycledDiffAttention: HFBertUpcycledDiffAttention},
}


def adapter_class(convention: str, layer_cls: type) -> type:
    """The class of ``layer_cls`` (a registered attention class) called with ``convention``'s call (``'native'``:
    ``layer_cls`` itself)."""
    return layer_cls if convention == "native" else ADAPTERS[convention][layer_cls]
