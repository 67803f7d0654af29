"""Weights checks shared by the models' ``from_pretrained`` and :mod:`diffmm.hub`: a damaged ``.safetensors`` file
names itself (:func:`safetensors_damage`, :class:`DamagedFileError`), and :func:`load_strict`, the one strict loader,
checks a state dict against a model in one error before loading it."""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn
from safetensors import safe_open


class DamagedFileError(ValueError):
    """A weights or checkpoint file that cannot be read (empty, truncated, corrupt); the message names the file."""


def safetensors_damage(path: str | os.PathLike) -> Optional[str]:
    """Why a ``.safetensors`` file is unreadable (``None``: its header and size agree), without reading tensors."""
    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
    except Exception as e:  # SafetensorError (a plain Exception subclass), OSError
        if type(e).__name__ != "SafetensorError" and not isinstance(e, (OSError, ValueError)):
            raise
        size = os.path.getsize(path) if os.path.exists(path) else 0
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"not a readable safetensors file ({size} bytes; {reason}); the file is truncated or corrupt"
    return None


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_floating_point:
        return "float"
    return "complex" if dtype.is_complex else "integer"


def check_state_dict(state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, Any], *,
                     source: str, limit: int = 8) -> None:
    """Raise one ``KeyError`` naming missing, unexpected, mis-shaped and wrong-dtype keys (no partial loads).

    Args:
        state_dict: the tensors to load.
        expected: key -> the model's tensor (shape and dtype kind checked) or its shape (shape only). A float
            parameter never takes an integer or bool tensor (``load_state_dict`` would cast it silently); float
            widths may differ (fp16/bf16 files load into fp32 models).
        source: what the error names (the file).
    """
    def shape_of(v: Any) -> tuple:
        return tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v)

    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    shaped = [f"{k} {tuple(state_dict[k].shape)} != {shape_of(expected[k])}" for k in expected
              if k in state_dict and tuple(state_dict[k].shape) != shape_of(expected[k])]
    typed = [f"{k} is {str(state_dict[k].dtype).replace('torch.', '')}, expected {_kind(v.dtype)} "
             f"({str(v.dtype).replace('torch.', '')})" for k, v in expected.items()
             if isinstance(v, torch.Tensor) and isinstance(state_dict.get(k), torch.Tensor)
             and _kind(state_dict[k].dtype) != _kind(v.dtype)]
    parts = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped", shaped),
                         ("wrong dtype", typed)):
        if items:
            more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
            parts.append(f"{label}: {', '.join(items[:limit])}{more}")
    if parts:
        raise KeyError(f"{source}: " + "; ".join(parts))


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


def load_strict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, source: str) -> nn.Module:
    """Load ``state_dict`` into ``model`` after :func:`check_state_dict` (one error naming every missing,
    unexpected, mis-shaped or wrong-dtype key); tied (aliased) weights may be given once or under every name."""
    expected, aliases = unique_state_dict(model)
    given = {k: v for k, v in state_dict.items() if not (k in aliases and aliases[k] in state_dict)}
    check_state_dict(given, expected, source=source)
    model.load_state_dict(given, strict=False)  # every key checked above; only the aliases are left out
    return model
