"""DIFF V2 attention (unilm's ``Diff-Transformer-V2``) as a layer with the same interface as :class:`DiffAttention`.

Width conventions (official unilm ``Diff-Transformer-V2``): V2 keeps the baseline Transformer's
heads, head dim and kv heads, and doubles only the query maps. At width E with H standard heads of
dim d = E / H, V2 has h = H output heads, 2H query maps of dim d, the same h_kv kv heads, an output
projection h*d -> E identical to the baseline, and a lambda projection E -> h. So
``create_attention('diff_v2', E, H)`` builds ``DiffV2Attention(E, H, head_dim=E // H)`` (``head_ratio = 1``:
no head halving, unlike V1).
"""
from __future__ import annotations

from typing import Final, Optional

import torch
import torch.fx
import torch.nn as nn

from diffmm.nn.attention_layer import AttentionLayer, QKMaps, StdAttnWeights, pair_rows
from diffmm.nn.kv_cache import KVCache
from diffmm.ops.diff_v2 import check_v2_heads, diff_v2_attention

torch.fx.wrap("diff_v2_attention")  # an FX leaf: its checks and backend dispatch run on real tensors


class DiffV2Attention(AttentionLayer, attn_type="diff_v2"):
    """DIFF V2: ``head_i = softmax(Q_2i K^T) V - sigmoid(x W_lambda)_i * softmax(Q_2i+1 K^T) V``.

    Both query maps of head i use the same kv head (i // (h / h_kv)); no per-head RMSNorm, no lambda_init.

    Args:
        dim: model width E = num_heads * head_dim.
        num_heads: output heads h (= the baseline Transformer's heads); the layer has 2h query maps.
        num_kv_heads: kv heads h_kv (GQA); default num_heads. h must be divisible by h_kv.
        head_dim: d; default dim // num_heads.
        layer_idx, lambda_init, norm_eps, lambda_std: accepted so one factory call builds any attention
            type; ignored (V2 has no lambda_init, per-head norm or lambda vectors).
        qkv_bias / proj_bias: biases of the q/k/v and output projections (lambda_proj never has one).
        causal: default masking of ``forward``.
        use_rope: rotate q/k with the ``rope`` passed to ``forward``.
        backend: standard-attention backend name (``diffmm.ops``); None = env / automatic.
    """

    use_rope: Final[bool]
    capture_kind = "diff_v2"  # head_ratio 1: the baseline's heads (no halving, unlike V1)

    def __init__(self, dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, layer_idx: int = 0, lambda_init=None, qkv_bias: bool = False,
                 proj_bias: bool = False, causal: bool = False, use_rope: bool = False, norm_eps: float = 1e-5,
                 lambda_std: Optional[float] = None, backend: Optional[str] = None, **unused):
        super().__init__()
        check_v2_heads(2 * num_heads, num_kv_heads or num_heads, type(self).__name__)
        self._init_heads(dim, num_heads, num_kv_heads, head_dim, layer_idx, causal, use_rope, backend)
        h, hk, d = num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(dim, 2 * h * d, bias=qkv_bias)  # 2h query maps; maps 2i, 2i+1 belong to head i
        self.k_proj = nn.Linear(dim, hk * d, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, hk * d, bias=qkv_bias)
        self.lambda_proj = nn.Linear(dim, h, bias=False)  # default nn.Linear init, as the official code
        self.out_proj = nn.Linear(h * d, dim, bias=proj_bias)

    def lambda_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token, per-head lambda logits (B, N, h); ``sigmoid`` of them is the subtracted weight."""
        return self.lambda_proj(x)

    def forward(self, x: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, kv_cache: Optional[KVCache] = None,
                causal: Optional[bool] = None) -> torch.Tensor:
        """x (B, N, E) -> (B, N, E).

        Args:
            attn_mask: bool key padding (B, S) or additive float mask (see ``diffmm.ops.diff_v2_attention``);
                with a KV cache, S counts every cached key.
            rope: (cos, sin) for the N new positions, from :class:`diffmm.nn.RotaryEmbedding` (dim = head_dim).
            kv_cache: append this step's keys/values and attend over all of them (inference).
            causal: override the layer's default.
        """
        B, N, _ = x.shape
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k = self.project_qk(x, rope, 2 * h, hk)  # (B, N, 2h, d), (B, N, h_kv, d)
        v = self.v_proj(x).view(B, N, hk, d)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        out = diff_v2_attention(q, k, v, self.lambda_logits(x), causal=self.causal if causal is None else causal,
                                attn_mask=attn_mask, backend=self.backend)  # (B, N, h, d)
        return self.out_proj(out.reshape(B, N, h * d))

    @torch.no_grad()
    def load_standard(self, w: StdAttnWeights, *, generator: Optional[torch.Generator] = None) -> None:
        """Compute exactly what ``w`` computes: query maps 2j and 2j+1 = the pretrained ``q_j``; K, V = the
        pretrained ones; ``W_lambda = 0`` so ``sigmoid = 1/2`` and head_j = O_j - O_j / 2; ``out_proj = 2 Wo``."""
        H = w.num_heads
        self.to(torch.promote_types(w.wq.dtype, torch.float32))
        self.q_proj.weight.copy_(pair_rows(w.wq, H))
        self.k_proj.weight.copy_(w.wk)
        self.v_proj.weight.copy_(w.wv)
        if w.qkv_bias:
            self.q_proj.bias.copy_(pair_rows(w.bq, H))
            self.k_proj.bias.copy_(w.bk)
            self.v_proj.bias.copy_(w.bv)
        self.lambda_proj.weight.zero_()
        self.out_proj.weight.copy_(2 * w.wo)
        if w.proj_bias:
            self.out_proj.bias.copy_(w.bo)

    def capture(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> QKMaps:
        """Query maps (B, N, 2h, d), kv heads (B, N, h_kv, d); both maps of head i read kv head
        2i // (2h / h_kv); the per-token weights sigmoid(x W_lambda) (B, N, h)."""
        h, hk = self.num_heads, self.num_kv_heads
        q, k = self.project_qk(x, rope, 2 * h, hk)
        return QKMaps(q, k, torch.arange(2 * h, device=x.device) // (2 * h // hk),
                      torch.sigmoid(self.lambda_logits(x)))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, query_maps={2 * self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, rope={self.use_rope}")

