"""``diffmm.load_pretrained``: one loader for every supported checkpoint format.

Each format registers a ``detect(path) -> bool`` (by its files and keys) and a
``load(path, **kwargs) -> nn.Module``. Formats are tried in registration order; the first whose
detector matches loads the model. Detectors must be cheap (read file names / config keys).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.nn as nn


@dataclass(frozen=True)
class CheckpointFormat:
    name: str
    detect: Callable[[Path], bool]
    load: Callable[..., nn.Module]
    description: str = ""


_FORMATS: dict[str, CheckpointFormat] = {}


def register_format(fmt: CheckpointFormat) -> None:
    """Add a checkpoint format (later registrations with the same name replace earlier ones)."""
    _FORMATS[fmt.name] = fmt


def list_formats() -> list[str]:
    return list(_FORMATS)


def _ensure_registered() -> None:
    # Import the modules that register formats. Each is optional so a missing extra does not break the rest.
    import importlib

    for mod in ("diffmm.hub.lightning_ckpt", "diffmm.hub.difflama", "diffmm.hub.diffmm_export",
                "diffmm.hub.clip_formats"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def load_pretrained(path: str | os.PathLike, *, format: str | None = None, **kwargs) -> nn.Module:
    """Build a diffmm model from local files, recognising the format by its files and keys.

    Args:
        path: a file or folder (or ``hf-hub:`` / ``local-dir:`` name where a format supports it).
        format: skip detection and use this format.
        kwargs: passed to the format's loader (e.g. ``trust_pickle=True``, ``model_name=...``).
    """
    _ensure_registered()
    if format is not None:
        if format not in _FORMATS:
            raise ValueError(f"unknown checkpoint format {format!r}; expected one of {', '.join(_FORMATS)}")
        return _FORMATS[format].load(path, **kwargs)
    p = Path(str(path))
    if not str(path).startswith(("hf-hub:", "local-dir:")) and not p.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    from diffmm.hub.checkpoint import raise_if_damaged

    raise_if_damaged(p)  # a damaged file names itself instead of "not recognised"
    for fmt in _FORMATS.values():
        if fmt.detect(p):
            return fmt.load(path, **kwargs)
    raise ValueError(f"{path}: not a recognised checkpoint; supported formats: {', '.join(_FORMATS)}")
