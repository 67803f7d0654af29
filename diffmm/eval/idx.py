"""IDX files (the MNIST / Fashion-MNIST format): read items lazily.

Layout: two zero bytes, a dtype code, the number of dims, one big-endian int32 per dim, then the
data, big-endian, row-major. ``.gz`` files are read through ``gzip`` (sequential reads stay cheap).
"""
from __future__ import annotations

import gzip
import os
import struct
from typing import BinaryIO

import numpy as np

from diffmm.eval.common import EvalError

_DTYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
           0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def _open(path: str) -> BinaryIO:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # type: ignore[return-value]


class IdxArray:
    """Random access to the items (first-axis slices) of an IDX file without loading it.

    Pickles as its path, so DataLoader workers open their own handle.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise EvalError(f"IDX file not found: {path}")
        try:
            with _open(path) as f:
                head = f.read(4)
                if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _DTYPES:
                    raise EvalError(f"{path}: not an IDX file (bad magic {head.hex()})")
                self.shape = struct.unpack(f">{head[3]}i", f.read(4 * head[3]))
        except (OSError, EOFError, struct.error) as e:
            raise EvalError(f"{path}: cannot read the IDX header ({type(e).__name__}: {e})") from None
        self.path, self.dtype, self.offset = path, _DTYPES[head[2]], 4 + 4 * head[3]
        self.item_shape = self.shape[1:]
        self.item_bytes = int(np.prod(self.item_shape, dtype=np.int64)) * self.dtype.itemsize
        self._f: BinaryIO | None = None
        self._pos = -1

    def __len__(self) -> int:
        return self.shape[0]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_f": None, "_pos": -1}

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: item {i} out of range 0..{len(self) - 1}")
        if self._f is None:
            self._f = _open(self.path)
        pos = self.offset + i * self.item_bytes
        if pos != self._pos:
            self._f.seek(pos)
        buf = self._f.read(self.item_bytes)
        if len(buf) != self.item_bytes:
            raise EvalError(f"{self.path}: file ends inside item {i} (truncated IDX file)")
        self._pos = pos + self.item_bytes
        return np.frombuffer(buf, dtype=self.dtype).reshape(self.item_shape)

    def read_all(self) -> np.ndarray:
        """All items at once (use for label files, which are small)."""
        with _open(self.path) as f:
            f.seek(self.offset)
            data = f.read()
        n = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if len(data) < n:
            raise EvalError(f"{self.path}: {len(data)} data bytes; the header promises {n} (truncated IDX file)")
        return np.frombuffer(data[:n], dtype=self.dtype).reshape(self.shape)


def find_idx_pair(folder: str, split: str) -> tuple[str, str]:
    """The images and labels files of ``split`` (``train`` / ``test``, MNIST naming, ``.gz`` or not) in ``folder``."""
    prefix = {"train": "train", "test": "t10k", "t10k": "t10k"}.get(split)
    if prefix is None:
        raise EvalError(f"IDX split {split!r} is unknown; expected train or test")
    found = []
    for kind, dims in (("images", 3), ("labels", 1)):
        names = [f"{prefix}-{kind}-idx{dims}-ubyte{ext}" for ext in ("", ".gz")]
        hits = [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]
        if not hits:
            raise EvalError(f"{folder}: no {names[0]}[.gz] (expected the MNIST file naming for split {split!r})")
        found.append(hits[0])
    return found[0], found[1]
