"""``open_clip:NAME``: open_clip architectures through ``diffmm.create_model``.

An architecture diffmm implements (a plain ViT image tower and text Transformer: open_clip's ``ViT-*`` CLIPs) is
built as diffmm's ``DiffCLIP`` in open_clip's layout (``from_open_clip_config``): open_clip's weights load into it
exactly, it exports, and :func:`diffmm.swap_attention` records its swaps in the config. Other architectures (timm
or HF towers, SigLIP, CoCa, ...) are built by open_clip itself (``open_clip.create_model``) and keep open_clip's
preprocessing and tokenizer; ``swap_attention`` still works on those it supports.

``pretrained`` is a local file in any format diffmm reads, or an open_clip hub tag (downloaded by open_clip,
which needs the network).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch.nn as nn

from diffmm.models.clip.naming import OPEN_CLIP_PREFIX, UnknownModelError

log = logging.getLogger("diffmm.models")


def _resolve_pretrained(name: str, pretrained: Optional[str]) -> tuple[Optional[str], dict]:
    """A local path for ``pretrained`` and open_clip's pretrained config of a tag (mean/std), or ``{}``."""
    if not pretrained or os.path.exists(pretrained) or pretrained.startswith(("local-dir:", "hf-hub:")):
        return pretrained, {}
    import open_clip

    cfg = open_clip.get_pretrained_cfg(name, pretrained)
    if not cfg:
        tags = open_clip.list_pretrained_tags_by_model(name)
        raise FileNotFoundError(f"pretrained {pretrained!r}: no such file, and not an open_clip tag of {name} "
                                f"(its tags: {', '.join(tags) or 'none'})")
    try:
        path = open_clip.download_pretrained(cfg)
    except Exception as e:  # network errors come in many types
        raise ConnectionError(f"open_clip:{name} pretrained={pretrained!r}: open_clip could not fetch the weights "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); download them "
                              f"elsewhere and pass the file") from None
    if not path:
        raise ConnectionError(f"open_clip:{name} pretrained={pretrained!r}: open_clip found no download for this tag")
    return path, cfg


def create_open_clip(model_name: str, pretrained: Optional[str] = None, *, trust_pickle: bool = False,
                     overrides: Optional[dict[str, Any]] = None) -> nn.Module:
    """The model of ``open_clip:NAME`` (see the module docstring) with ``pretrained`` loaded strictly."""
    import open_clip

    from diffmm.models.clip.config import from_open_clip_config
    from diffmm.models.clip.factory import load_pretrained_into
    from diffmm.models.clip.model import DiffCLIP

    name = model_name[len(OPEN_CLIP_PREFIX):] if model_name.startswith(OPEN_CLIP_PREFIX) else model_name
    oc_cfg = open_clip.get_model_config(name)
    if oc_cfg is None:
        raise UnknownModelError(f"open_clip:{name}: open_clip has no such architecture (see open_clip.list_models())")
    path, tag_cfg = _resolve_pretrained(name, pretrained)
    try:
        cfg = from_open_clip_config(oc_cfg, source=f"open_clip:{name}")
    except ValueError as e:
        log.info("open_clip:%s is built by open_clip (%s)", name, e)
        return _native(name, path, trust_pickle=trust_pickle, overrides=overrides, tag_cfg=tag_cfg)
    if tag_cfg.get("mean") is not None:
        cfg.vision_cfg.image_mean, cfg.vision_cfg.image_std = tuple(tag_cfg["mean"]), tuple(tag_cfg["std"])
    if overrides:
        cfg = cfg.replace(**overrides)
    model = DiffCLIP(cfg)
    if path:
        load_pretrained_into(model, path, trust_pickle=trust_pickle)
    model.diffmm_open_clip_name = name
    return model


def _native(name: str, path: Optional[str], *, trust_pickle: bool, overrides: Optional[dict],
            tag_cfg: dict) -> nn.Module:
    """open_clip's own model of ``name`` with the weights of ``path`` (strict)."""
    import open_clip

    from diffmm.hub.checkpoint import check_state_dict
    from diffmm.hub.clip_formats import read_state_dict

    if overrides:
        raise ValueError(f"open_clip:{name} is built by open_clip (diffmm does not implement its towers); config "
                         f"overrides ({', '.join(overrides)}) apply only to diffmm's CLIP models")
    pp = {k: tag_cfg[k] for k in ("mean", "std", "interpolation", "resize_mode") if tag_cfg.get(k) is not None}
    model = open_clip.create_model(name, force_preprocess_cfg=pp or None)
    if path:
        sd = read_state_dict(path, trust_pickle=trust_pickle)
        check_state_dict(sd, model.state_dict(), source=f"{path} (open_clip:{name})")
        model.load_state_dict(sd, strict=True)
    model.diffmm_open_clip_name = name
    return model


def open_clip_tokenizer(model_name: str, context_length: Optional[int] = None):
    """The tokenizer of ``open_clip:NAME`` without building the model (diffmm's CLIP BPE for the architectures diffmm
    builds, open_clip's own for the others)."""
    import open_clip

    from diffmm.models.clip.config import from_open_clip_config
    from diffmm.models.clip.tokenizer import CLIPTokenizer

    name = model_name[len(OPEN_CLIP_PREFIX):] if model_name.startswith(OPEN_CLIP_PREFIX) else model_name
    oc_cfg = open_clip.get_model_config(name)
    if oc_cfg is None:
        raise UnknownModelError(f"open_clip:{name}: open_clip has no such architecture (see open_clip.list_models())")
    try:
        cfg = from_open_clip_config(oc_cfg, source=f"open_clip:{name}")
    except ValueError:
        return open_clip.get_tokenizer(name, context_length=context_length)
    return CLIPTokenizer(context_length or cfg.text_cfg.context_length, cfg.text_cfg.truncate)
