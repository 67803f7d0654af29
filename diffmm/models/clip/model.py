"""DiffCLIP: a CLIP whose towers use differential (or any registered) attention, with open_clip's model
interface (``encode_image``, ``encode_text``, ``logit_scale``, ``logit_bias``, ``forward``, ``output_dict``,
``get_logits``, ``visual.preprocess_cfg``) and open_clip's conventions for them.

The state-dict layout is the official DiffCLIP checkpoint's (DiffCLIP, arXiv 2503.06626; code: github
hammoudhasan/DiffCLIP): ``visual.*`` (timm-style ViT),
``image_projection``, the text tower at top level (``token_embedding``, ``positional_embedding``,
``transformer.resblocks.*``, ``ln_final``, ``text_projection``) and ``logit_scale``. A Hugging Face text tower
(``text_cfg.hf_model_name``) sits under ``text.*`` instead (``text.transformer.*``, ``text.proj``), as in open_clip's
``CustomTextCLIP``.

``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` (:mod:`diffmm.models.hub_mixin`) write and read diffmm's
export folder with the caption tokenizer in it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffmm.models.clip.config import CLIPConfig
from diffmm.models.clip.hf_text import HFTextTower
from diffmm.models.clip.preprocess import tokenizer_for
from diffmm.models.clip.text import TextTransformer
from diffmm.models.clip.vision import VisionTransformer
from diffmm.models.hub_mixin import DiffmmHubMixin, save_tokenizer_object
from diffmm.nn import LayerNorm

PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "out_proj")


class DiffCLIP(nn.Module, DiffmmHubMixin, paper_url="https://arxiv.org/abs/2503.06626", tags=["clip"],
               pipeline_tag="zero-shot-image-classification"):
    """Contrastive image-text model.

    Args:
        cfg: :class:`CLIPConfig` (towers, embed_dim, logit scale).
        output_dict: ``forward`` returns a dict instead of a tuple (open_clip's flag).
    """

    export_kind = "clip"
    card_description = "a CLIP whose towers use differential or standard attention"

    def __init__(self, cfg: CLIPConfig, output_dict: bool = False):
        super().__init__()
        self.config, self.output_dict = cfg, output_dict
        v, t = cfg.vision_cfg, cfg.text_cfg
        self.visual = VisionTransformer(v, cfg.attn_backend)
        self.image_projection = nn.Parameter(torch.empty(v.width, cfg.embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(float(cfg.init_logit_scale)))
        # open_clip's SigLIP-style bias added to the logits (config ``init_logit_bias``; None: a CLIP without one)
        self.logit_bias = (nn.Parameter(torch.tensor(float(cfg.init_logit_bias)))
                           if cfg.init_logit_bias is not None else None)
        if t.hf_model_name:  # pretrained weights, read now; init_weights leaves them alone
            self.text = HFTextTower(t, cfg.embed_dim, cfg.attn_backend)
            self.context_length, self.vocab_size = t.context_length, t.vocab_size
            self.init_weights()
            return
        self.context_length, self.vocab_size = t.context_length, t.vocab_size
        self.token_embedding = nn.Embedding(t.vocab_size, t.width)
        self.positional_embedding = nn.Parameter(torch.empty(t.context_length, t.width))
        self.transformer = TextTransformer(t, cfg.attn_backend)
        self.ln_final = LayerNorm(t.width, eps=t.norm_eps)
        self.text_projection = nn.Parameter(torch.empty(t.width, cfg.embed_dim))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """open_clip's text init; timm's ViT init (trunc normal 0.02, zero bias) for the vision Linear layers.

        Only Linear layers named like projections (q/k/v/out_proj) and the MLPs are touched, so a layer's own
        extra parameters (lambda vectors, norm weights, V2's lambda_proj) keep the layer's init. A Hugging Face text
        tower keeps its pretrained weights.
        """
        if not hasattr(self, "text"):
            self._init_text()
        for blk in self.visual.blocks:
            lins = [getattr(blk.attn, n, None) for n in PROJ_NAMES] + [blk.mlp.fc1, blk.mlp.fc2]
            for lin in lins:
                if isinstance(lin, nn.Linear):
                    nn.init.trunc_normal_(lin.weight, std=0.02)
                    if lin.bias is not None:
                        nn.init.zeros_(lin.bias)
        nn.init.normal_(self.image_projection, std=self.config.vision_cfg.width ** -0.5)

    def _init_text(self) -> None:
        t = self.config.text_cfg
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        attn_std, fc_std = t.width ** -0.5, (2 * t.width) ** -0.5
        proj_std = attn_std * (2 * t.layers) ** -0.5
        for blk in self.transformer.resblocks:
            for name in PROJ_NAMES:
                lin = getattr(blk.attn, name, None)
                if isinstance(lin, nn.Linear):
                    nn.init.normal_(lin.weight, std=proj_std if name == "out_proj" else attn_std)
                    if lin.bias is not None:
                        nn.init.zeros_(lin.bias)
            nn.init.normal_(blk.mlp.c_fc.weight, std=fc_std)
            nn.init.normal_(blk.mlp.c_proj.weight, std=proj_std)
        nn.init.normal_(self.text_projection, std=t.width ** -0.5)

    # Hugging Face hub (save_pretrained / from_pretrained / push_to_hub) ------------------------------------------
    @classmethod
    def config_from_dict(cls, config: dict[str, Any], *, source: str) -> CLIPConfig:
        return CLIPConfig.from_dict(config, source=source)

    def write_tokenizer(self, folder: Path, tokenizer: Any) -> None:
        """The caption tokenizer (default: the model's own, :func:`~diffmm.models.clip.preprocess.tokenizer_for`:
        the CLIP BPE, or a Hugging Face tower's tokenizer), ``model_max_length`` = the context length."""
        tokenizer = tokenizer if tokenizer is not None else tokenizer_for(self)
        save_tokenizer_object(tokenizer, folder, model_max_length=self.context_length)

    # open_clip-compatible helpers -------------------------------------------------------------------------------
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.visual.set_grad_checkpointing(enable)
        if hasattr(self, "text"):
            if enable:
                self.text.transformer.gradient_checkpointing_enable({"use_reentrant": False})
            else:
                self.text.transformer.gradient_checkpointing_disable()
        else:
            self.transformer.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Names of parameters excluded from weight decay beyond the 1-D ones (embeddings of positions)."""
        return {"positional_embedding", "visual.pos_embed", "visual.cls_token", "logit_scale", "logit_bias"}

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """images (B, 3, S, S) -> (B, embed_dim): pooled token ``@ image_projection``. Images are cast to the
        patch embedding's dtype (open_clip leaves that to the caller)."""
        x = self.visual(image.to(self.visual.patch_embed.proj.weight.dtype)) @ self.image_projection
        return F.normalize(x, dim=-1) if normalize else x

    def encode_text(self, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """token ids (B, L <= context_length) -> (B, embed_dim): EOT token (argmax of the ids) ``@ text_projection``."""
        if text.dim() != 2 or text.shape[1] > self.context_length:
            raise ValueError(f"text has shape {tuple(text.shape)}; expected (B, L) with L <= {self.context_length}")
        if hasattr(self, "text"):  # Hugging Face tower: pooled (mean or first token) -> proj
            x = self.text(text)
            return F.normalize(x, dim=-1) if normalize else x
        L, dtype = text.shape[1], self.text_projection.dtype  # low precision under fp16 / bf16 (open_clip's cast)
        x = self.token_embedding(text).to(dtype) + self.positional_embedding[:L].to(dtype)  # (B, L, W)
        x = self.transformer(x, rows=text.argmax(dim=-1))  # (B, W): the EOT tokens (argmax of the ids)
        x = self.ln_final(x) @ self.text_projection
        return F.normalize(x, dim=-1) if normalize else x

    def logit_scale_value(self) -> torch.Tensor:
        """``exp(logit_scale)`` clamped at ``config.logit_scale_max`` (100): the scale diffmm's training and
        evaluation use (``forward`` / ``get_logits`` return open_clip's unclamped ``logit_scale.exp()``)."""
        return self.logit_scale.exp().clamp(max=self.config.logit_scale_max)

    def get_logits(self, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(image->text, text->image) logits of normalised features: ``logit_scale.exp() * img @ txt.T`` (+
        ``logit_bias``), open_clip's ``get_logits``."""
        img, txt = self.encode_image(image, normalize=True), self.encode_text(text, normalize=True)
        logits = self.logit_scale.exp() * img @ txt.T
        if self.logit_bias is not None:
            logits = logits + self.logit_bias
        return logits, logits.T

    def forward(self, image: Optional[torch.Tensor] = None, text: Optional[torch.Tensor] = None,
                normalize: bool = True):
        """open_clip's ``CLIP.forward``: L2-normalised features of the given towers (None for a missing one),
        ``logit_scale.exp()`` and, when the model has one, ``logit_bias``; a dict with ``output_dict``, else a tuple
        ``(image_features, text_features, logit_scale[, logit_bias])``.

        ``normalize=False`` (not in open_clip) returns the raw projected features, as the official DiffCLIP model.
        """
        img = self.encode_image(image, normalize=normalize) if image is not None else None
        txt = self.encode_text(text, normalize=normalize) if text is not None else None
        scale = self.logit_scale.exp()
        if self.output_dict:
            out = {"image_features": img, "text_features": txt, "logit_scale": scale}
            if self.logit_bias is not None:
                out["logit_bias"] = self.logit_bias
            return out
        if self.logit_bias is not None:
            return img, txt, scale, self.logit_bias
        return img, txt, scale

    def extra_repr(self) -> str:
        v, t = self.config.vision_cfg, self.config.text_cfg
        return (f"vision_attn={v.attn_type}, text_attn={t.attn_type}, lambda_init=({v.lambda_init}, "
                f"{t.lambda_init}), embed_dim={self.config.embed_dim}")
