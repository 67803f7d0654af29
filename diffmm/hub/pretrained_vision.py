"""Pretrained image towers for diffmm's CLIP configs: ``vision_cfg.pretrained`` names the weights
:func:`diffmm.create_model` starts the image tower from (today: DINOv2 ViT-S/14 from an ONNX file,
:mod:`diffmm.hub.dinov2_onnx`); layers whose ``attn_type`` is not ``standard`` are upcycled from the pretrained
attention. Checkpoints and exports hold every weight and rebuild from their config without this module.
"""
from __future__ import annotations

import torch

from diffmm.hub.dinov2_onnx import DINOV2_VISION, diffclip_vision_state_dict
from diffmm.models.clip.config import CLIPConfig, layer_attn_types
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.swap import swap_attention


def init_pretrained_vision(cfg: CLIPConfig, seed: int = 0) -> DiffCLIP:
    """A DiffCLIP whose image tower starts from ``cfg.vision_cfg.pretrained`` (DINOv2 from an ONNX file: the
    tower's shape must be DINOv2 ViT-S/14's): built with standard attention, the weights loaded strictly, then the
    layers whose ``attn_type`` is not ``standard`` upcycled (function-preserving; their random parts drawn from
    ``seed``). The model's config then names the upcycled layer types, so its checkpoints rebuild without this."""
    v = cfg.vision_cfg
    wrong = [f"{k} {getattr(v, k)!r} (DINOv2: {want!r})" for k, want in DINOV2_VISION.items() if getattr(v, k) != want]
    if wrong or v.layer_scale_init is None:
        raise ValueError(f"vision_cfg.pretrained {v.pretrained!r} is a DINOv2 ViT-S/14; the config's vision_cfg has "
                         + ", ".join(wrong or ["no layer_scale_init (DINOv2 has layer scale)"]))
    types = layer_attn_types(v)
    model = DiffCLIP(cfg.replace(vision_cfg={"attn_type": "standard"}))
    model.visual.load_state_dict(diffclip_vision_state_dict(v.pretrained, v.image_size), strict=True)
    generator = torch.Generator().manual_seed(seed)
    for attn_type in dict.fromkeys(t for t in types if t != "standard"):
        swap_attention(model, towers="visual", layers=[i for i, t in enumerate(types) if t == attn_type],
                       init="upcycle", attn_type=attn_type, lambda_init=v.lambda_init, generator=generator)
    return model
