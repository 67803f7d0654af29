"""Differential attention that reproduces a pretrained standard layer exactly ("upcycling"): the layer
``swap_attention(attn_type='diff', init='upcycle')`` builds (the weights it starts from and why: docs/models.md,
"init='upcycle': function-preserving conversion").

It differs from the paper's layer in two ways. **2x heads**: h = H differential heads of component dim d, so every
pretrained head keeps its own pair of maps (both components start as the pretrained ``q_j`` / ``k_j``, the value as
``[v_j, v_j]``, the out-proj halves as ``Wo_j / 2 -/+ eps_j``, lambda = lambda_init exactly). **A gated norm**:
``head = raw + beta * (RMSNorm(A) * g * (1 - lambda_init) - raw)`` with ``raw = A / (1 - lambda_init)`` and a
learnable per-head gate ``beta`` (``norm_gate``) starting at 0, so at step 0 the head output is exactly the
pretrained one, and beta = 1 is the paper's head. DIFF V2 needs no new layer
(:meth:`diffmm.nn.DiffV2Attention.load_standard`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx
import torch.nn as nn

from diffmm.nn.attention_layer import StdAttnWeights, pair_rows
from diffmm.nn.diff_attention import DiffAttention
from diffmm.nn.kv_cache import KVCache
from diffmm.ops import diff_attention


def gated_head_norm(a: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float,
                    lambda_init: float) -> torch.Tensor:
    """``raw + gate * (RMSNorm(a) * weight * (1 - lambda_init) - raw)`` with ``raw = a / (1 - lambda_init)``, per
    head: a (B, N, h, 2d), gate (h,); computed in fp32 (fp64 stays), returned in ``a``'s dtype."""
    af = a.float() if a.dtype in (torch.float16, torch.bfloat16) else a
    raw = af * (1.0 / (1.0 - lambda_init))
    normed = af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + eps) * weight.to(af.dtype) * (1.0 - lambda_init)
    return (raw + gate.to(af.dtype)[:, None] * (normed - raw)).to(a.dtype)


torch.fx.wrap("diff_attention")  # FX leaves (dtype choices and backend dispatch run on real tensors)
torch.fx.wrap("gated_head_norm")


class UpcycledDiffAttention(DiffAttention, attn_type="diff_upcycled"):
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

    head_ratio = 1  # E = h * d: the pretrained layer's heads, each with two maps (q/k/v 2E wide)
    upcycle_to = None  # it is its own upcycled type (load_standard)

    def __init__(self, dim: int, num_heads: int, *, lambda_init: str | float = "constant", **kwargs):
        super().__init__(dim, num_heads, lambda_init=lambda_init, **kwargs)  # DiffAttention's, at E = hd
        if not self.lambda_init < 1.0:
            raise ValueError(f"UpcycledDiffAttention: lambda_init {self.lambda_init} must be < 1 "
                             f"(the raw branch is scaled by 1 / (1 - lambda_init))")
        self.norm_gate = nn.Parameter(torch.zeros(num_heads))  # beta: 0 = raw (pretrained) head, 1 = the paper's head

    def forward(self, x: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, kv_cache: Optional[KVCache] = None,
                causal: Optional[bool] = None) -> torch.Tensor:
        """x (B, N, E) -> (B, N, E); arguments as in :meth:`diffmm.nn.DiffAttention.forward`."""
        B, N, _ = x.shape
        h, d = self.num_heads, self.head_dim
        q, k, v = self._qkv(x, rope, kv_cache)  # DiffAttention's projections, RoPE and cache
        a = diff_attention(q, k, v, self.lambda_full(), causal=self.causal if causal is None else causal,
                           attn_mask=attn_mask, backend=self.backend)  # (B, N, h, 2d) raw A, no norm
        out = gated_head_norm(a, self.diff_norm.weight, self.norm_gate, self.diff_norm.eps, self.lambda_init)
        return self.out_proj(out.reshape(B, N, 2 * h * d))

    @torch.no_grad()
    def load_standard(self, w: StdAttnWeights, *, generator: Optional[torch.Generator] = None,
                      split_noise: float = 0.1) -> None:
        """Compute exactly what ``w`` computes (see the module docstring).

        Args:
            w: the pretrained layer's weights (this layer: h = H heads of dim d at ``w``'s width).
            generator: RNG for the lambda vectors and the split noise.
            split_noise: std of the zero-sum noise between the two value halves' out-proj columns, relative to the
                std of ``Wo`` (breaks their symmetry; 0 keeps them identical forever).
        """
        H, d, E = w.num_heads, w.head_dim, w.dim
        ct = torch.promote_types(w.wq.dtype, torch.float32)
        self.to(ct)
        self.q_proj.weight.copy_(pair_rows(w.wq, H))
        self.k_proj.weight.copy_(pair_rows(w.wk, H))
        self.v_proj.weight.copy_(pair_rows(w.wv, H))  # value of head j = [v_j, v_j]
        if w.qkv_bias:
            self.q_proj.bias.copy_(pair_rows(w.bq, H))
            self.k_proj.bias.copy_(pair_rows(w.bk, H))
            self.v_proj.bias.copy_(pair_rows(w.bv, H))
        wo = w.wo.to(ct).reshape(E, H, 1, d)
        eps = torch.randn(wo.shape, generator=generator, dtype=ct, device=wo.device)
        eps = eps * (split_noise * w.wo.float().std())
        self.out_proj.weight.copy_(torch.cat([wo / 2 - eps, wo / 2 + eps], dim=2).reshape(E, 2 * H * d))
        if w.proj_bias:
            self.out_proj.bias.copy_(w.bo)
        for p in (self.lambda_q1, self.lambda_k1):
            p.copy_(torch.randn(d, generator=generator, dtype=ct, device=p.device) * self.lambda_std)
        self.lambda_q2.copy_(self.lambda_q1)  # lambda = exp(a) - exp(a) + lambda_init = lambda_init
        self.lambda_k2.copy_(self.lambda_k1)
        self.diff_norm.weight.fill_(1.0)
        self.norm_gate.zero_()

    def extra_repr(self) -> str:
        return super().extra_repr() + ", upcycled (2x heads, gated norm)"
