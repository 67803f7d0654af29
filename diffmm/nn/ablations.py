"""Ablations of differential attention: what is left of :class:`DiffAttention` when one of its parts is taken out.

The paper's layer differs from standard attention in more than the subtraction ``A1 - lambda A2``: it has half the
heads at twice the value width, a per-head RMSNorm and a fixed ``(1 - lambda_init)`` output scale (the
"epilogue"). These registered types separate the parts (``attn_type=`` in any config); they exist for studies
(``studies/mechanism``), not as models to use:

==========================  ==============================================================================
``diff_nosub``              :class:`DiffAttention` with lambda fixed at 0: the same heads, head width, norm and
                            scale, no subtraction (the second map is computed and multiplied by 0).
``diff_scale_depth``        the output scale ``1 - lambda_init(depth)`` whatever ``lambda_init`` says.
``diff_scale_fixed``        the output scale fixed at 0.2 (= 1 - 0.8).
``diff_scale_none``         no output scale (the per-head norm alone).
``standard_epilogue``       standard attention followed by the differential epilogue: a per-head RMSNorm (one
                            weight shared across heads) and the ``(1 - lambda_init)`` scale.
==========================  ==============================================================================
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch

from diffmm.nn.attention import Attention
from diffmm.nn.attention_layer import AttentionLayer
from diffmm.nn.diff_attention import DiffAttention
from diffmm.nn.kv_cache import KVCache
from diffmm.nn.lambdas import lambda_init_depth, resolve_lambda_init
from diffmm.nn.norm import RMSNorm
from diffmm.ops import diff_attention


class DiffAblation(DiffAttention):
    """:class:`DiffAttention` with the subtraction or the output scale changed (class attributes of a subclass).

    Attributes:
        subtract: False: lambda is 0 (no gradient reaches the lambda vectors).
        epilogue_scale: None: ``1 - lambda_init`` (the paper); ``'depth'``: ``1 - lambda_init_depth(layer)``;
            a number: that scale.
    """

    upcycle_to = None  # an ablation is trained from scratch
    subtract: ClassVar[bool] = True
    epilogue_scale: ClassVar[Optional[str | float]] = None

    def lambda_full(self) -> torch.Tensor:
        lam = super().lambda_full()
        return lam if self.subtract else torch.zeros_like(lam)

    def scale_lambda_init(self) -> float:
        """The ``lambda_init`` the epilogue's ``(1 - lambda_init)`` scale is computed from."""
        s = self.epilogue_scale
        if s is None:
            return self.lambda_init
        return lambda_init_depth(self.layer_idx) if s == "depth" else 1.0 - float(s)

    def forward(self, x: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, kv_cache: Optional[KVCache] = None,
                causal: Optional[bool] = None) -> torch.Tensor:
        """As :meth:`DiffAttention.forward`, with this ablation's lambda and output scale."""
        B, N, _ = x.shape
        q, k, v = self._qkv(x, rope, kv_cache)
        out = diff_attention(q, k, v, self.lambda_full(), causal=self.causal if causal is None else causal,
                             attn_mask=attn_mask, norm_weight=self.diff_norm.weight,
                             lambda_init=self.scale_lambda_init(), eps=self.diff_norm.eps,
                             backend=self.backend)  # (B, N, h, 2d)
        return self.out_proj(out.reshape(B, N, 2 * self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, subtract={self.subtract}, "
                f"scale={1.0 - self.scale_lambda_init():.4g}")


class DiffNoSubtraction(DiffAblation, attn_type="diff_nosub"):
    """Differential attention with lambda fixed at 0 (everything else as :class:`DiffAttention`)."""

    subtract = False


class DiffScaleDepth(DiffAblation, attn_type="diff_scale_depth"):
    """Differential attention whose output scale follows the depth schedule whatever its ``lambda_init``."""

    epilogue_scale = "depth"


class DiffScaleFixed(DiffAblation, attn_type="diff_scale_fixed"):
    """Differential attention with the output scale fixed at 0.2."""

    epilogue_scale = 0.2


class DiffScaleNone(DiffAblation, attn_type="diff_scale_none"):
    """Differential attention without the output scale (the per-head RMSNorm alone)."""

    epilogue_scale = 1.0


class StandardEpilogue(Attention, attn_type="standard_epilogue"):
    """Standard attention, then the differential epilogue on each head's output: RMSNorm over the head dim (weight
    shared across heads) and the ``(1 - lambda_init)`` scale. Arguments as :class:`Attention` plus ``lambda_init``
    (``'depth'``, ``'constant'`` or a number, as :class:`DiffAttention`)."""

    upcycle_to = None
    load_standard = AttentionLayer.load_standard  # the epilogue changes the function: not an upcycling target

    def __init__(self, dim: int, num_heads: int, *, layer_idx: int = 0, lambda_init: str | float = "depth",
                 norm_eps: float = 1e-5, **kwargs):
        super().__init__(dim, num_heads, layer_idx=layer_idx, norm_eps=norm_eps, **kwargs)
        self.lambda_init = resolve_lambda_init(lambda_init, layer_idx)
        self.head_norm = RMSNorm(self.head_dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, kv_cache: Optional[KVCache] = None,
                causal: Optional[bool] = None) -> torch.Tensor:
        """x (B, N, E) -> (B, N, E)."""
        B, N, _ = x.shape
        heads = self.attend(x, attn_mask=attn_mask, rope=rope, kv_cache=kv_cache, causal=causal)  # (B, N, H, d)
        return self.out_proj((self.head_norm(heads) * (1.0 - self.lambda_init)).reshape(B, N, -1))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lambda_init={self.lambda_init:.4g}"
