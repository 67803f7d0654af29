"""Fixtures for the data tests: tiny image-text and text shards written with diffmm's ShardWriter."""
from __future__ import annotations

import io
import os
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from diffmm.data.writer import ShardWriter


def png_bytes(i: int, size: int = 8) -> bytes:
    """A small PNG whose colour encodes ``i``."""
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (i % 256, (i // 256) % 256, 7)).save(buf, "PNG")
    return buf.getvalue()


def id_tokenizer(texts: list[str]) -> torch.Tensor:
    """Captions are sample ids: ``"17"`` -> ``[[17]]`` (lets tests see exactly which samples came out)."""
    return torch.tensor([[int(t)] for t in texts], dtype=torch.long)


def write_id_shards(directory: str, sizes: list[int], start: int = 0, prefix: str = "s") -> tuple[str, list[int]]:
    """Write shards with ``sizes[i]`` samples each; captions are consecutive ids from ``start``.

    Returns the brace pattern and the list of ids written.
    """
    ids = []
    i = start
    for n_shard, n in enumerate(sizes):
        with ShardWriter(directory, f"{prefix}{n_shard:02d}", maxcount=10**6) as w:
            for _ in range(n):
                w.write(f"{i:06d}", {"png": png_bytes(i), "txt": str(i)})
                ids.append(i)
                i += 1
    pattern = os.path.join(directory, f"{prefix}{{00..{len(sizes) - 1:02d}}}-000000.tar")
    return pattern, ids


def collect_ids(loader) -> tuple[list[int], int]:
    """All sample ids a loader yields, and its number of batches."""
    ids, n = [], 0
    for batch in loader:
        ids += batch[1][:, 0].tolist()
        n += 1
    return ids, n


@pytest.fixture
def id_shards(tmp_path):
    """8 shards x 6 samples (ids 0..47)."""
    return write_id_shards(str(tmp_path / "shards"), [6] * 8)


@pytest.fixture
def dh():
    """Data-test helpers (tests/ is not a package, so they come as a fixture)."""
    return SimpleNamespace(png_bytes=png_bytes, id_tokenizer=id_tokenizer, write_id_shards=write_id_shards,
                           collect_ids=collect_ids)
