"""Checkpoint files of training runs: atomic writes, no non-finite training state, damage checks before resuming.

* :class:`AtomicCheckpointIO` writes through a hidden temporary file and ``os.replace`` (a killed run never leaves
  a half-written ``last.ckpt``), writes no checkpoint whose weights or optimizer state hold NaN/Inf (and deletes no
  older one meanwhile), and names the file in one line when a checkpoint cannot be read.
* :func:`resume_checkpoint` resolves ``--ckpt_path last``: the newest checkpoint that is intact, with a warning
  naming both files when the newest one is damaged.
* :func:`remove_stale_temporaries` deletes the ``.NAME.tmp-PID`` files a killed save leaves (only when process PID
  is gone); :class:`RunLock` makes a run the only one writing its folder while it lives.
* A file that weights-only loading refuses (it would call a function such as ``os.system`` while unpickling) is
  *refused as unsafe*, not called damaged; ``--weights_only false`` trusts it. A save that fills the disk is one
  line naming the folder, the free space and the newest intact checkpoint.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import importlib
import logging
import os
import pickle
import re
import shutil
import socket
import zipfile
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from fsspec.utils import get_protocol
from pytorch_lightning.plugins.io import TorchCheckpointIO

from diffmm.hub.checkpoint import DamagedFileError, torch_file_damage
from diffmm.train.errors import CheckpointSaveError, ConfigError

log = logging.getLogger("diffmm.train")

#: temporary files of AtomicCheckpointIO / atomic_save: ``.NAME.tmp-PID``
_TMP_RE = re.compile(r"^\..+\.tmp-(\d+)$")
#: how :func:`checkpoint_damage` and the loaders word a file that weights-only loading refuses
UNSAFE = "refused as unsafe to unpickle"
#: what trusts such a file (LightningCLI's ``weights_only`` argument of fit/validate/test/predict)
TRUST_FLAG = "--weights_only false"
#: the lock file of a run's folders (:class:`RunLock`)
LOCK_NAME = ".diffmm-run.lock"


def unsafe_reason(e: BaseException) -> Optional[str]:
    """``"refused as unsafe to unpickle (...)"`` when ``e`` is weights-only loading refusing a pickle, else None."""
    text = str(e)
    if not isinstance(e, pickle.UnpicklingError) or "Weights only load failed" not in text:
        return None
    found = re.search(r"GLOBAL ([\w.]+)", text)
    what = (f"it calls {found.group(1)}" if found else "it is a pickle that is not torch.save's format")
    return f"{UNSAFE} ({what}, which weights-only loading refuses: unpickling it could run code)"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def non_finite_keys(tensors: Iterable[tuple[str, Any]], limit: int = 3) -> list[str]:
    """Names of floating-point tensors holding NaN or Inf (at most ``limit``).

    Checks each tensor's max and min (NaN propagates through both; no tensor-sized temporaries). One sync per
    tensor, as ``torch.save`` of the same tensors costs anyway.
    """
    bad = []
    with torch.no_grad():
        for name, t in tensors:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                if not torch.isfinite(torch.stack([t.amax(), t.amin()])).all():
                    bad.append(name)
    return bad[:limit]


def _training_state(checkpoint: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """``(name, tensor)`` of a Lightning checkpoint's weights, then of its optimizers' state."""
    yield from (checkpoint.get("state_dict") or {}).items()
    for i, opt in enumerate(checkpoint.get("optimizer_states") or []):
        for state in (opt.get("state") or {}).values():
            yield from ((f"optimizer {i} {k}", v) for k, v in state.items())


def _reason(e: BaseException) -> str:
    """The informative line of a torch.load error (its weights-only preamble skipped)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "WeightsUnpickler error" in ln or "PytorchStreamReader" in ln:
            return ln
    return lines[0] if lines else type(e).__name__


