"""The ViT image tower of (Diff)CLIP (the official DiffCLIP layout): patch embedding, CLS token, learned positions,
pre-norm blocks, final LayerNorm, CLS (or mean) pooling. The projection to the joint space lives in the
CLIP model (``image_projection``), as in the official DiffCLIP checkpoint.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from diffmm.models.clip.blocks import Rows, VisionBlock
from diffmm.models.clip.config import VisionCfg, layer_attn_types
from diffmm.nn import LayerNorm, create_attention

#: the parts of open_clip's ``preprocess_cfg`` that diffmm's image transforms fix (``preprocess.image_transform``)
PREPROCESS_FIXED = {"interpolation": "bicubic", "resize_mode": "shortest"}


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens: ``proj`` is a Conv2d with kernel = stride = patch."""

    def __init__(self, image_size: int, patch_size: int, width: int, bias: bool):
        super().__init__()
        self.image_size, self.patch_size = image_size, patch_size
        self.num_patches = (image_size // patch_size) ** 2
        self.proj = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != 3 or x.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"images have shape {tuple(x.shape)}; expected (B, 3, {self.image_size}, "
                             f"{self.image_size})")
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, P, W)


class VisionTransformer(nn.Module):
    """ViT encoder: images (B, 3, S, S) -> pooled features (B, width).

    Args:
        cfg: the tower config (width, depth, heads, attention type, pre-norm, ...).
        attn_backend: attention backend for every layer.
    """

    def __init__(self, cfg: VisionCfg, attn_backend: Optional[str] = None):
        super().__init__()
        self.cfg = cfg
        W = cfg.width
        self.patch_embed = PatchEmbed(cfg.image_size, cfg.patch_size, W, cfg.patch_bias)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, W))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, W))
        self.norm_pre = LayerNorm(W, eps=cfg.norm_eps) if cfg.pre_norm else nn.Identity()
        self.blocks = nn.ModuleList([
            VisionBlock(W, create_attention(t, W, cfg.heads, layer_idx=i, lambda_init=cfg.lambda_init, causal=False,
                                            qkv_bias=cfg.qkv_bias, proj_bias=cfg.proj_bias, backend=attn_backend),
                        cfg.mlp_ratio, cfg.act, cfg.norm_eps, cfg.layer_scale_init)
            for i, t in enumerate(layer_attn_types(cfg))])
        self.norm = LayerNorm(W, eps=cfg.norm_eps)
        self.grad_checkpointing = False
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, width**-0.5) for the CLS token and positions (open_clip); layers keep their own init."""
        scale = self.cfg.width ** -0.5
        nn.init.normal_(self.cls_token, std=scale)
        nn.init.normal_(self.pos_embed, std=scale)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @property
    def image_size(self) -> tuple[int, int]:
        """open_clip's ``visual.image_size``: (height, width) of the input."""
        return (self.cfg.image_size, self.cfg.image_size)

    @property
    def patch_size(self) -> tuple[int, int]:
        """open_clip's ``visual.patch_size``."""
        return (self.cfg.patch_size, self.cfg.patch_size)

    @property
    def grid_size(self) -> tuple[int, int]:
        """open_clip's ``visual.grid_size``: patches per side."""
        return (self.cfg.image_size // self.cfg.patch_size,) * 2

    @property
    def preprocess_cfg(self) -> dict:
        """open_clip's ``visual.preprocess_cfg`` (what ``open_clip.get_model_preprocess_cfg`` reads), from the config:
        size, RGB, mean / std (``image_mean`` / ``image_std``), bicubic, shortest-side resize, fill 0."""
        return {"size": (self.cfg.image_size, self.cfg.image_size), "mode": "RGB", "mean": self.cfg.mean,
                "std": self.cfg.std, "interpolation": PREPROCESS_FIXED["interpolation"],
                "resize_mode": PREPROCESS_FIXED["resize_mode"], "fill_color": 0}

    @preprocess_cfg.setter
    def preprocess_cfg(self, value: dict) -> None:
        """Take mean / std into the config (open_clip's ``set_model_preprocess_cfg``); other fields must be what
        diffmm's transforms do."""
        size = value.get("size", self.cfg.image_size)
        if (tuple(size) if isinstance(size, (tuple, list)) else (size, size)) != (self.cfg.image_size,) * 2:
            raise ValueError(f"preprocess_cfg size {size!r}; this model takes {self.cfg.image_size} px images")
        for key, fixed in (("mode", "RGB"), *PREPROCESS_FIXED.items()):
            if value.get(key, fixed) != fixed:
                raise ValueError(f"preprocess_cfg {key} {value[key]!r}; diffmm's transforms use {fixed!r}")
        self.cfg.image_mean = tuple(value["mean"]) if value.get("mean") is not None else None
        self.cfg.image_std = tuple(value["std"]) if value.get("std") is not None else None

    def prefix(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """images (B, 3, S, S) -> the tokens entering block ``start`` (B, 1 + P, W): embeddings and blocks before
        it (what a locked tower with the blocks from ``start`` on unlocked may compute once per image)."""
        x = self.patch_embed(x)  # (B, P, W)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)  # (B, 1 + P, W)
        x = self.norm_pre(x + self.pos_embed.to(x.dtype))
        return self.run_blocks(x, 0, start)

    def run_blocks(self, x: torch.Tensor, start: int, stop: Optional[int] = None, rows: Rows = None) -> torch.Tensor:
        """Tokens (B, 1 + P, W) through blocks ``start`` .. ``stop - 1`` (default: to the last); with ``rows``, only
        those tokens (B, W) leave the last of them (``VisionBlock.forward``)."""
        blocks = self.blocks[start:stop]
        for i, blk in enumerate(blocks):
            last_rows = rows if i == len(blocks) - 1 else None
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, None, last_rows, use_reentrant=False)
            else:
                x = blk(x, rows=last_rows)
        return x

    def suffix(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The tokens entering block ``start`` (:meth:`prefix`) -> pooled features (B, W). With CLS pooling the
        last block's MLP and the final norm run on the CLS token alone (the other tokens are not read)."""
        if self.cfg.pool_type == "tok" and start < len(self.blocks):
            return self.norm(self.run_blocks(x, start, rows=0))
        return self.pool(self.norm(self.run_blocks(x, start)))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """images (B, 3, S, S) -> normalised tokens (B, 1 + P, W), CLS first."""
        return self.norm(self.prefix(x, len(self.blocks)))

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1 + P, W) -> (B, W): the CLS token, or the mean of the patch tokens."""
        return x[:, 0] if self.cfg.pool_type == "tok" else x[:, 1:].mean(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """images (B, 3, S, S) -> pooled features (B, W)."""
        return self.suffix(self.prefix(x, 0), 0)
