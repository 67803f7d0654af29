"""Reading checkpoint files safely: ``torch.load(weights_only=True)`` unless the caller trusts the pickle."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

TRUST_HINT = "pass trust_pickle=True (CLI: --trust-pickle) only if you trust where this file came from"


def load_state_file(path: str | os.PathLike, *, trust_pickle: bool = False, map_location: str = "cpu") -> Any:
    """Load a ``.safetensors`` file or a torch checkpoint.

    Torch checkpoints load with ``weights_only=True``; a file that needs arbitrary pickle (e.g. the
    official DiffCLIP ``checkpoint_best.pt``, which holds an ``argparse.Namespace``) is refused with
    a one-line message saying how to trust it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device=map_location)
    try:
        return torch.load(path, map_location=map_location, weights_only=not trust_pickle)
    except Exception as e:  # weights_only refusal surfaces as UnpicklingError / RuntimeError
        if not trust_pickle and ("weights_only" in str(e) or "Unsupported global" in str(e)):
            raise PermissionError(f"{path}: refusing to unpickle non-tensor objects; {TRUST_HINT}") from None
        raise


def strip_prefix(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Remove ``prefix`` from every key that has it (e.g. DDP's ``module.``)."""
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}


def check_state_dict(state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size | tuple], *,
                     source: str, limit: int = 8) -> None:
    """Raise one error naming missing, unexpected and mis-shaped keys (no partial loads)."""
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    shaped = [f"{k} {tuple(state_dict[k].shape)} != {tuple(expected[k])}" for k in expected
              if k in state_dict and tuple(state_dict[k].shape) != tuple(expected[k])]
    parts = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped", shaped)):
        if items:
            more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
            parts.append(f"{label}: {', '.join(items[:limit])}{more}")
    if parts:
        raise KeyError(f"{source}: " + "; ".join(parts))


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)
