"""Demo zero-shot classification set: Fashion-MNIST (Debian ``dataset-fashion-mnist``, IDX files).

Writes ``OUT/fashion-mnist/{train,test}/fashion-mnist-SPLIT-NNNNNN.tar`` with ``KEY.png``
(28x28 grayscale), ``KEY.cls`` (label), ``KEY.txt`` (``a photo of a CLASS.``), ``KEY.json``, and
``OUT/fashion-mnist/classes.json`` (class names and prompt templates).
"""
from __future__ import annotations

import gzip
import io
import json
import os
import struct

import numpy as np
from PIL import Image
from tqdm import tqdm

from diffmm.data.sources import ensure_apt
from diffmm.data.writer import ShardWriter

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot")
TEMPLATES = ("a photo of a {}.", "a black and white photo of a {}.", "a low resolution photo of a {}.")
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into a uint8 array of its declared shape.

    Raises:
        ValueError: bad magic number, unsupported type or wrong length, naming the file.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic)")
    dtype_code, ndim = data[2], data[3]
    if dtype_code != 0x08:
        raise ValueError(f"{path}: IDX element type 0x{dtype_code:02x} unsupported (only unsigned byte)")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} = {int(np.prod(shape))} values, file has {body.size}")
    return body.reshape(shape)


def build_fashion_mnist(out_dir: str, source_dir: str = FASHION_DIR, train_limit: int | None = 10000,
                        test_limit: int | None = None, maxcount: int = 2000, install: bool = True,
                        progress: bool = True) -> dict:
    """Build the Fashion-MNIST shards under ``out_dir/fashion-mnist``; returns per-split counts.

    Args:
        train_limit: keep the first N training images (None: all 60,000).
        test_limit: keep the first N test images (None: all 10,000).
    """
    if source_dir == FASHION_DIR:
        ensure_apt("dataset-fashion-mnist", os.path.join(FASHION_DIR, FILES["test"][0]), install)
    root = os.path.join(out_dir, "fashion-mnist")
    counts: dict = {}
    for split, limit in (("train", train_limit), ("test", test_limit)):
        images = read_idx(os.path.join(source_dir, FILES[split][0]))
        labels = read_idx(os.path.join(source_dir, FILES[split][1]))
        if len(images) != len(labels):
            raise ValueError(f"{source_dir}: {split} has {len(images)} images but {len(labels)} labels")
        n = len(images) if limit is None else min(limit, len(images))
        with ShardWriter(os.path.join(root, split), f"fashion-mnist-{split}", maxcount=maxcount) as writer:
            for i in tqdm(range(n), desc=f"fashion-mnist {split}", unit="img", disable=not progress):
                label = int(labels[i])
                if not 0 <= label < len(CLASSES):
                    raise ValueError(f"{source_dir}/{FILES[split][1]}: label {label} at index {i} out of range")
                buf = io.BytesIO()
                Image.fromarray(np.ascontiguousarray(images[i])).save(buf, "PNG")
                meta = {"label": label, "class": CLASSES[label], "index": i, "split": split}
                writer.write(f"{split}_{i:05d}", {"png": buf.getvalue(), "cls": str(label),
                                                  "txt": TEMPLATES[0].format(CLASSES[label]), "json": json.dumps(meta)})
        hist = np.bincount(labels[:n], minlength=len(CLASSES)).tolist()
        counts[split] = {"samples": writer.total, "shards": len(writer.shards), "pattern": writer.pattern,
                         "per_class": hist}
    with open(os.path.join(root, "classes.json"), "w") as f:
        json.dump({"classes": list(CLASSES), "templates": list(TEMPLATES), "counts": counts}, f, indent=1)
    return counts
