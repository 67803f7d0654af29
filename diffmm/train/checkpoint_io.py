"""Checkpoint files of training runs: atomic writes, no non-finite weights, damage checks before resuming.

* :class:`AtomicCheckpointIO` writes through a hidden temporary file and ``os.replace`` (a killed run
  never leaves a half-written ``last.ckpt``), never writes a checkpoint whose weights hold NaN/Inf, and
  names the file in one line when a checkpoint cannot be read.
* :func:`resume_checkpoint` resolves ``--ckpt_path last``: the newest checkpoint that is intact, with a
  warning naming both files when the newest one is damaged.
* :func:`remove_stale_temporaries` deletes the ``.NAME.tmp-PID`` files a killed save leaves.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import zipfile
from typing import Any, Iterable, Optional

import torch
from lightning_fabric.utilities.cloud_io import _is_local_file_protocol
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.plugins.io import TorchCheckpointIO

from diffmm.hub.checkpoint import DamagedFileError, torch_file_damage
from diffmm.train.errors import ConfigError

log = logging.getLogger("diffmm.train")

#: temporary files of AtomicCheckpointIO / diffmm.hub.checkpoint.atomic_save: ``.NAME.tmp-PID``
_TMP_RE = re.compile(r"^\..+\.tmp-\d+$")


def non_finite_keys(tensors: Iterable[tuple[str, Any]], limit: int = 3) -> list[str]:
    """Names of floating-point tensors holding NaN or Inf (at most ``limit``).

    Uses each tensor's max and min (NaN propagates through both; no tensor-sized temporaries) and one
    device sync per device when everything is finite.
    """
    items = [(n, t) for n, t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    with torch.no_grad():
        for name, t in items:
            by_device.setdefault(t.device, []).append((name, torch.stack([t.amax(), t.amin()]).float()))
        bad = []
        for group in by_device.values():
            ok = torch.isfinite(torch.stack([e for _, e in group])).all(dim=1).tolist()  # one sync per device
            bad += [name for (name, _), good in zip(group, ok) if not good]
    return bad[:limit]


def _reason(e: BaseException) -> str:
    """The informative line of a torch.load error (its weights-only preamble skipped)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "WeightsUnpickler error" in ln or "PytorchStreamReader" in ln:
            return ln
    return lines[0] if lines else type(e).__name__


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a hidden temporary file in the target folder, ``fsync``, then ``os.replace``.

    The rename is atomic on POSIX file systems, so readers (and ``fit --ckpt_path last`` after a
    SIGKILL) see either the previous complete file or the new complete file. Remote paths
    (``s3://``, ...) fall back to Lightning's transactional write.

    A checkpoint whose ``state_dict`` holds NaN or Inf is not written (a warning names the step and
    the first such weights): a diverged run never replaces a good checkpoint. Reading a damaged file
    raises :class:`~diffmm.hub.checkpoint.DamagedFileError` naming it.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        path = str(path)
        bad = non_finite_keys((checkpoint.get("state_dict") or {}).items())
        if bad:
            log.warning("not writing %s: non-finite weights at step %s (%s); the previous file is kept",
                        path, checkpoint.get("global_step", "?"), ", ".join(bad))
            return
        if not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint does not take storage_options")
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        try:  # make the rename itself durable
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass

    def load_checkpoint(self, path: _PATH, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if _is_local_file_protocol(str(path)) and os.path.isfile(path):
            damage = torch_file_damage(path)
            if damage is not None:
                raise DamagedFileError(f"{path}: {damage}")
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except (RuntimeError, EOFError) as e:
            raise DamagedFileError(f"{path}: cannot read the checkpoint ({_reason(e)})") from None


def checkpoint_damage(path: str) -> Optional[str]:
    """Why a Lightning checkpoint cannot be resumed from (``None``: intact).

    Checks the zip directory and the CRC of the pickle record, then unpickles the checkpoint with
    ``weights_only=True`` and ``mmap=True``: every tensor record must exist, but no tensor data is
    read, so this costs milliseconds even for large checkpoints. A file that needs full unpickling
    is not called damaged (Lightning decides how to load it).
    """
    damage = torch_file_damage(path)
    if damage is not None or not zipfile.is_zipfile(path):  # legacy (non-zip) files: left to torch.load
        return damage
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any failure here means the file cannot be resumed from
        text = str(e)
        if "Unsupported global" in text:  # a real class reference: needs trust, not damaged
            return None
        return f"cannot be read ({_reason(e)})"
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        return "not a Lightning checkpoint (no 'state_dict')"
    return None


def candidate_checkpoints(ckpt_dir: str, root: str) -> list[str]:
    """``*.ckpt`` files of ``ckpt_dir`` and SLURM's ``root/hpc_ckpt_*.ckpt``, newest first; ``last*.ckpt``
    and ``hpc_ckpt_*`` before periodic ones written at the same time."""
    found = set(glob.glob(os.path.join(ckpt_dir, "*.ckpt"))) | set(glob.glob(os.path.join(root, "hpc_ckpt_*.ckpt")))

    def key(p: str) -> tuple[float, int]:
        name = os.path.basename(p)
        return os.path.getmtime(p), int(name.startswith(("last", "hpc_ckpt_")))

    return sorted((p for p in found if os.path.isfile(p)), key=key, reverse=True)


def newest_last(ckpt_dir: str, root: str) -> Optional[str]:
    """The newest of ``ckpt_dir/last*.ckpt`` and ``root/hpc_ckpt_*.ckpt`` (or None)."""
    found = glob.glob(os.path.join(ckpt_dir, "last*.ckpt")) + glob.glob(os.path.join(root, "hpc_ckpt_*.ckpt"))
    return max(found, key=os.path.getmtime) if found else None


def resume_checkpoint(ckpt_dir: str, root: str, move_damaged: bool = False) -> Optional[str]:
    """What ``--ckpt_path last`` resumes from: the newest ``last*.ckpt`` / ``hpc_ckpt_*.ckpt`` if intact, else
    the newest intact checkpoint of the folder (a warning names both files). ``None`` when there is none at all.

    Args:
        move_damaged: rename the damaged files newer than the one resumed from to ``NAME.damaged`` (kept for
            inspection; a damaged ``last.ckpt`` left in place would make the next save write ``last-v1.ckpt``).
            Only one process (global rank 0) should do this.

    Raises:
        ConfigError: checkpoints exist but every one is damaged (the message names each).
    """
    newest = newest_last(ckpt_dir, root)
    order = candidate_checkpoints(ckpt_dir, root)
    if newest is not None:
        order = [newest] + [p for p in order if p != newest]
    damaged: dict[str, str] = {}
    for path in order:
        why = checkpoint_damage(path)
        if why is None:
            if damaged:
                moved = _move_aside(damaged) if move_damaged else {}
                log.warning("resume: %s; resuming from %s instead, the newest intact checkpoint",
                            "; ".join(f"{p} is damaged ({w})" + (f", moved to {moved[p]}" if p in moved else "")
                                      for p, w in damaged.items()), path)
            return path
        damaged[path] = why
    if not damaged:
        return None
    listing = "; ".join(f"{p}: {why}" for p, why in damaged.items())
    raise ConfigError(f"ckpt_path last: no intact checkpoint to resume from ({listing}); "
                      f"remove them to start afresh or give --ckpt_path FILE")


def _move_aside(paths: Iterable[str]) -> dict[str, str]:
    moved = {}
    for path in paths:
        target, n = f"{path}.damaged", 1
        while os.path.exists(target):
            target, n = f"{path}.damaged-{n}", n + 1
        try:
            os.replace(path, target)
            moved[path] = target
        except OSError:  # another process moved it, or a read-only folder: leave it
            pass
    return moved


def is_global_zero_env() -> bool:
    """Whether this process is global rank 0 according to the launcher's environment (before a trainer exists)."""
    for var in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(var) is not None:
            return os.environ[var] == "0"
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def remove_stale_temporaries(folder: str) -> list[str]:
    """Delete ``.NAME.tmp-PID`` files (left by a save that was killed) in ``folder``; returns their paths.

    Call only while no save of this run can be in progress (before training starts).
    """
    removed = []
    if not folder or not os.path.isdir(folder):
        return removed
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if _TMP_RE.match(name) and os.path.isfile(path):
            try:
                os.remove(path)
                removed.append(path)
            except OSError as e:
                log.warning("could not remove the stale temporary %s: %s", path, e)
    if removed:
        log.info("removed %d temporary file(s) of an interrupted checkpoint save: %s", len(removed),
                 ", ".join(os.path.basename(p) for p in removed))
    return removed


def check_resume_file(path: str, key: str = "ckpt_path") -> None:
    """One-line :class:`ConfigError` when an explicitly given local checkpoint is damaged (no fallback)."""
    if not os.path.isfile(path):
        return
    damage = checkpoint_damage(path)
    if damage is not None:
        raise ConfigError(f"{key}: {path} is damaged ({damage}); give an intact checkpoint, or --ckpt_path last "
                          f"to resume from the newest intact one")
