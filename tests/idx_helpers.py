"""Writing IDX files (the MNIST format) for tests: what ``diffmm.eval.idx`` reads."""
from __future__ import annotations

import gzip
import struct

import numpy as np

_CODES = {np.dtype("u1"): 0x08, np.dtype("i1"): 0x09}


def write_idx(path: str, array: np.ndarray) -> str:
    """Write a uint8/int8 array as an IDX file (``.gz`` compresses). Returns the path."""
    array = np.ascontiguousarray(array)
    header = bytes([0, 0, _CODES[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    with (gzip.open if path.endswith(".gz") else open)(path, "wb") as f:
        f.write(header)
        f.write(array.tobytes())
    return path
