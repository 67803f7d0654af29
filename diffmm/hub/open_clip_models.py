"""open_clip architectures by name (``open_clip:NAME`` of :mod:`diffmm.hub.factory`, which owns the prefix).

An architecture diffmm implements (plain ViT or diffmm timm image tower, text Transformer) is built as diffmm's
``DiffCLIP`` in open_clip's layout (:func:`diffclip_config`); others (other timm or HF towers, SigLIP, CoCa, ...) are
built by open_clip itself (:func:`create_native`) with open_clip's preprocessing and tokenizer. open_clip is imported
inside these functions, so ``import diffmm`` works without it.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch.nn as nn

from diffmm.hub.checkpoint import read_state_dict
from diffmm.hub.clip_convert import from_open_clip_config
from diffmm.models.clip.config import CLIPConfig, UnknownModelError
from diffmm.models.weights import load_strict

log = logging.getLogger("diffmm.hub")


def open_clip_config(name: str) -> dict:
    """open_clip's model config of the architecture ``name`` (``open_clip.get_model_config``)."""
    import open_clip

    oc_cfg = open_clip.get_model_config(name)
    if oc_cfg is None:
        raise UnknownModelError(f"open_clip:{name}: open_clip has no such architecture (see open_clip.list_models())")
    return oc_cfg


def diffclip_config(name: str) -> Optional[CLIPConfig]:
    """diffmm's config of the open_clip architecture ``name`` (open_clip's layout, standard attention), or None when
    diffmm does not implement its towers (open_clip then builds it)."""
    try:
        return from_open_clip_config(open_clip_config(name), source=f"open_clip:{name}")
    except UnknownModelError:
        raise
    except ValueError as e:
        log.info("open_clip:%s is built by open_clip (%s)", name, e)
        return None


def download_tag(name: str, tag: str) -> tuple[str, dict]:
    """``(local file, open_clip's pretrained config)`` of an open_clip hub tag of ``name`` (open_clip downloads it,
    which needs the network); the config names the tag's mean/std."""
    import open_clip

    open_clip_config(name)
    cfg = open_clip.get_pretrained_cfg(name, tag)
    if not cfg:
        tags = open_clip.list_pretrained_tags_by_model(name)
        raise FileNotFoundError(f"pretrained {tag!r}: no such file, and not an open_clip tag of {name} "
                                f"(its tags: {', '.join(tags) or 'none'})")
    try:
        path = open_clip.download_pretrained(cfg)
    except Exception as e:  # network errors come in many types
        raise ConnectionError(f"open_clip:{name} pretrained={tag!r}: open_clip could not fetch the weights "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); download them "
                              f"elsewhere and pass the file") from None
    if not path:
        raise ConnectionError(f"open_clip:{name} pretrained={tag!r}: open_clip found no download for this tag")
    return path, cfg


def create_native(name: str, path: Optional[str], *, trust_pickle: bool = False,
                  overrides: Optional[dict[str, Any]] = None, tag_cfg: Optional[dict] = None,
                  precision: str = "fp32") -> nn.Module:
    """open_clip's own model of ``name`` in open_clip's ``precision`` with the weights of the local file ``path``
    (strict)."""
    import open_clip

    if overrides:
        raise ValueError(f"open_clip:{name} is built by open_clip (diffmm does not implement its towers); config "
                         f"overrides ({', '.join(overrides)}) apply only to diffmm's CLIP models")
    tag_cfg = tag_cfg or {}
    pp = {k: tag_cfg[k] for k in ("mean", "std", "interpolation", "resize_mode") if tag_cfg.get(k) is not None}
    model = open_clip.create_model(name, precision=precision, force_preprocess_cfg=pp or None)
    if path:
        load_strict(model, read_state_dict(path, trust_pickle=trust_pickle), source=f"{path} (open_clip:{name})")
    model.diffmm_open_clip_name = name  # tokenizer_for(model) gives open_clip's tokenizer of this name
    return model
