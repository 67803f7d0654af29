"""diffmm's own export folder: ``config.json`` + ``model.safetensors`` (+ tokenizer files and a model card), one
folder per model. It is the folder of ``DiffLM`` / ``DiffCLIP``'s ``save_pretrained`` (the format is defined beside
the models, :mod:`diffmm.models.hub_mixin`): :func:`save_export` calls it and :func:`load_export` calls their
``from_pretrained``, so ``diffmm export``, ``save_pretrained``, ``from_pretrained`` and ``diffmm.load_pretrained``
all write and read the same files.

``config.json`` looks like::

    {"diffmm_export": {"kind": "lm", "version": 1}, "model_type": "diffmm_lm (...)", "architectures": ["DiffLM"],
     "config": {...}}

``kind`` is ``"lm"`` (:class:`~diffmm.models.lm.DiffLM`, ``config`` = its ``LMConfig``) or ``"clip"``
(:class:`~diffmm.models.clip.model.DiffCLIP`, ``config`` = its ``CLIPConfig``). Tied (aliased) parameters are
written once; missing, unexpected or mis-shaped keys on load are one error naming them (no partial loads).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from diffmm.models.clip.model import DiffCLIP
from diffmm.models.hub_mixin import (CONFIG, KINDS, MARKER, VERSION, WEIGHTS, is_export_folder,  # noqa: F401
                                     read_export, read_export_config, unique_state_dict)
from diffmm.models.lm import DiffLM

#: export kind -> model class
MODEL_CLASSES = {"lm": DiffLM, "clip": DiffCLIP}


def export_kind(model: nn.Module) -> str:
    """The export kind of a model (``'lm'`` or ``'clip'``)."""
    for kind, cls in MODEL_CLASSES.items():
        if isinstance(model, cls):
            return kind
    raise TypeError(f"no diffmm export kind for {type(model).__name__}; exportable: DiffLM (lm), DiffCLIP (clip)")


def save_export(model: nn.Module, folder: str | os.PathLike, *, tokenizer: Any = None) -> Path:
    """Write ``model`` (a ``DiffLM`` or ``DiffCLIP``) as a diffmm export folder (its ``save_pretrained``); returns
    the folder. ``tokenizer``: see the model's ``save_pretrained`` (a ``DiffCLIP`` writes its own by default)."""
    export_kind(model)
    model.save_pretrained(folder, tokenizer=tokenizer)
    return Path(folder)


def load_export(path: str | os.PathLike, *, dtype: Optional[torch.dtype] = None, trust_pickle: bool = False,
                **build_overrides) -> nn.Module:
    """A diffmm export folder -> model (eval mode), by the ``from_pretrained`` of the class its kind names.

    Args:
        path: the folder.
        dtype: cast the model after loading.
        trust_pickle: accepted for ``load_pretrained`` uniformity; safetensors never needs it.
        build_overrides: merged into the stored config before building (e.g. ``attn_backend='sdpa'``).
    """
    kind, _ = read_export_config(path)
    return MODEL_CLASSES[kind].from_pretrained(str(path), dtype=dtype, **build_overrides)
