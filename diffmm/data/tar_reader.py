"""Stream samples out of one webdataset tar shard, counting every problem instead of raising.

A sample is the run of consecutive tar members sharing a key: for ``dir/000123.jpg`` the key is
``dir/000123`` and the field is ``jpg`` (everything after the first dot of the file name).
"""
from __future__ import annotations

import tarfile
from typing import Iterator

from diffmm.data.stats import DataStats
from diffmm.data.urls import open_shard


class _RecordingTarInfo(tarfile.TarInfo):
    """TarInfo that marks its archive when a header is cut off or missing (no end-of-archive block)."""

    @classmethod
    def fromtarfile(cls, tf):  # noqa: D102 (tarfile hook)
        try:
            return super().fromtarfile(tf)
        except (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError):
            tf._diffmm_cut = True
            raise


def split_name(name: str) -> tuple[str, str] | None:
    """Split a member name into ``(key, field)``; ``None`` for names without a field or hidden files."""
    directory, _, base = name.rpartition("/")
    if base.startswith(".") or "." not in base:
        return None
    stem, _, field = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, field.lower()


def iter_tar_samples(url: str, stats: DataStats, offset: int = 0, stride: int = 1) -> Iterator[dict]:
    """Yield the samples of shard ``url`` as ``{"__key__", "__url__", field: bytes, ...}``.

    Args:
        url: local path, ``pipe:`` command or remote url.
        stats: counters to update (shards opened/failed/truncated/empty; a sample cut off by
            truncation counts as ``samples_in`` + ``skip_truncated``; the consumer counts the rest).
        offset: keep only samples whose index in the shard is ``offset`` modulo ``stride``
            (used when several workers share one shard).
        stride: see ``offset``.
    """
    try:
        stream = open_shard(url)
    except OSError as e:
        stats.shard_problem("shards_failed", url, f"{type(e).__name__}: {e}")
        return
    stats.add("shards_opened")
    index = 0          # index of the current sample within the shard
    current: dict | None = None
    n_members = 0
    problem: str | None = None
    tf = None
    abandoned = False
    try:
        tf = tarfile.open(fileobj=stream, mode="r|*", tarinfo=_RecordingTarInfo)
        for member in tf:
            if not member.isfile():
                continue
            parts = split_name(member.name)
            if parts is None:
                continue
            key, field = parts
            if current is not None and current["__key__"] != key:
                if index % stride == offset:
                    yield current
                index += 1
                current = None
            if current is None:
                current = {"__key__": key, "__url__": url}
            current[field] = tf.extractfile(member).read()  # type: ignore[union-attr]
            n_members += 1
        if getattr(tf, "_diffmm_cut", False):
            problem = "stream ended without the end-of-archive block"
    except GeneratorExit:  # the consumer stopped early (batch quota reached): close quietly
        abandoned = True
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
    finally:
        close_error = None
        try:
            stream.close()
        except OSError as e:  # a pipe command's exit status
            close_error = str(e)
    if close_error is not None and not abandoned:
        stats.shard_problem("shards_failed", url, close_error)
        if problem is not None:
            if current is not None and index % stride == offset:
                stats.add("samples_in")
                stats.skip("truncated", f"{url}:{current['__key__']}")
            return
    elif problem is not None:
        if n_members == 0 and "empty file" in problem:
            stats.shard_problem("shards_empty", url)
            return
        if n_members == 0 and not getattr(tf, "_diffmm_cut", False):
            stats.shard_problem("shards_failed", url, f"not a readable tar ({problem})")
            return
        stats.shard_problem("shards_truncated", url, problem)
        if current is not None and index % stride == offset:
            # the sample being read when the stream broke may be incomplete: never use it
            stats.add("samples_in")
            stats.skip("truncated", f"{url}:{current['__key__']}")
        return
    if current is not None:
        if index % stride == offset:
            yield current
    elif n_members == 0 and close_error is None:
        stats.shard_problem("shards_empty", url)
