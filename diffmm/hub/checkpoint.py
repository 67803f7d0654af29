"""Reading checkpoint files safely: ``torch.load(weights_only=True)`` (plain data and ``pathlib`` paths) unless the
caller trusts the pickle. Damaged files (empty, truncated, garbage, failed CRC) are refused with one line naming
the file; :func:`peek_keys` reads a file's keys without unpickling anything (how formats are told apart).
"""
from __future__ import annotations

import os
import pathlib
import pickletools
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffmm.models.weights import DamagedFileError, safetensors_damage

#: classes besides tensors and plain containers a checkpoint may hold (Lightning's hyper-parameter paths)
SAFE_GLOBALS = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)
TRUST_HINT = "pass trust_pickle=True (CLI: --trust_pickle true) only if you trust where this file came from"


def torch_file_damage(path: str | os.PathLike) -> Optional[str]:
    """Why a torch checkpoint file is unreadable (``None``: it looks intact), checked without unpickling.

    Reads the zip directory and the pickle record (``data.pkl``, CRC-checked); tensor data is not read.
    Legacy (non-zip) ``torch.save`` files are not judged.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size == 0:
            return "empty file"
        if not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                if f.read(1) == b"\x80":  # a pickle: torch's legacy (pre-1.6) format
                    return None
            return f"truncated or not a checkpoint ({size} bytes, no zip directory at the end)"
        with zipfile.ZipFile(path) as z:
            pkl = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            if pkl is None:
                return "a zip archive without data.pkl: not a torch checkpoint"
            z.read(pkl)  # checks the record's CRC
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        return f"corrupt ({e})"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return None


#: suffixes of torch checkpoint files (zip archives written by ``torch.save``)
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def raise_if_damaged(path: str | os.PathLike, *, any_suffix: bool = False) -> None:
    """Raise :class:`DamagedFileError` naming ``path`` when a ``.safetensors`` or torch file (any file but
    ``.safetensors`` with ``any_suffix``) is unreadable. Cheap: reads headers and the pickle record, never the
    tensors."""
    p = Path(path)
    if p.is_file() and (p.suffix in (".safetensors", *TORCH_SUFFIXES) or any_suffix):
        damage = safetensors_damage(p) if p.suffix == ".safetensors" else torch_file_damage(p)
        if damage is not None:
            raise DamagedFileError(f"{p}: {damage}")


def load_state_file(path: str | os.PathLike, *, trust_pickle: bool = False, map_location: str = "cpu") -> Any:
    """Load a ``.safetensors`` file or a torch checkpoint.

    Torch checkpoints load with ``weights_only=True``; a file that needs arbitrary pickle (e.g. the
    official DiffCLIP ``checkpoint_best.pt``, which holds an ``argparse.Namespace``) is refused with
    a one-line message saying how to trust it. Damaged files raise :class:`DamagedFileError` naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    raise_if_damaged(path, any_suffix=True)
    if path.suffix == ".safetensors":
        return load_file(str(path), device=map_location)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):  # zip files memory-mapped: tensors stay on disk
            return torch.load(path, map_location=map_location, weights_only=not trust_pickle,
                              mmap=zipfile.is_zipfile(path))
    except Exception as e:  # weights_only refusal surfaces as UnpicklingError / RuntimeError
        if not trust_pickle and ("weights_only" in str(e) or "Unsupported global" in str(e)):
            raise PermissionError(f"{path}: refusing to unpickle non-tensor objects; {TRUST_HINT}") from None
        if isinstance(e, (RuntimeError, EOFError)):  # torch's reader on a damaged record
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DamagedFileError(f"{path}: cannot read the checkpoint ({first})") from None
        raise


def peek_keys(path: str | os.PathLike, limit: int = 200_000) -> set[str]:
    """Strings naming tensors in a checkpoint, read without unpickling anything (cheap, safe detection).

    safetensors: the header's keys. torch zip files: the string constants of ``data.pkl`` (keys, and names
    like ``state_dict``), read with ``pickletools`` (nothing is executed). Other files: empty.
    """
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            if safetensors_damage(path) is not None:
                return set()  # damaged: the loader names the file
            with safe_open(str(path), "pt") as f:
                return set(f.keys())
        if not zipfile.is_zipfile(path):
            return set()
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            if name is None:
                return set()
            data = z.read(name)
        out: set[str] = set()
        for op, arg, _ in pickletools.genops(data):
            if isinstance(arg, str) and "UNICODE" in op.name:
                out.add(arg)
                if len(out) >= limit:
                    break
        return out
    except (OSError, ValueError, RuntimeError, zipfile.BadZipFile):
        return set()


def read_state_dict(path: str | os.PathLike, *, trust_pickle: bool = False, obj: Any = None) -> dict[str, torch.Tensor]:
    """A checkpoint file's state dict (``obj``: the file as already loaded), unwrapped from ``{'state_dict': ...}`` /
    ``{'model': ...}`` / ``{'module': ...}``, DDP's ``module.`` prefix stripped."""
    obj = load_state_file(path, trust_pickle=trust_pickle) if obj is None else obj
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path}: expected a state dict of tensors (or a checkpoint with 'state_dict')")
    return {k.removeprefix("module."): v for k, v in obj.items()}

