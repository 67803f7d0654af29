"""``diffmm export``: write a diffmm export folder (``config.json`` + ``model.safetensors``) from any checkpoint.

Examples::

    diffmm export runs/diffclip-tiny-emoji/checkpoints/last.ckpt exports/diffclip-tiny
    diffmm export checkpoint_best.pt exports/diffclip-b16 --trust_pickle true
    diffmm export OpenCLIP-ViT-B-16 exports/openclip-b16 --pretrained open_clip_model.safetensors
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal, Optional

import torch

from diffmm.hub.checkpoint import is_lightning_checkpoint
from diffmm.hub.diffmm_export import save_export
from diffmm.hub.factory import create_model, has_weights, load_lightning, random_weights_message

log = logging.getLogger("diffmm.hub")


def export(checkpoint: str, out: str, *, pretrained: Optional[str] = None, kind: Optional[Literal["clip", "lm"]] = None,
           model: Optional[str] = None, model_config: Optional[str] = None, prefix: str = "model.",
           dtype: Optional[Literal["fp32", "fp16", "bf16"]] = None, trust_pickle: bool = False) -> Path:
    """Write a diffmm export folder (config.json + model.safetensors) from a checkpoint; returns the folder.

    A Lightning checkpoint's model is rebuilt from the checkpoint (its saved model config, else its ``model_name`` /
    ``model_kwargs`` / ``swap`` hyper-parameters, or ``model`` / ``model_config``) and its ``model.*`` weights are
    loaded strictly.

    Args:
        checkpoint: a Lightning .ckpt from diffmm fit, any checkpoint diffmm.load_pretrained reads (official
            DiffCLIP with trust_pickle, open_clip files, local-dir: folders, ...), or a model name
            (diffmm.create_model's rule) with pretrained weights (without them: random weights, and a warning).
        out: the export folder to write.
        pretrained: weights for a model name given as checkpoint (any format diffmm loads).
        kind: the model kind of a Lightning checkpoint (default: told by its keys).
        model: the model config name of a Lightning checkpoint (default: its model_name).
        model_config: a JSON model config file for a Lightning checkpoint (overrides model).
        prefix: the prefix of the model's keys in a Lightning state dict.
        dtype: cast the weights before writing.
        trust_pickle: allow checkpoints that need full unpickling (only for files you trust).
    """
    if is_lightning_checkpoint(checkpoint):
        net = load_lightning(checkpoint, kind=kind, prefix=prefix, model_name=model, model_config=model_config,
                             trust_pickle=trust_pickle)
    elif (model or model_config) and not pretrained:
        raise ValueError(f"{checkpoint}: --model / --model_config choose the architecture of a Lightning checkpoint; "
                         f"this is not one")
    else:  # a checkpoint, or a model name (diffmm.create_model's rule) with weights from pretrained or none
        net = create_model(checkpoint, pretrained, trust_pickle=trust_pickle)
        if not has_weights(checkpoint, pretrained):
            log.warning(random_weights_message(checkpoint))
    if dtype:
        net = net.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    folder = save_export(net, out)
    print(f"wrote {folder}")
    return folder
