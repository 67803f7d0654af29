"""Samples per shard: from ``sizes.json``, img2dataset's ``*_stats.json``, or counted once and cached (the order,
the cache's location and what a miscount does: docs/data.md, "Samples per shard").

Exact epochs need the number of samples of every shard: ``sizes.json`` beside it, else img2dataset's
``{stem}_stats.json``, else a count cache keyed by file name, size and mtime, else the tar reader streams through
the shard once (keeping no member's data) and the count is cached. A wrong count (a stale ``sizes.json``) is found
while reading: the shard is reported as ``shards_miscounted`` and the epoch stays valid (:mod:`diffmm.data.stream`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from tqdm import tqdm

from diffmm.data.files import read_json, write_json_atomic
from diffmm.data.stats import DataStats
from diffmm.data.tar_reader import iter_tar_samples
from diffmm.data.urls import is_local, local_path

log = logging.getLogger("diffmm.data")

SIZES_FILE = "sizes.json"
CACHE_FILE = ".diffmm-counts.json"
STATS_SUFFIX = "_stats.json"


@dataclass(frozen=True)
class ShardCount:
    """Samples of one shard and where the number comes from (a file path, or ``"counted"``)."""

    samples: int
    source: str


class UnknownShardSize(ValueError):
    """The size of a shard cannot be known without reading it (a ``pipe:`` or remote url)."""


def _split(url: str) -> tuple[str, str]:
    return os.path.split(os.path.abspath(local_path(url)))


def _stem(name: str) -> str:
    for ext in (".tar.gz", ".tgz", ".tar"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return os.path.splitext(name)[0]


def cache_path(directory: str) -> str:
    """The count cache of a shard folder: beside the shards if writable, else under ``$XDG_CACHE_HOME/diffmm``."""
    if os.access(directory, os.W_OK):
        return os.path.join(directory, CACHE_FILE)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()[:16]
    return os.path.join(root, "diffmm", "shard-counts", f"{digest}.json")


def inspect_shard(url: str) -> int:
    """Samples of one shard as the reader numbers them, counted by
    :func:`~diffmm.data.tar_reader.iter_tar_samples` itself, keeping no member's data (a damaged
    shard counts the samples before the damage, an unreadable one 0, and the reader logs the problem)."""
    samples = iter_tar_samples(url, DataStats("counting"), start=sys.maxsize)   # keeps no sample
    try:
        next(samples)
    except StopIteration as end:
        return end.value
    raise AssertionError("unreachable: a start past every sample yields nothing")


def stated_counts(urls: Sequence[str], use_cache: bool = False) -> dict[str, ShardCount]:
    """Counts that files state (``sizes.json``, ``*_stats.json``; with ``use_cache`` also the count
    cache) for the local ``urls`` that have one; nothing is counted."""
    out: dict[str, ShardCount] = {}
    files: dict[str, dict] = {}   # each JSON file read once

    def read(path: str) -> dict:
        if path not in files:
            files[path] = read_json(path) or {}
        return files[path]

    for url in filter(is_local, urls):
        directory, name = _split(url)
        sizes_path = os.path.join(directory, SIZES_FILE)
        stats_path = os.path.join(directory, _stem(name) + STATS_SUFFIX)
        if isinstance(read(sizes_path).get(name), int):
            out[url] = ShardCount(read(sizes_path)[name], sizes_path)
        elif isinstance(read(stats_path).get("successes"), int):
            out[url] = ShardCount(read(stats_path)["successes"], stats_path)
        elif use_cache:
            entry, st = read(cache_path(directory)).get(name), _stat(url)
            if isinstance(entry, dict) and entry.get("bytes") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
                out[url] = ShardCount(int(entry["samples"]), "counted")
    return out


def shard_counts(urls: Sequence[str], progress: bool = False) -> dict[str, ShardCount]:
    """The sample count of each url (see the module doc for where each comes from).

    Args:
        urls: shard urls; ``pipe:`` and remote urls raise :class:`UnknownShardSize`.
        progress: show a tqdm bar while counting.

    Raises:
        UnknownShardSize: a non-local url.
        FileNotFoundError: a missing shard.
    """
    out = stated_counts(urls, use_cache=True)
    new: dict[str, dict[str, dict]] = {}
    unknown = ("the sample count of {url!r} is unknown (not a local file); pass the epoch size (samples_per_epoch) "
               "or use local shards")
    for url, directory, name, n, st in _count([u for u in dict.fromkeys(urls) if u not in out], "counting samples",
                                              progress, unknown):
        out[url] = ShardCount(n, "counted")
        new.setdefault(directory, {})[name] = {"samples": n, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    for directory, entries in new.items():
        path = cache_path(directory)
        try:
            _merge_json(path, entries)
        except OSError as e:  # a read-only cache is not an error: the count is used, just not kept
            log.warning("could not cache shard counts in %s (%s)", path, e)
            continue
        log.info("counted %d samples in %d shard(s) of %s without %s (cached in %s)",
                 sum(e["samples"] for e in entries.values()), len(entries), directory, SIZES_FILE, path)
    return {u: out[u] for u in urls}


def write_sizes(urls: Iterable[str], progress: bool = True) -> dict[str, dict[str, int]]:
    """Count every shard (ignoring existing ``sizes.json`` entries) and merge the counts into the
    ``sizes.json`` of each shard's folder; returns ``{sizes.json path: {name: samples}}``."""
    urls = list(urls)
    written: dict[str, dict[str, int]] = {}
    for _, directory, name, n, _ in _count(urls, "indexing", progress, "{url!r}: only local shards can be indexed"):
        written.setdefault(os.path.join(directory, SIZES_FILE), {})[name] = n
    for path, counts in written.items():
        _merge_json(path, counts)
    return written


def _count(urls: Sequence[str], desc: str, progress: bool,
           unknown: str) -> Iterator[tuple[str, str, str, int, os.stat_result]]:
    """Count the samples of each shard now: ``(url, folder, file name, samples, stat)``; first, a url that is not a
    local file raises :class:`UnknownShardSize` with the message ``unknown``."""
    for url in urls:
        if not is_local(url):
            raise UnknownShardSize(unknown.format(url=url))
    for url in tqdm(urls, desc=desc, unit="shard", disable=not progress or len(urls) < 2):
        st = _stat(url)
        yield (url, *_split(url), inspect_shard(url), st)


def _merge_json(path: str, entries: dict) -> None:
    """Merge ``entries`` into the JSON object in ``path`` (written atomically)."""
    data = read_json(path) or {}
    data.update(entries)
    write_json_atomic(path, data, sort_keys=True)


def _stat(url: str) -> os.stat_result:
    try:
        return os.stat(local_path(url))
    except FileNotFoundError:
        raise FileNotFoundError(f"shard not found: {url}") from None