def atomic_save(obj: Any, path: Union[str, os.PathLike]) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename over ``path`` (no temporary left on
    errors)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a hidden temporary file in the target folder, ``fsync``, then ``os.replace``.

    The rename is atomic on POSIX file systems, so readers (and ``fit --ckpt_path last`` after a SIGKILL) see either
    the previous complete file or the new complete file. Remote paths (``s3://``, ...) use Lightning's write.

    No checkpoint is written while its weights or optimizer state hold NaN or Inf (a warning names the step and the
    first such tensors), and until the next checkpoint is written no file is removed (``ModelCheckpoint`` deletes
    older checkpoints to make room): a diverged run never replaces a good checkpoint. Every save of the trainer goes
    through here (periodic, best, last, ``hpc_ckpt_*``, ``trainer.save_checkpoint``). Reading a damaged file raises
    :class:`~diffmm.hub.checkpoint.DamagedFileError` naming it.

    Attributes:
        last_saved: ``(path, global step)`` of the newest checkpoint this process wrote, or None.
    """

    def __init__(self) -> None:
        super().__init__()
        self.last_saved: Optional[tuple[str, Optional[int]]] = None
        self._refused_step: Optional[int] = None  # step of the last refused save: keep every file meanwhile

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Union[str, os.PathLike],
                        storage_options: Optional[Any] = None) -> None:
        path, step = str(path), checkpoint.get("global_step")
        bad = non_finite_keys(_training_state(checkpoint))
        if bad:
            if self._refused_step != step:  # one warning per step (ModelCheckpoint saves 2 files per step)
                what = "optimizer state is" if bad[0].startswith("optimizer") else "weights are"
                log.warning("step %s: not saving checkpoints, the %s non-finite (%s); the previous checkpoints are "
                            "kept", step, what, ", ".join(bad))
            self._refused_step = step
            return
        self._refused_step = None
        if get_protocol(path) != "file":
            super().save_checkpoint(checkpoint, path, storage_options)
            self.last_saved = (path, step)
            return
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:
            full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or shutil.disk_usage(folder).free < 2**20
            written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if not full:
                raise
            raise CheckpointSaveError(self._disk_full(path, folder, written)) from None
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        fd = os.open(folder, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.last_saved = (path, step)

    def _disk_full(self, path: str, folder: str, written: int) -> str:
        """The one line of a save that filled the disk: the folder, its free space, the newest intact checkpoint."""
        free = shutil.disk_usage(folder).free
        newest = self.last_saved[0] if self.last_saved and os.path.exists(self.last_saved[0]) else None
        if newest is None:
            newest = next((p for p in candidate_checkpoints(folder, folder) if checkpoint_damage(p) is None), None)
        return (f"disk full: cannot save {os.path.basename(path)} in {folder} ({free / 2**20:.1f} MiB free after "
                f"removing the partial file of {written / 2**20:.1f} MiB); nothing was overwritten, the newest intact "
                f"checkpoint is {newest or 'none'}: free space, then resume with --ckpt_path last")

    def remove_checkpoint(self, path: Union[str, os.PathLike]) -> None:
        if self._refused_step is None:
            super().remove_checkpoint(path)

    def load_checkpoint(self, path: Union[str, os.PathLike], map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if get_protocol(str(path)) == "file" and os.path.isfile(path):
            damage = torch_file_damage(path)
            if damage is not None:
                raise DamagedFileError(f"{path}: {damage}")
        try:
            return super().load_checkpoint(path, map_location=map_location,
                                           weights_only=True if weights_only is None else weights_only)
        except pickle.UnpicklingError as e:
            why = unsafe_reason(e)
            if why is None:
                raise DamagedFileError(f"{path}: cannot read the checkpoint ({_reason(e)})") from None
            raise ConfigError(f"ckpt_path: {path} is {why}; if you trust the file, pass {TRUST_FLAG}") from None
        except (RuntimeError, EOFError) as e:
            raise DamagedFileError(f"{path}: cannot read the checkpoint ({_reason(e)})") from None


def checkpoint_damage(path: str, trust: bool = False) -> Optional[str]:
    """Why a Lightning checkpoint cannot be resumed from (``None``: intact); a file weights-only loading refuses
    gets ``"refused as unsafe to unpickle (...)"`` (:data:`UNSAFE`) unless ``trust``.

    Checks the zip directory and the CRC of the pickle record, then unpickles the checkpoint with
    ``weights_only=True`` and ``mmap=True``: every tensor record must exist, but no tensor data is
    read, so this costs milliseconds even for large checkpoints (legacy non-zip files are read whole).
    A trusted file is registered with ``torch.serialization.add_safe_globals`` (zip files: every load of this
    process then accepts the globals it names); a trusted legacy pickle is left to ``torch.load``.
    """
    damage = torch_file_damage(path)
    if damage is not None:
        return damage
    is_zip = zipfile.is_zipfile(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except Exception as e:  # noqa: BLE001 - any failure here means the file cannot be resumed from
        unsafe = unsafe_reason(e)
        if unsafe is None:
            return f"cannot be read ({_reason(e)})"
        if not trust:
            return unsafe
        if is_zip:  # the user trusts the file: allow the functions and classes it names
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            torch.serialization.add_safe_globals([getattr(importlib.import_module(n.rpartition(".")[0]),
                                                          n.rpartition(".")[2]) for n in names])
        return None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        return "not a Lightning checkpoint (no 'state_dict')"
    return None


def candidate_checkpoints(ckpt_dir: str, root: str) -> list[str]:
    """``*.ckpt`` files of ``ckpt_dir`` and SLURM's ``root/hpc_ckpt_*.ckpt``, newest first; ``last*.ckpt`` and
    ``hpc_ckpt_*`` before periodic ones written at the same time."""
    found = set(glob.glob(os.path.join(ckpt_dir, "*.ckpt"))) | set(glob.glob(os.path.join(root, "hpc_ckpt_*.ckpt")))

    def key(p: str) -> tuple[float, bool, int]:  # written in the same clock tick: the higher step first
        step = re.search(r"step=(\d+)", os.path.basename(p))
        return os.path.getmtime(p), os.path.basename(p).startswith(("last", "hpc_ckpt_")), int(step[1]) if step else -1

    return sorted((p for p in found if os.path.isfile(p)), key=key, reverse=True)


def resume_checkpoint(ckpt_dir: str, root: str, move_damaged: bool = False, trust: bool = False) -> Optional[str]:
    """What ``--ckpt_path last`` resumes from: the newest checkpoint of :func:`candidate_checkpoints` that is
    intact (a warning names the damaged newer ones). ``None`` when there is none at all.

    A job requeued after SLURM's pre-emption signal (which writes an ``hpc_ckpt``) and a job restarted after a crash
    resume from whichever is more recent.

    Args:
        move_damaged: rename the damaged files newer than the one resumed from to ``NAME.damaged`` (kept for
            inspection; a damaged ``last.ckpt`` left in place would make the next save write ``last-v1.ckpt``).
            Only one process (global rank 0) should do this. Files refused as unsafe are skipped, never moved.
        trust: accept files that weights-only loading refuses (:func:`checkpoint_damage`).

    Raises:
        ConfigError: checkpoints exist but every one is damaged (the message names each).
    """
    damaged: dict[str, str] = {}
    for path in candidate_checkpoints(ckpt_dir, root):
        why = checkpoint_damage(path, trust)
        if why is not None:
            damaged[path] = why
            continue
        if damaged:
            moved = {p: _move_aside(p) for p, w in damaged.items() if not w.startswith(UNSAFE)} if move_damaged else {}
            log.warning("resume: %s; resuming from %s instead, the newest intact checkpoint", "; ".join(
                (f"{p} is {w} (pass {TRUST_FLAG} to trust it)" if w.startswith(UNSAFE) else f"{p} is damaged ({w})")
                + (f", moved to {moved[p]}" if moved.get(p) else "") for p, w in damaged.items()), path)
        return path
    if damaged:
        listing = "; ".join(f"{p}: {why}" for p, why in damaged.items())
        raise ConfigError(f"ckpt_path last: no intact checkpoint to resume from ({listing}); "
                          f"remove them to start afresh or give --ckpt_path FILE")
    return None


def _move_aside(path: str) -> Optional[str]:
    """Rename ``path`` to ``path.damaged`` (or ``.damaged-N``); None when it cannot be moved."""
    target, n = f"{path}.damaged", 1
    while os.path.exists(target):
        target, n = f"{path}.damaged-{n}", n + 1
    try:
        os.replace(path, target)
        return target
    except OSError:  # another process moved it, or a read-only folder: leave it
        return None


def remove_stale_temporaries(folder: str) -> None:
    """Delete ``.NAME.tmp-PID`` files (left by a save that was killed) in ``folder`` whose process PID is gone
    (or is this one: call only while no save of this run can be in progress, before training starts)."""
    names = sorted(n for n in os.listdir(folder) if _TMP_RE.match(n)) if folder and os.path.isdir(folder) else []
    names = [n for n in names if int(_TMP_RE.match(n).group(1)) == os.getpid()
             or not pid_alive(int(_TMP_RE.match(n).group(1)))]
    for name in names:
        with contextlib.suppress(OSError):  # another process removed it
            os.remove(os.path.join(folder, name))
    if names:
        log.info("removed %d temporary file(s) of an interrupted checkpoint save: %s", len(names), ", ".join(names))


class RunLock:
    """An exclusive ``flock`` on ``FOLDER/.diffmm-run.lock`` in each folder of a run (its root, its checkpoints),
    holding ``PID host`` of the owner. The kernel drops it when the owner exits, however it dies, so a killed run
    leaves no stale lock. (``flock`` is local; on network file systems it holds as far as they support it.)

    Raises:
        ConfigError: another live process holds one of the folders (the message names its PID and host).
    """

    def __init__(self, folders: list[str]) -> None:
        self._files: list = []
        try:
            for folder in dict.fromkeys(os.path.realpath(f) for f in folders):
                os.makedirs(folder, exist_ok=True)
                path = os.path.join(folder, LOCK_NAME)
                f = open(path, "a+")  # noqa: SIM115 - held open for the run's lifetime
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    f.seek(0)
                    owner = f.read().split() or ["?", "?"]
                    f.close()
                    raise ConfigError(f"{folder} belongs to a running fit (PID {owner[0]} on {owner[-1]}, lock "
                                      f"{path}); wait for it to end, or give this run its own "
                                      f"--trainer.default_root_dir") from None
                f.seek(0)
                f.truncate()
                f.write(f"{os.getpid()} {socket.gethostname()}\n")
                f.flush()
                self._files.append(f)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Unlock (the lock files stay, naming the last owner)."""
        for f in self._files:
            with contextlib.suppress(OSError):
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
        self._files = []
