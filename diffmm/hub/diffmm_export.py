"""diffmm's own export folder: ``config.json`` + ``model.safetensors``, one folder per model.

``config.json`` looks like::

    {"diffmm_export": {"kind": "lm", "version": 1}, "config": {...}}

``kind`` names an entry of a small registry; each kind says how to turn a model into a JSON
config and back. The LM kind is registered here; others (e.g. ``"clip"``) register themselves with
:func:`register_export_kind` from their own module (imported by ``diffmm.load_pretrained``)::

    register_export_kind("clip", CLIP, config_fn=lambda m: m.config_dict(), build_fn=CLIP.from_config_dict)

Tied (aliased) parameters are written once; missing, unexpected or mis-shaped keys on load are
one error naming them (no partial loads).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from diffmm.hub.checkpoint import check_state_dict, read_safetensors
from diffmm.hub.formats import CheckpointFormat, register_format

MARKER = "diffmm_export"
VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


@dataclass(frozen=True)
class ExportKind:
    """One exportable model family.

    Attributes:
        kind: the ``diffmm_export.kind`` string.
        model_cls: models of this class (or a subclass) export as this kind.
        config_fn: model -> JSON-serialisable config dict.
        build_fn: config dict -> freshly built model (its weights are then loaded from the file).
    """

    kind: str
    model_cls: type
    config_fn: Callable[[nn.Module], dict[str, Any]]
    build_fn: Callable[[dict[str, Any]], nn.Module]


_KINDS: dict[str, ExportKind] = {}


def register_export_kind(kind: str, model_cls: type, config_fn: Callable[[nn.Module], dict[str, Any]],
                         build_fn: Callable[[dict[str, Any]], nn.Module]) -> None:
    """Register (or replace) an export kind."""
    _KINDS[kind] = ExportKind(kind, model_cls, config_fn, build_fn)


def list_export_kinds() -> list[str]:
    return list(_KINDS)


def _kind_of(model: nn.Module) -> ExportKind:
    for entry in _KINDS.values():
        if isinstance(model, entry.model_cls):
            return entry
    raise TypeError(f"no diffmm export kind for {type(model).__name__}; registered: {', '.join(_KINDS) or 'none'}")


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


def save_export(model: nn.Module, folder: str | os.PathLike, *, kind: Optional[str] = None) -> Path:
    """Write ``model`` as a diffmm export folder; ``kind`` defaults to the registered kind of its class."""
    from safetensors.torch import save_file

    _ensure_kinds()
    entry = _KINDS[kind] if kind is not None else _kind_of(model)
    sd, _ = unique_state_dict(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, str(folder / WEIGHTS),
              metadata={"format": "pt", MARKER: entry.kind})
    with open(folder / CONFIG, "w") as f:
        json.dump({MARKER: {"kind": entry.kind, "version": VERSION}, "config": entry.config_fn(model)}, f, indent=2)
    return folder


def load_export(path: str | os.PathLike, *, dtype: Optional[torch.dtype] = None, trust_pickle: bool = False,
                **build_overrides) -> nn.Module:
    """A diffmm export folder -> model (eval mode).

    Args:
        path: the folder.
        dtype: cast the model after loading.
        trust_pickle: accepted for ``load_pretrained`` uniformity; safetensors never needs it.
        build_overrides: merged into the stored config before building (e.g. ``attn_backend='sdpa'``).
    """
    _ensure_kinds()
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
    if info["kind"] not in _KINDS:
        raise ValueError(f"{cfg_path}: unknown export kind {info['kind']!r}; registered: {', '.join(_KINDS)}")
    entry = _KINDS[info["kind"]]
    model = entry.build_fn({**meta.get("config", {}), **build_overrides})
    expected, aliases = unique_state_dict(model)
    sd = read_safetensors(w_path)
    check_state_dict(sd, expected, source=str(w_path))  # shapes and dtype kinds
    result = model.load_state_dict(sd, strict=False)
    leftover = sorted(set(result.missing_keys) - set(aliases))
    if leftover or result.unexpected_keys:  # cannot happen after check_state_dict; guard against drift
        raise KeyError(f"{w_path}: missing {leftover}, unexpected {result.unexpected_keys}")
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def _detect(path: Path) -> bool:
    cfg = path / CONFIG
    if not (path.is_dir() and cfg.is_file() and (path / WEIGHTS).is_file()):
        return False
    try:
        with open(cfg) as f:
            return MARKER in json.load(f)
    except (ValueError, OSError):
        return False


# ------------------------------------------------------------------------------------ the LM kind
def _lm_config(model) -> dict[str, Any]:
    return model.config.to_dict()


def _lm_build(config: dict[str, Any]):
    from diffmm.models.lm import DiffLM, LMConfig

    return DiffLM(LMConfig.from_dict(config, source="diffmm export config"))


def _ensure_kinds() -> None:
    """Register the built-in LM kind (lazily: ``import diffmm`` stays light) and other modules' kinds."""
    if "lm" not in _KINDS:
        from diffmm.models.lm import DiffLM

        register_export_kind("lm", DiffLM, _lm_config, _lm_build)
    from diffmm.hub.formats import _ensure_registered

    _ensure_registered()


register_format(CheckpointFormat("diffmm_export", _detect, load_export,
                                 "diffmm export folder (config.json with 'diffmm_export' + model.safetensors)"))
