"""Standard multi-head attention with the same interface as :class:`DiffAttention` (the baseline twin)."""
from __future__ import annotations

from typing import Final, Optional

import torch
import torch.fx
import torch.nn as nn

from diffmm.nn.attention_layer import AttentionLayer, StdAttnWeights
from diffmm.nn.kv_cache import KVCache
from diffmm.ops import attention

torch.fx.wrap("attention")  # an FX leaf: its checks and backend dispatch run on real tensors


class Attention(AttentionLayer, attn_type="standard"):
    """Softmax attention with GQA, RoPE, masks and a KV cache.

    Args:
        dim: width E = num_heads * head_dim.
        num_heads: attention heads.
        num_kv_heads: kv heads (GQA); default num_heads.
        head_dim: default dim // num_heads.
        Others as in :class:`diffmm.nn.DiffAttention` (``layer_idx`` and ``lambda_init`` are accepted and ignored,
        so both layers can be built by one factory call).
    """

    use_rope: Final[bool]

    def __init__(self, dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, layer_idx: int = 0, lambda_init=None, qkv_bias: bool = False,
                 proj_bias: bool = False, causal: bool = False, use_rope: bool = False, norm_eps: float = 1e-5,
                 backend: Optional[str] = None, **unused):
        super().__init__()
        self._init_heads(dim, num_heads, num_kv_heads, head_dim, layer_idx, causal, use_rope, backend)
        num_kv_heads, head_dim = self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(num_heads * head_dim, dim, bias=proj_bias)

    def forward(self, x: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, kv_cache: Optional[KVCache] = None,
                causal: Optional[bool] = None) -> torch.Tensor:
        """x (B, N, E) -> (B, N, E); arguments as in :meth:`DiffAttention.forward`."""
        B, N, _ = x.shape
        heads = self.attend(x, attn_mask=attn_mask, rope=rope, kv_cache=kv_cache, causal=causal)  # (B, N, H, d)
        return self.out_proj(heads.reshape(B, N, -1))

    def attend(self, x: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
               rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, kv_cache: Optional[KVCache] = None,
               causal: Optional[bool] = None) -> torch.Tensor:
        """The heads' outputs (B, N, H, d) before the output projection."""
        B, N, _ = x.shape
        H, Hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k = self.project_qk(x, rope, H, Hk)  # (B, N, H, d), (B, N, Hk, d)
        v = self.v_proj(x).view(B, N, Hk, d)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        return attention(q, k, v, causal=self.causal if causal is None else causal, attn_mask=attn_mask,
                         backend=self.backend)

    @torch.no_grad()
    def load_standard(self, w: StdAttnWeights, *, generator: Optional[torch.Generator] = None) -> None:
        """The same weights as ``w`` (exact)."""
        self.to(torch.promote_types(w.wq.dtype, torch.float32))
        for lin, wt, b in ((self.q_proj, w.wq, w.bq), (self.k_proj, w.wk, w.bk), (self.v_proj, w.wv, w.bv),
                           (self.out_proj, w.wo, w.bo)):
            lin.weight.copy_(wt)
            if b is not None:
                lin.bias.copy_(b)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, causal={self.causal}"
