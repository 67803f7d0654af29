"""Differential attention (DIFF Transformer, arXiv 2410.05258) as a self-contained layer."""
from __future__ import annotations

from typing import Final, Optional

import torch
import torch.fx
import torch.nn as nn

from diffmm.nn.attention_layer import AttentionLayer, QKMaps
from diffmm.nn.kv_cache import KVCache
from diffmm.nn.lambdas import lambda_full, resolve_lambda_init
from diffmm.nn.norm import RMSNorm
from diffmm.ops import diff_attention

torch.fx.wrap("diff_attention")  # FX leaves: checks, dtype choices and backend dispatch run on real tensors
torch.fx.wrap("lambda_full")


class DiffAttention(AttentionLayer, attn_type="diff"):
    """Multi-head differential attention.

    ``(softmax(Q1 K1^T/sqrt(d)) - lambda softmax(Q2 K2^T/sqrt(d))) V``, then a per-head RMSNorm
    (weight shared across heads) and the (1 - lambda_init) scale, then the output projection.

    Args:
        dim: model width E = 2 * num_heads * head_dim.
        num_heads: differential heads h (half the heads of the Transformer it replaces).
        num_kv_heads: differential kv heads (GQA); default num_heads.
        head_dim: component dim d; default dim // (2 * num_heads).
        layer_idx: 0-based depth, for ``lambda_init='depth'``.
        lambda_init: ``'depth'`` (paper), ``'constant'`` (0.8, DiffCLIP) or a number.
        qkv_bias / proj_bias: biases of the q/k/v and output projections.
        causal: default masking of ``forward``.
        use_rope: rotate q/k components with the ``rope`` passed to ``forward``.
        norm_eps: eps of the per-head RMSNorm.
        lambda_std: std of the normal init of the lambda vectors.
        backend: attention backend name (``diffmm.ops``); None = env / automatic.
    """

    use_rope: Final[bool]
    head_ratio = 2  # half the heads of the standard Transformer at this width, two query/key maps each
    upcycle_to = "diff_upcycled"  # the paper's layer cannot reproduce a pretrained one; this variant can
    capture_kind = "diff"

    def __init__(self, dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, layer_idx: int = 0, lambda_init: str | float = "depth",
                 qkv_bias: bool = False, proj_bias: bool = False, causal: bool = False, use_rope: bool = False,
                 norm_eps: float = 1e-5, lambda_std: float = 0.1, backend: Optional[str] = None):
        super().__init__()
        self._init_heads(dim, num_heads, num_kv_heads, head_dim, layer_idx, causal, use_rope, backend)
        self.lambda_init_spec = lambda_init
        self.lambda_init = resolve_lambda_init(lambda_init, layer_idx)
        self.lambda_std = lambda_std
        self._make_params(qkv_bias, proj_bias, norm_eps)
        self.reset_lambda()

    def _make_params(self, qkv_bias: bool, proj_bias: bool, norm_eps: float) -> None:
        """Projections (q/k: 2 components per head; v: 2d wide), the four lambda vectors, the head norm."""
        dim, h, hk, d = self.dim, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(dim, 2 * h * d, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, 2 * hk * d, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, 2 * hk * d, bias=qkv_bias)
        self.out_proj = nn.Linear(2 * h * d, dim, bias=proj_bias)
        self.lambda_q1 = nn.Parameter(torch.empty(d))
        self.lambda_k1 = nn.Parameter(torch.empty(d))
        self.lambda_q2 = nn.Parameter(torch.empty(d))
        self.lambda_k2 = nn.Parameter(torch.empty(d))
        self.diff_norm = RMSNorm(2 * d, eps=norm_eps)

    def reset_lambda(self) -> None:
        """Re-draw the lambda vectors from N(0, lambda_std)."""
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, mean=0.0, std=self.lambda_std)

    def lambda_full(self) -> torch.Tensor:
        """``exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` as a 0-d tensor in fp32 (fp64 for fp64 params)."""
        return lambda_full(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2, self.lambda_init)

    def _qkv(self, x: torch.Tensor, rope, kv_cache):
        """Project x (B, N, E) to q (B, N, 2h, d), k (B, S, 2h_kv, d), v (B, S, h_kv, 2d); RoPE and cache applied."""
        B, N, _ = x.shape
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k = self.project_qk(x, rope, 2 * h, 2 * hk)  # components 2i, 2i+1 belong to head i
        v = self.v_proj(x).view(B, N, hk, 2 * d)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        return q, k, v

    def forward(self, x: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, kv_cache: Optional[KVCache] = None,
                causal: Optional[bool] = None) -> torch.Tensor:
        """x (B, N, E) -> (B, N, E).

        Args:
            attn_mask: bool key padding (B, S) or additive float mask (see ``diffmm.ops.diff_attention``);
                with a KV cache, S counts every cached key.
            rope: (cos, sin) for the N new positions, from :class:`diffmm.nn.RotaryEmbedding`.
            kv_cache: append this step's keys/values and attend over all of them (inference).
            causal: override the layer's default.
        """
        B, N, _ = x.shape
        h, d = self.num_heads, self.head_dim
        q, k, v = self._qkv(x, rope, kv_cache)
        out = diff_attention(q, k, v, self.lambda_full(), causal=self.causal if causal is None else causal,
                             attn_mask=attn_mask, norm_weight=self.diff_norm.weight, lambda_init=self.lambda_init,
                             eps=self.diff_norm.eps, backend=self.backend)  # (B, N, h, 2d)
        return self.out_proj(out.reshape(B, N, 2 * h * d))

    def capture(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> QKMaps:
        """Query maps (B, N, 2h, d), key maps (B, N, 2h_kv, d); map c of head c // 2 reads key map c % 2 of its kv
        group; lambda as a 0-d tensor."""
        h, hk = self.num_heads, self.num_kv_heads
        q, k = self.project_qk(x, rope, 2 * h, 2 * hk)
        c = torch.arange(2 * h, device=x.device)
        return QKMaps(q, k, 2 * (c // 2 // (h // hk)) + c % 2, self.lambda_full())

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"lambda_init={self.lambda_init:.4g}, causal={self.causal}, rope={self.use_rope}")
