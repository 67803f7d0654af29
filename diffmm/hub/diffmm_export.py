"""diffmm's own export folder: ``config.json`` + ``model.safetensors``, one folder per model.

``config.json`` looks like::

    {"diffmm_export": {"kind": "lm", "version": 1}, "config": {...}}

``kind`` is ``"lm"`` (:class:`~diffmm.models.lm.DiffLM`, ``config`` = its ``LMConfig``) or ``"clip"``
(:class:`~diffmm.models.clip.model.DiffCLIP`, ``config`` = its ``CLIPConfig``): :func:`export_kind` and
:func:`build_model` are the two places that know them. Tied (aliased) parameters are written once; missing,
unexpected or mis-shaped keys on load are one error naming them (no partial loads).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from safetensors.torch import save_file

from diffmm.hub.checkpoint import check_state_dict, load_state_file
from diffmm.models.clip.config import CLIPConfig
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.lm import DiffLM, LMConfig

MARKER = "diffmm_export"
VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
KINDS = ("lm", "clip")


def export_kind(model: nn.Module) -> str:
    """The export kind of a model (``'lm'`` or ``'clip'``)."""
    if isinstance(model, DiffLM):
        return "lm"
    if isinstance(model, DiffCLIP):
        return "clip"
    raise TypeError(f"no diffmm export kind for {type(model).__name__}; exportable: DiffLM (lm), DiffCLIP (clip)")


def build_model(kind: str, config: dict[str, Any], *, source: str = "diffmm export config") -> nn.Module:
    """A freshly built model of ``kind`` from its config dict (its weights are then loaded from the file)."""
    if kind == "lm":
        return DiffLM(LMConfig.from_dict(config, source=source))
    if kind == "clip":
        return DiffCLIP(CLIPConfig.from_dict(config, source=source))
    raise ValueError(f"{source}: unknown export kind {kind!r}; expected one of {', '.join(KINDS)}")


def unique_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``model.state_dict()`` without aliases (tied weights), and ``alias -> kept key``."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple, str] = {}
    for key, t in model.state_dict().items():
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                 t.dtype) if t.device.type != "meta" else None
        if ident is not None and t.numel() and ident in first:
            aliases[key] = first[ident]
            continue
        if ident is not None:
            first[ident] = key
        kept[key] = t
    return kept, aliases


def save_export(model: nn.Module, folder: str | os.PathLike) -> Path:
    """Write ``model`` (a ``DiffLM`` or ``DiffCLIP``) as a diffmm export folder; returns the folder."""
    kind = export_kind(model)
    sd, _ = unique_state_dict(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, str(folder / WEIGHTS),
              metadata={"format": "pt", MARKER: kind})
    with open(folder / CONFIG, "w") as f:
        json.dump({MARKER: {"kind": kind, "version": VERSION}, "config": model.config.to_dict()}, f, indent=2)
    return folder


def is_export_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder with ``config.json`` (holding the ``diffmm_export`` entry) and the weights."""
    path = Path(path)
    if not (path.is_dir() and (path / CONFIG).is_file() and (path / WEIGHTS).is_file()):
        return False
    try:
        return MARKER in json.loads((path / CONFIG).read_text())
    except (ValueError, OSError):
        return False


def read_export(path: str | os.PathLike) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """``(kind, config dict, state dict)`` of an export folder, with one-line errors for missing files, a missing
    or newer ``diffmm_export`` entry."""
    folder = Path(path)
    cfg_path, w_path = folder / CONFIG, folder / WEIGHTS
    if not cfg_path.is_file() or not w_path.is_file():
        raise FileNotFoundError(f"{folder}: a diffmm export folder needs {CONFIG} and {WEIGHTS}")
    with open(cfg_path) as f:
        meta = json.load(f)
    info = meta.get(MARKER)
    if not isinstance(info, dict) or "kind" not in info:
        raise ValueError(f"{cfg_path}: no '{MARKER}': {{'kind': ...}} entry; not a diffmm export")
    if info.get("version", VERSION) > VERSION:
        raise ValueError(f"{cfg_path}: export version {info['version']} is newer than this diffmm reads ({VERSION})")
    return info["kind"], meta.get("config", {}), load_state_file(w_path)


def load_export(path: str | os.PathLike, *, dtype: Optional[torch.dtype] = None, trust_pickle: bool = False,
                **build_overrides) -> nn.Module:
    """A diffmm export folder -> model (eval mode).

    Args:
        path: the folder.
        dtype: cast the model after loading.
        trust_pickle: accepted for ``load_pretrained`` uniformity; safetensors never needs it.
        build_overrides: merged into the stored config before building (e.g. ``attn_backend='sdpa'``).
    """
    kind, config, sd = read_export(path)
    model = build_model(kind, {**config, **build_overrides}, source=f"{Path(path) / CONFIG}")
    expected, aliases = unique_state_dict(model)
    w_path = Path(path) / WEIGHTS
    check_state_dict(sd, expected, source=str(w_path))  # shapes and dtype kinds
    result = model.load_state_dict(sd, strict=False)
    leftover = sorted(set(result.missing_keys) - set(aliases))
    if leftover or result.unexpected_keys:  # cannot happen after check_state_dict; guard against drift
        raise KeyError(f"{w_path}: missing {leftover}, unexpected {result.unexpected_keys}")
    if dtype is not None:
        model.to(dtype)
    return model.eval()
