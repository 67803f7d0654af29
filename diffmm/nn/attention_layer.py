"""The contract every diffmm attention layer implements (:class:`AttentionLayer`) and the registry of attention types.

A new attention variant is one class, ``class X(AttentionLayer, attn_type="x")``: configs and ``create_attention``
build it by name, the call-convention adapters (open_clip, timm, Hugging Face BERT, ``nn.MultiheadAttention``) wrap
its native ``forward``, and ``swap_attention(init='upcycle')``, the attention recorder and the parameter report read
what they need from the class (docs/attention.md has the table and a full example).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional

import torch
import torch.nn as nn

from diffmm.nn.rope import apply_rope

#: attn_type -> layer class (filled by ``class X(AttentionLayer, attn_type=...)``)
ATTENTION_LAYERS: dict[str, type["AttentionLayer"]] = {}
#: attn_type -> the registered type ``swap_attention(init='upcycle')`` builds for it (types that can upcycle)
UPCYCLE_TYPES: dict[str, str] = {}


@dataclass
class StdAttnWeights:
    """The weights of a standard multi-head self-attention layer (rows of each W are output features)."""

    wq: torch.Tensor  # (E, E) heads stacked: rows j*d:(j+1)*d are head j
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor  # (E, E) columns j*d:(j+1)*d read head j
    bq: Optional[torch.Tensor]
    bk: Optional[torch.Tensor]
    bv: Optional[torch.Tensor]
    bo: Optional[torch.Tensor]
    num_heads: int
    causal: bool = False

    @property
    def dim(self) -> int:
        return self.wo.shape[0]

    @property
    def head_dim(self) -> int:
        return self.wq.shape[0] // self.num_heads

    @property
    def qkv_bias(self) -> bool:
        return self.bq is not None

    @property
    def proj_bias(self) -> bool:
        return self.bo is not None


def pair_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of head j -> two copies (query/key maps 2j, 2j+1): (H*d, ...) -> (2*H*d, ...)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 1, d, *w.shape[1:]).expand(heads, 2, d, *w.shape[1:]).reshape(2 * heads * d, *w.shape[1:])


class QKMaps(NamedTuple):
    """What :meth:`AttentionLayer.capture` returns: the inputs of every softmax of one call (RoPE applied)."""

    q: torch.Tensor  # (B, N, Hq, d) query maps
    k: torch.Tensor  # (B, S, Hk, d) key heads
    kv_index: torch.Tensor  # (Hq,) key head of each query map
    lam: Optional[torch.Tensor] = None  # capture_kind 'diff': 0-d lambda; 'diff_v2': (B, N, h) sigmoid weights


class AttentionLayer(nn.Module):
    """Base class of diffmm attention layers (see the module docstring for the contract).

    Class attributes (set in the class body, or as class keywords: ``class X(AttentionLayer, attn_type="x")``):
        attn_type: the registered name (``create_attention(attn_type, ...)``, configs' ``attn_type``).
        head_ratio: standard heads per head of this layer at the same width (2 for DIFF V1: half the heads).
        upcycle_to: the registered type ``init='upcycle'`` builds for this one; None: this type itself when it
            implements :meth:`load_standard`.
        capture_kind: how :meth:`capture`'s query maps make one head's map: ``'standard'`` (one map),
            ``'diff'`` (maps 2i, 2i+1: A1 - lambda A2) or ``'diff_v2'`` (A1 - sigmoid(lambda_t) A2).
    """

    attn_type: ClassVar[str] = ""
    head_ratio: ClassVar[int] = 1
    upcycle_to: ClassVar[Optional[str]] = None
    capture_kind: ClassVar[str] = "standard"

    def __init_subclass__(cls, attn_type: Optional[str] = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if attn_type is None:
            return
        if attn_type in ATTENTION_LAYERS and ATTENTION_LAYERS[attn_type].__qualname__ != cls.__qualname__:
            raise ValueError(f"attn_type {attn_type!r} is already registered to {ATTENTION_LAYERS[attn_type]}")
        cls.attn_type = attn_type
        ATTENTION_LAYERS[attn_type] = cls
        if cls.upcycle_to is not None:
            UPCYCLE_TYPES[attn_type] = cls.upcycle_to
        elif cls.load_standard is not AttentionLayer.load_standard:
            UPCYCLE_TYPES[attn_type] = attn_type

    def _init_heads(self, dim: int, num_heads: int, num_kv_heads: Optional[int], head_dim: Optional[int],
                    layer_idx: int, causal: bool, use_rope: bool, backend: Optional[str]) -> None:
        """Check the head layout (width = head_ratio * num_heads * head_dim; one-line errors) and set ``dim``,
        ``num_heads``, ``num_kv_heads`` (default num_heads), ``head_dim`` (default from the width), ``layer_idx``,
        ``causal``, ``use_rope``, ``backend``."""
        who, r = type(self).__name__, self.head_ratio
        num_kv_heads = num_kv_heads or num_heads
        if head_dim is None:
            if num_heads <= 0 or dim % (r * num_heads):
                by = f"{r} * num_heads = {r * num_heads}" if r > 1 else f"num_heads {num_heads}"
                raise ValueError(f"{who}: width {dim} is not divisible by {by}")
            head_dim = dim // (r * num_heads)
        if num_heads <= 0 or num_kv_heads <= 0:
            raise ValueError(f"{who}: num_heads={num_heads} and num_kv_heads={num_kv_heads} must be positive")
        if num_heads % num_kv_heads:
            raise ValueError(f"{who}: num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
        if r * num_heads * head_dim != dim:
            raise ValueError(f"{who}: width {dim} != {r} * num_heads {num_heads} * head_dim {head_dim}")
        if use_rope and head_dim % 2:
            raise ValueError(f"{who}: RoPE needs an even head_dim; got {head_dim}")
        self.dim, self.num_heads, self.num_kv_heads, self.head_dim = dim, num_heads, num_kv_heads, head_dim
        self.layer_idx, self.causal, self.use_rope, self.backend = layer_idx, causal, use_rope, backend

    @classmethod
    def build(cls, dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None, **kwargs) -> "AttentionLayer":
        """This layer for a Transformer of width ``dim`` with ``num_heads`` (``num_kv_heads``) *standard* heads:
        ``num_heads // head_ratio`` heads of dim ``dim // num_heads``; ``kwargs`` go to the constructor."""
        num_kv_heads = num_kv_heads or num_heads
        r = cls.head_ratio
        if r > 1 and (num_heads % r or num_kv_heads % r):
            raise ValueError(f"attention type {cls.attn_type or cls.__name__!r} needs num_heads ({num_heads}) and "
                             f"num_kv_heads ({num_kv_heads}) divisible by {r}")
        if num_heads <= 0 or dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads {num_heads}")
        return cls(dim, num_heads // r, num_kv_heads=num_kv_heads // r, head_dim=dim // num_heads, **kwargs)

    @property
    def query_maps(self) -> int:
        """Query maps (softmaxes per key head group) of the layer."""
        return self.q_proj.out_features // self.head_dim

    def native_args(self, x: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, kv_cache=None,
                    causal: Optional[bool] = None) -> dict:
        """The arguments of the native ``forward`` for a call of this class (adapters translate theirs)."""
        return dict(x=x, attn_mask=attn_mask, rope=rope, kv_cache=kv_cache, causal=causal)

    @torch.no_grad()
    def load_standard(self, w: StdAttnWeights, *, generator: Optional[torch.Generator] = None) -> None:
        """Set this layer (built with ``w``'s width, standard heads and biases by :meth:`build`) to compute exactly
        what ``w`` computes. Layers that cannot do it raise ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be built from a standard layer's weights "
                                  f"(init='upcycle'); use init='scratch'")

    def project_qk(self, x: torch.Tensor, rope, q_maps: int, k_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, N, q_maps, d) and k (B, N, k_heads, d) of ``x`` (B, N, E), RoPE applied when the layer uses it."""
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, q_maps, self.head_dim)
        k = self.k_proj(x).view(B, N, k_heads, self.head_dim)
        if self.use_rope:
            if rope is None:
                raise ValueError(f"{type(self).__name__} was built with use_rope=True; forward needs rope=(cos, sin)")
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k

    def capture(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> QKMaps:
        """The query maps and key heads of a call on ``x`` (no KV cache), for attention capture. Default: one
        query map per head, head i reading kv head ``i // (num_heads / num_kv_heads)``."""
        h, hk = self.num_heads, self.num_kv_heads
        q, k = self.project_qk(x, rope, h, hk)
        return QKMaps(q, k, torch.arange(h, device=x.device) // (h // hk))
