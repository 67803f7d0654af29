"""The causal text Transformer of (Diff)CLIP: a stack of pre-norm blocks (``resblocks``).

Token and position embeddings, the final LayerNorm, EOT pooling and the projection sit on the CLIP model
itself (``token_embedding``, ``positional_embedding``, ``ln_final``, ``text_projection``), as in open_clip's
``CLIP`` and the official DiffCLIP checkpoint.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from diffmm.models.clip.blocks import Rows, TextBlock, pick_rows
from diffmm.models.clip.config import TextCfg, layer_attn_types
from diffmm.nn import create_attention


class TextTransformer(nn.Module):
    """``resblocks`` with causal attention: (B, L, W) -> (B, L, W)."""

    def __init__(self, cfg: TextCfg, attn_backend: Optional[str] = None):
        super().__init__()
        self.cfg = cfg
        self.width, self.layers = cfg.width, cfg.layers
        self.resblocks = nn.ModuleList([
            TextBlock(cfg.width, create_attention(t, cfg.width, cfg.heads, layer_idx=i, lambda_init=cfg.lambda_init,
                                                  causal=True, qkv_bias=cfg.qkv_bias, proj_bias=cfg.proj_bias,
                                                  backend=attn_backend),
                      cfg.mlp_ratio, cfg.act, cfg.norm_eps)
            for i, t in enumerate(layer_attn_types(cfg))])
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, rows: Rows = None) -> torch.Tensor:
        """(B, L, W) -> (B, L, W); with ``rows`` (``blocks.pick_rows``) only those tokens (B, W) leave the last
        block, whose MLP runs on them alone."""
        for i, blk in enumerate(self.resblocks):
            last_rows = rows if i == len(self.resblocks) - 1 else None
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, attn_mask, last_rows, use_reentrant=False)
            else:
                x = blk(x, attn_mask=attn_mask, rows=last_rows)
        return x if self.resblocks else pick_rows(x, rows)
