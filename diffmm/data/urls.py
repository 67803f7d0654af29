"""Shard lists: brace expansion, weighted sources, existence checks, opening and ``sizes.json``.

A *source spec* is one string or a list of strings. Inside a string, ``::`` separates
sources (open_clip convention) and each source may use brace expansion, e.g.
``"cc3m/{00000..00331}.tar::cc12m/{00000..01242}.tar"``. A source that starts with
``pipe:`` is a shell command whose stdout is the tar stream (object stores:
``pipe:aws s3 cp s3://bucket/{0..9}.tar -``).
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from typing import BinaryIO, Iterable, Sequence

import braceexpand

SIZES_FILE = "sizes.json"


@dataclass(frozen=True)
class Source:
    """One data source: its expanded shard urls and its sampling weight."""

    urls: tuple[str, ...]
    weight: float = 1.0


def _split_specs(spec: str | Sequence[str]) -> list[str]:
    parts = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for part in parts:
        out.extend(p for p in str(part).split("::") if p.strip())
    return out


def expand_sources(spec: str | Sequence[str], weights: Sequence[float] | None = None) -> list[Source]:
    """Expand a source spec into :class:`Source` objects.

    Args:
        spec: shard url pattern(s); ``::`` separates sources.
        weights: one positive weight per source (default: all 1).

    Raises:
        ValueError: weights do not match the number of sources, or a source is empty.
    """
    specs = _split_specs(spec)
    if not specs:
        raise ValueError("no shard urls given")
    if weights is None:
        weights = [1.0] * len(specs)
    weights = [float(w) for w in weights]
    if len(weights) != len(specs):
        raise ValueError(f"got {len(weights)} source weights for {len(specs)} sources: {specs}")
    if any(w <= 0 for w in weights):
        raise ValueError(f"source weights must be positive, got {weights}")
    sources = []
    for s, w in zip(specs, weights):
        urls = tuple(braceexpand.braceexpand(s.strip()))
        sources.append(Source(urls=urls, weight=w))
    return sources


def is_local(url: str) -> bool:
    """True for a plain local path (not ``pipe:`` and not a ``scheme://`` url)."""
    return not url.startswith("pipe:") and "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """Strip an optional ``file://`` prefix."""
    return url[len("file://"):] if url.startswith("file://") else url


def check_shards_exist(urls: Iterable[str]) -> None:
    """Raise one ``FileNotFoundError`` line listing every missing local shard (remote urls are not checked)."""
    missing = [u for u in urls if is_local(u) and not os.path.exists(local_path(u))]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise FileNotFoundError(f"{len(missing)} shard(s) not found: {shown}")


class PipeStream:
    """Read the stdout of a shell command; ``close()`` raises ``OSError`` on a non-zero exit status."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.stdout = self.proc.stdout

    def read(self, n: int = -1) -> bytes:
        return self.stdout.read(n)

    def close(self) -> None:
        self.stdout.close()
        rc = self.proc.wait()
        err = self.proc.stderr.read().decode("utf-8", "replace").strip() if self.proc.stderr else ""
        if self.proc.stderr:
            self.proc.stderr.close()
        if rc != 0:
            raise OSError(f"pipe command exited with status {rc}: {self.command!r} {err[:200]}")


def open_shard(url: str) -> BinaryIO:
    """Open a shard url for streaming reads (local path, ``pipe:cmd`` or any url ``webdataset.gopen`` knows)."""
    if url.startswith("pipe:"):
        return PipeStream(url[len("pipe:"):])  # type: ignore[return-value]
    if is_local(url):
        return open(local_path(url), "rb", buffering=1 << 20)
    import webdataset

    return webdataset.gopen(url, "rb")


def read_sizes(urls: Sequence[str]) -> int:
    """Total sample count of ``urls`` from the ``sizes.json`` next to each shard.

    ``sizes.json`` maps a shard's file name to its number of samples (the img2dataset and
    open_clip convention). Raises ``FileNotFoundError``/``KeyError`` naming the file or shard.
    """
    cache: dict[str, dict] = {}
    total = 0
    for url in urls:
        if url.startswith("pipe:"):
            raise ValueError(f"cannot read sizes.json for pipe: url {url!r}; pass the epoch size explicitly")
        directory, name = os.path.split(local_path(url))
        path = os.path.join(directory, SIZES_FILE)
        if path not in cache:
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} not found (needed for the length of {url}); pass the epoch size explicitly")
            with open(path) as f:
                cache[path] = json.load(f)
        if name not in cache[path]:
            raise KeyError(f"{path} has no entry for shard {name!r}")
        total += int(cache[path][name])
    return total
