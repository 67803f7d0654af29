"""Function-preserving conversion ("upcycling") of a pretrained standard attention layer into differential
attention, and the layer it produces.

A pretrained layer has H heads of dim d: ``head_j = softmax(q_j k_j^T / sqrt(d)) v_j``, ``out = [head_j] Wo + bo``.
The paper's layer at the same width has H/2 heads whose outputs go through a per-head RMSNorm; neither the
halved heads nor the norm can reproduce the pretrained function, so the upcycled layer
(:class:`UpcycledDiffAttention`) changes two things relative to the paper's (documented in docs/models.md):

1. **2x heads.** h = H differential heads of component dim d (q/k/v are 2E wide, out_proj is 2E -> E), so
   every pretrained head keeps its own pair of maps. Upcycled weights, per head j:
   both query/key components = the pretrained ``q_j`` / ``k_j`` (so A_2 = A_1 at step 0); the 2d-wide value is
   ``[v_j, v_j]``; the out-proj columns of the two halves are ``Wo_j / 2 -/+ eps_j`` (eps: small noise that
   breaks the symmetry of the halves and sums to zero); ``lambda_q2 = lambda_q1``, ``lambda_k2 = lambda_k1``
   (random as in the paper), so lambda = lambda_init exactly.
2. **A gated norm.** With ``raw = A / (1 - lambda_init)``,
   ``head = raw + beta_i * (RMSNorm(A) * g * (1 - lambda_init) - raw)``
   with ``A = (A_1 - lambda A_2) V`` and a learnable per-head gate ``beta`` (``norm_gate``) starting at 0: at
   step 0 ``A = (1 - lambda_init) A_1 [v_j, v_j]`` and the head output is exactly the pretrained one. With
   beta = 1 it is the paper's head (normed and scaled by 1 - lambda_init).

At step 0 every new parameter has a non-zero gradient except the norm weight ``g``, whose branch is gated by
beta = 0; it receives gradient as soon as beta moves (after the first optimiser step).

DIFF V2 (``attn_type='diff_v2'``) needs no new layer: both query maps of head j = the pretrained ``q_j``,
K/V = the pretrained ones, ``W_lambda = 0`` (sigmoid = 1/2), ``out_proj = 2 Wo``: head_j = O - O/2 = O/2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from diffmm.nn import Attention, DiffAttention, DiffV2Attention, register_attention
from diffmm.nn.diff_attention import check_heads
from diffmm.nn.kv_cache import KVCache
from diffmm.nn.lambdas import resolve_lambda_init
from diffmm.ops import diff_attention

UPCYCLED = "diff_upcycled"


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


class UpcycledDiffAttention(DiffAttention):
    """Differential attention with 2x heads and a gated per-head RMSNorm, for function-preserving upcycling.

    Same parameters as :class:`diffmm.nn.DiffAttention` at twice the inner width (q/k/v: E -> 2E,
    out_proj: 2E -> E) plus ``norm_gate`` (h,). Built by ``create_attention('diff_upcycled', E, H)`` with H
    *standard* heads (no halving: h = H differential heads of dim d = E / H).

    Args:
        dim: model width E.
        num_heads: differential heads h = the pretrained layer's heads.
        num_kv_heads / head_dim / layer_idx / lambda_init / qkv_bias / proj_bias / causal / use_rope /
            norm_eps / lambda_std / backend: as in :class:`diffmm.nn.DiffAttention`.
    """

    def __init__(self, dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, layer_idx: int = 0, lambda_init: str | float = "constant",
                 qkv_bias: bool = False, proj_bias: bool = False, causal: bool = False, use_rope: bool = False,
                 norm_eps: float = 1e-5, lambda_std: float = 0.1, backend: Optional[str] = None, **unused):
        nn.Module.__init__(self)  # DiffAttention.__init__ enforces E = 2hd; here E = hd
        num_kv_heads = num_kv_heads or num_heads
        if head_dim is None:
            if num_heads <= 0 or dim % num_heads:
                raise ValueError(f"UpcycledDiffAttention: width {dim} is not divisible by num_heads {num_heads}")
            head_dim = dim // num_heads
        check_heads(dim, num_heads, num_kv_heads, head_dim, 1, use_rope, "UpcycledDiffAttention")
        self.dim, self.num_heads, self.num_kv_heads, self.head_dim = dim, num_heads, num_kv_heads, head_dim
        self.layer_idx, self.causal, self.use_rope, self.backend = layer_idx, causal, use_rope, backend
        self.lambda_init_spec = lambda_init
        self.lambda_init = resolve_lambda_init(lambda_init, layer_idx)
        if not self.lambda_init < 1.0:
            raise ValueError(f"UpcycledDiffAttention: lambda_init {self.lambda_init} must be < 1 "
                             f"(the raw branch is scaled by 1 / (1 - lambda_init))")
        self.lambda_std = lambda_std
        self._make_params(qkv_bias, proj_bias, norm_eps)  # DiffAttention's, at E = hd
        self.norm_gate = nn.Parameter(torch.zeros(num_heads))  # beta: 0 = raw (pretrained) head, 1 = the paper's head
        self.reset_lambda()

    def forward(self, x: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, kv_cache: Optional[KVCache] = None,
                causal: Optional[bool] = None) -> torch.Tensor:
        """x (B, N, E) -> (B, N, E); arguments as in :meth:`diffmm.nn.DiffAttention.forward`."""
        B, N, _ = x.shape
        h, d = self.num_heads, self.head_dim
        q, k, v = self._qkv(x, rope, kv_cache)  # DiffAttention's projections, RoPE and cache
        a = diff_attention(q, k, v, self.lambda_full(), causal=self.causal if causal is None else causal,
                           attn_mask=attn_mask, backend=self.backend)  # (B, N, h, 2d) raw A, no norm
        af = a.float() if a.dtype in (torch.float16, torch.bfloat16) else a
        raw = af * (1.0 / (1.0 - self.lambda_init))
        normed = af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + self.diff_norm.eps)
        normed = normed * self.diff_norm.weight.to(af.dtype) * (1.0 - self.lambda_init)
        beta = self.norm_gate.to(af.dtype)[:, None]  # (h, 1)
        out = (raw + beta * (normed - raw)).to(x.dtype)
        return self.out_proj(out.reshape(B, N, 2 * h * d))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", upcycled (2x heads, gated norm)"


register_attention(UPCYCLED, UpcycledDiffAttention, components=1)


def _pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of head j -> two copies (components 2j, 2j+1): (H*d, ...) -> (2*H*d, ...)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 1, d, *w.shape[1:]).expand(heads, 2, d, *w.shape[1:]).reshape(2 * heads * d, *w.shape[1:])


@torch.no_grad()
def upcycle_diff(layer: UpcycledDiffAttention, w: StdAttnWeights, *, split_noise: float = 0.1,
                 generator: Optional[torch.Generator] = None) -> UpcycledDiffAttention:
    """Set ``layer`` (h = H heads of dim d at ``w``'s width) to compute exactly what ``w`` computes (see the module
    docstring).

    Args:
        layer: the new layer, built with ``w``'s width, heads and biases.
        w: the pretrained layer's weights.
        split_noise: std of the zero-sum noise between the two value halves' out-proj columns, relative to the
            std of ``Wo`` (breaks their symmetry; 0 keeps them identical forever).
        generator: RNG for the lambda vectors and the split noise.
    """
    H, d, E = w.num_heads, w.head_dim, w.dim
    ct = torch.promote_types(w.wq.dtype, torch.float32)
    layer.to(ct)
    layer.q_proj.weight.copy_(_pairs(w.wq, H))
    layer.k_proj.weight.copy_(_pairs(w.wk, H))
    layer.v_proj.weight.copy_(_pairs(w.wv, H))  # value of head j = [v_j, v_j]
    if w.qkv_bias:
        layer.q_proj.bias.copy_(_pairs(w.bq, H))
        layer.k_proj.bias.copy_(_pairs(w.bk, H))
        layer.v_proj.bias.copy_(_pairs(w.bv, H))
    wo = w.wo.to(ct).reshape(E, H, 1, d)
    eps = torch.randn(wo.shape, generator=generator, dtype=ct, device=wo.device) * (split_noise * w.wo.float().std())
    layer.out_proj.weight.copy_(torch.cat([wo / 2 - eps, wo / 2 + eps], dim=2).reshape(E, 2 * H * d))
    if w.proj_bias:
        layer.out_proj.bias.copy_(w.bo)
    for p in (layer.lambda_q1, layer.lambda_k1):
        p.copy_(torch.randn(d, generator=generator, dtype=ct, device=p.device) * layer.lambda_std)
    layer.lambda_q2.copy_(layer.lambda_q1)  # lambda = exp(a) - exp(a) + lambda_init = lambda_init
    layer.lambda_k2.copy_(layer.lambda_k1)
    layer.diff_norm.weight.fill_(1.0)
    layer.norm_gate.zero_()
    return layer


@torch.no_grad()
def upcycle_v2(layer: DiffV2Attention, w: StdAttnWeights) -> DiffV2Attention:
    """Set a DIFF V2 layer (H heads at ``w``'s width) to compute exactly what ``w`` computes.

    Query maps 2j and 2j+1 = the pretrained ``q_j``; K, V = the pretrained ones; ``W_lambda = 0`` so
    ``sigmoid = 1/2`` and head_j = O_j - O_j / 2; ``out_proj = 2 Wo`` restores the pretrained output.
    """
    H = w.num_heads
    layer.to(torch.promote_types(w.wq.dtype, torch.float32))
    layer.q_proj.weight.copy_(_pairs(w.wq, H))
    layer.k_proj.weight.copy_(w.wk)
    layer.v_proj.weight.copy_(w.wv)
    if w.qkv_bias:
        layer.q_proj.bias.copy_(_pairs(w.bq, H))
        layer.k_proj.bias.copy_(w.bk)
        layer.v_proj.bias.copy_(w.bv)
    layer.lambda_proj.weight.zero_()
    layer.out_proj.weight.copy_(2 * w.wo)
    if w.proj_bias:
        layer.out_proj.bias.copy_(w.bo)
    return layer


@torch.no_grad()
def copy_standard(layer: Attention, w: StdAttnWeights) -> Attention:
    """diffmm's standard :class:`diffmm.nn.Attention` with the same weights (exact)."""
    layer.to(torch.promote_types(w.wq.dtype, torch.float32))
    for name, wt, b in (("q_proj", w.wq, w.bq), ("k_proj", w.wk, w.bk), ("v_proj", w.wv, w.bv),
                        ("out_proj", w.wo, w.bo)):
        getattr(layer, name).weight.copy_(wt)
        if b is not None:
            getattr(layer, name).bias.copy_(b)
    return layer


#: attn_type -> the registered type ``init='upcycle'`` builds; other types swap only with ``init='scratch'``
UPCYCLE_TYPES = {"diff": UPCYCLED, UPCYCLED: UPCYCLED, "diff_v2": "diff_v2", "standard": "standard"}


def upcycle(layer: nn.Module, w: StdAttnWeights, *, generator: Optional[torch.Generator] = None) -> nn.Module:
    """Set the weights of ``layer`` (a new layer of an :data:`UPCYCLE_TYPES` type, or its call-convention adapter,
    built with ``w``'s width, heads and biases) so that it computes exactly what ``w`` computes."""
    if isinstance(layer, UpcycledDiffAttention):
        return upcycle_diff(layer, w, generator=generator)
    if isinstance(layer, DiffV2Attention):
        return upcycle_v2(layer, w)
    if isinstance(layer, Attention):
        return copy_standard(layer, w)
    raise NotImplementedError(f"init='upcycle' is implemented for attn_type in {', '.join(UPCYCLE_TYPES)}; "
                              f"got a {type(layer).__name__} (use init='scratch')")
