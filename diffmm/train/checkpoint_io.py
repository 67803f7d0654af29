"""Atomic checkpoint writes: a killed run never leaves a half-written ``last.ckpt`` behind."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
from lightning_fabric.utilities.cloud_io import _is_local_file_protocol
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a hidden temporary file in the target folder, ``fsync``, then ``os.replace``.

    The rename is atomic on POSIX file systems, so readers (and ``fit --ckpt_path last`` after a
    SIGKILL) see either the previous complete file or the new complete file. Remote paths
    (``s3://``, ...) fall back to Lightning's transactional write.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        path = str(path)
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
