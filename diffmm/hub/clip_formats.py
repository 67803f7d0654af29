"""Pretrained CLIP weights from local files: open_clip, timm, the official DiffCLIP layout and diffmm exports.

Every layout turns its file into a state dict in diffmm's ``DiffCLIP`` layout (``diffmm.hub.clip_convert``)
plus, where the file tells it, a config. Then either a model is built from that config (:func:`load_clip`,
``diffmm.load_pretrained``) or the weights go into an existing model (:func:`load_weights_and_config`,
``create_model(name, pretrained=...)``). Loads are strict: one error names every missing, unexpected and
mis-shaped key. Pickles load with ``weights_only=True`` unless ``trust_pickle=True``. Paths are local here;
``local-dir:`` / ``hf-hub:`` names are resolved by :mod:`diffmm.hub.factory`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from diffmm.hub.checkpoint import check_state_dict, peek_keys, raise_if_damaged, read_state_dict
from diffmm.hub.clip_convert import (from_open_clip_config, infer_official_config, infer_open_clip_config,
                                     infer_timm_vit_config, mha_text_to_diffmm, open_clip_to_diffmm,
                                     timm_vit_to_diffmm)
from diffmm.hub.diffmm_export import is_export_folder, read_export
from diffmm.hub.open_clip_models import open_clip_config
from diffmm.models.clip.config import IMAGENET_MEAN, IMAGENET_STD, CLIPConfig
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.clip.vision import VisionTransformer

OPEN_CLIP_CONFIG = "open_clip_config.json"
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                     "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth", "model.safetensors",
                     "pytorch_model.bin")
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
#: the CLIP file layouts this module reads, in the order :func:`clip_layout` tries them
CLIP_LAYOUTS = {
    "open_clip": "open_clip CLIP checkpoint file, or a folder / local-dir: with open_clip_config.json",
    "diffclip_official": "official DiffCLIP checkpoint (checkpoint_best.pt with trust_pickle=True, or a safetensors "
                         "state dict)",
    "timm_vit": "timm VisionTransformer state dict (image tower only)",
}


def _has(keys: set[str], key: str) -> bool:
    return key in keys or f"module.{key}" in keys


def clip_layout(path: Path) -> Optional[str]:
    """The :data:`CLIP_LAYOUTS` name of a file or folder, from its file names and keys (nothing unpickled), or
    None."""
    if path.is_dir():
        return "open_clip" if (path / OPEN_CLIP_CONFIG).is_file() else None
    keys = peek_keys(path)
    if _has(keys, "visual.class_embedding") or _has(keys, "visual.conv1.weight"):
        return "open_clip"
    if _has(keys, "image_projection") and _has(keys, "visual.patch_embed.proj.weight"):
        return "diffclip_official"
    if "patch_embed.proj.weight" in keys and "blocks.0.norm1.weight" in keys:
        return "timm_vit"
    return None


def _weights_in(folder: Path, names=OPEN_CLIP_WEIGHTS) -> Path:
    for n in names:
        if (folder / n).is_file():
            return folder / n
    found = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if len(found) == 1:
        return folder / found[0]
    raise FileNotFoundError(f"{folder}: no weights file (looked for {', '.join(names)}; found {found or 'none'})")


# ----------------------------------------------------------------------------------------------- readers
def _read_open_clip(path: Path, *, trust_pickle: bool = False, model_name: Optional[str] = None,
                    quick_gelu: Optional[bool] = None, head_width: int = 64, text_head_width: int = 64,
                    need_config: bool = True, **unused):
    """``model_name``: an open_clip architecture whose config the file uses. ``need_config=False`` (loading into an
    existing model): a config the shapes cannot tell is None, not an error (head widths are guesses)."""
    oc_cfg = None
    if path.is_dir():
        with open(path / OPEN_CLIP_CONFIG) as f:
            meta = json.load(f)
        if "model_cfg" not in meta:
            raise ValueError(f"{path / OPEN_CLIP_CONFIG}: no 'model_cfg' entry")
        oc_cfg, path = meta["model_cfg"], _weights_in(path)
    elif model_name is not None:
        oc_cfg = open_clip_config(model_name)
    raw = read_state_dict(path, trust_pickle=trust_pickle)
    if oc_cfg is not None:
        cfg = from_open_clip_config(dict(oc_cfg) if quick_gelu is None else {**oc_cfg, "quick_gelu": quick_gelu},
                                    source=str(path))
    else:
        try:
            cfg = infer_open_clip_config(raw, head_width=head_width, text_head_width=text_head_width,
                                         quick_gelu=bool(quick_gelu), source=str(path))
        except (ValueError, KeyError):
            if need_config:
                raise
            cfg = None
    return open_clip_to_diffmm(raw, source=str(path)), cfg, "clip"


def _read_official(path: Path, *, trust_pickle: bool = False, lambda_init: str | float = "constant",
                   preprocess: str = "auto", **unused):
    """``preprocess``: ``'official'`` (ImageNet mean/std, the official tokenizer truncation), ``'openai'`` (diffmm's
    defaults), or ``'auto'``: official for files written by the official code (SLIP format: ``best_acc1`` or DDP's
    ``module.`` prefix), diffmm's defaults for a bare state dict (diffmm's own ``DiffCLIP`` has the same layout)."""
    sd = mha_text_to_diffmm(read_state_dict(path, trust_pickle=trust_pickle), source=str(path))
    cfg = infer_official_config(sd, lambda_init=lambda_init, source=str(path))
    if preprocess not in ("auto", "official", "openai"):
        raise ValueError(f"preprocess {preprocess!r}; expected auto, official or openai")
    if preprocess == "official" or (preprocess == "auto" and _written_by_official_code(path)):
        cfg.vision_cfg.image_mean, cfg.vision_cfg.image_std = IMAGENET_MEAN, IMAGENET_STD
        cfg.text_cfg.truncate = "cut"  # the official tokenizer keeps the first context_length tokens
    return sd, cfg, "clip"


def _written_by_official_code(path: Path) -> bool:
    keys = peek_keys(path)
    return "best_acc1" in keys or any(k.startswith("module.") for k in keys)


def _read_timm(path: Path, *, trust_pickle: bool = False, head_width: Optional[int] = None, norm_eps: float = 1e-6,
               lambda_init: str | float = "depth", **unused):
    sd = timm_vit_to_diffmm(read_state_dict(path, trust_pickle=trust_pickle), prefix="", source=str(path))
    cfg = infer_timm_vit_config(sd, head_width=head_width, norm_eps=norm_eps, lambda_init=lambda_init,
                                source=str(path))
    return sd, cfg, "visual"


READERS = {"open_clip": _read_open_clip, "diffclip_official": _read_official, "timm_vit": _read_timm}


def read_clip_weights(path: Path, *, layout: Optional[str] = None, **kw) -> tuple[dict[str, torch.Tensor], Any, str,
                                                                                   str]:
    """``(state dict in diffmm layout, config or None, towers, layout name)`` of a local CLIP checkpoint: a diffmm
    CLIP export folder or a :data:`CLIP_LAYOUTS` file (``layout`` skips detection). ``towers`` is ``'clip'`` (both)
    or ``'visual'`` (an image tower only)."""
    path = Path(path)
    if layout is None and is_export_folder(path):
        kind, config, sd = read_export(path)
        if kind != "clip":
            raise ValueError(f"{path}: a diffmm export of kind {kind!r}, not 'clip'")
        return sd, CLIPConfig.from_dict(config, source=str(path)), "clip", "diffmm_export"
    raise_if_damaged(path)  # a damaged file names itself instead of "not recognised"
    layout = layout or clip_layout(path)
    if layout is None:
        raise ValueError(f"{path}: not a recognised CLIP checkpoint ({', '.join(CLIP_LAYOUTS)}, diffmm export)")
    sd, cfg, towers = READERS[layout](path, **kw)
    return sd, cfg, towers, layout


# ---------------------------------------------------------------------------------------------- loading
def strict_load(module: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """Load ``sd`` into ``module``: one error naming missing, unexpected and mis-shaped keys, else a strict load."""
    check_state_dict(sd, module.state_dict(), source=source)  # shapes and dtype kinds
    module.load_state_dict(sd, strict=True)


def check_attention_types(model: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """One-line error when standard-attention weights meet differential layers (or the reverse), before the strict
    load would list every lambda key as missing."""
    def differential(keys) -> bool:
        return any(k.endswith("attn.lambda_q1") for k in keys)

    model_diff, file_diff = differential(model.state_dict()), differential(sd)
    if model_diff and not file_diff:
        raise ValueError(f"{source} holds standard-attention weights, but the model has differential attention; to "
                         f"start a DiffCLIP from a standard CLIP, load the file into the standard model it came from "
                         f"(e.g. model_name OpenCLIP-Tiny / CLIP-Tiny / open_clip:NAME) and convert it with "
                         f"swap: {{init: upcycle}} (CLIPModule or diffmm.create_model(..., swap=...)), or call "
                         f"diffmm.swap_attention(model, init='upcycle')")
    if file_diff and not model_diff:
        raise ValueError(f"{source} holds differential-attention weights (lambda vectors), but the model has standard "
                         f"attention; load it into a DiffCLIP config, or pass the file itself as the model")


def load_weights_and_config(model: nn.Module, path: Path, *, trust_pickle: bool = False, **kw) -> tuple[str, Any]:
    """Load a local CLIP checkpoint into an existing ``DiffCLIP`` (strict; a timm ViT checkpoint fills only
    ``visual``); returns ``(layout name, the config the file describes or None)``."""
    sd, cfg, towers, name = read_clip_weights(path, trust_pickle=trust_pickle, need_config=False, **kw)
    target = model.visual if towers == "visual" else model
    where = f"{path} ({name}, image tower)" if towers == "visual" else f"{path} ({name})"
    check_attention_types(target, sd, where)
    strict_load(target, sd, where)
    return name, cfg


def load_clip(path: Path, *, layout: Optional[str] = None, trust_pickle: bool = False, **kw) -> nn.Module:
    """Build the model a local CLIP checkpoint describes and load it strictly: a ``DiffCLIP`` (or, for a timm ViT
    file, diffmm's ``VisionTransformer``; ``attn_backend=`` its backend). ``kw`` go to the layout's reader."""
    backend = kw.pop("attn_backend", None)
    sd, cfg, towers, name = read_clip_weights(path, layout=layout, trust_pickle=trust_pickle, **kw)
    if towers == "visual":
        model = VisionTransformer(cfg, backend)
    else:
        model = DiffCLIP(cfg if backend is None else dataclasses.replace(cfg, attn_backend=backend))
    strict_load(model, sd, f"{path} ({name})")
    return model.eval()
