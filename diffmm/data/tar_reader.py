"""Stream samples out of one webdataset tar shard, counting every problem instead of raising.

A sample is the run of consecutive tar members sharing a key: for ``dir/000123.jpg`` the key is
``dir/000123`` and the field is ``jpg`` (everything after the first dot of the file name).

Hostile input is bounded: a member larger than ``max_member_bytes`` is never read into memory (its
sample is skipped and counted as ``skip_oversized``, whatever the compression ratio of the shard),
and a ``pipe:`` command that sends nothing for ``pipe_timeout`` seconds is killed (``shards_failed``).
"""
from __future__ import annotations

import tarfile
from dataclasses import dataclass
from typing import Generator, Optional

from diffmm.data.stats import DataStats
from diffmm.data.urls import is_local, local_path, open_shard

#: default cap on one tar member (bytes): larger members are skipped without being read
MAX_MEMBER_BYTES = 64 << 20
#: default seconds a ``pipe:`` command may stay silent before it is killed
PIPE_TIMEOUT = 120.0


@dataclass(frozen=True)
class ReadLimits:
    """Caps applied while reading shards.

    Args:
        max_member_bytes: skip samples with a tar member larger than this (``None``: no cap).
        pipe_timeout: seconds without data after which a ``pipe:`` command is killed (``None``: wait forever).
    """

    max_member_bytes: Optional[int] = MAX_MEMBER_BYTES
    pipe_timeout: Optional[float] = PIPE_TIMEOUT


class RecordingTarInfo(tarfile.TarInfo):
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


def iter_tar_samples(url: str, stats: DataStats, offset: int = 0, stride: int = 1, *, start: int = 0,
                     stop: Optional[int] = None, expected: Optional[int] = None, expected_from: str = "sizes.json",
                     limits: ReadLimits = ReadLimits(), first_read: bool = True) -> Generator[dict, None, int]:
    """Yield the samples of shard ``url`` as webdataset does: ``{"__key__", "__url__", field: bytes, ...}``
    (and ``"__local_path__"`` for a local file).

    Args:
        url: local path, ``pipe:`` command or remote url.
        stats: counters to update (shards opened/failed/truncated/empty/miscounted; a sample cut off
            by truncation or with an oversized member counts as ``samples_in`` + its skip reason
            here; the consumer counts the rest).
        offset: keep only samples whose index in the shard is ``offset`` modulo ``stride``
            (used when several workers share one shard without known sizes).
        stride: see ``offset``.
        start, stop: keep only samples with ``start <= index < stop`` (a worker's range of the
            shard); reading stops at ``stop``.
        expected: the shard's stated sample count; a shard that ends before it, or goes on past it
            when ``stop == expected``, is counted as ``shards_miscounted`` and named in a warning.
        expected_from: where ``expected`` comes from (for the warning).
        limits: member size cap and ``pipe:`` timeout.
        first_read: False when the shard is read again in the same epoch (a batch quota re-read): its shard
            problems and its cut-off sample were counted on the first read and are not counted again.

    Returns:
        (the generator's return value) the samples of the shard up to where reading ended (whole
        samples only: the one cut off by damage is not one); a ``start`` past every sample reads no
        member's data, which counts the samples of a shard.
    """
    def problem_of(counter: str, shard: str, detail: str = "") -> None:
        if first_read:
            stats.shard_problem(counter, shard, detail)

    try:
        stream = open_shard(url, timeout=limits.pipe_timeout)
    except OSError as e:
        problem_of("shards_failed", url, f"{type(e).__name__}: {e}")
        return 0
    stats.add("shards_opened")
    base = {"__local_path__": local_path(url)} if is_local(url) else {}   # as webdataset's samples have it
    cap = limits.max_member_bytes
    index = 0          # index of the current sample within the shard
    current: dict | None = None
    oversized: str | None = None   # why the current sample is skipped (a member over the cap)
    n_members = 0
    problem: str | None = None
    tf = None
    abandoned = False

    def wanted(i: int) -> bool:
        return i % stride == offset and i >= start

    try:
        tf = tarfile.open(fileobj=stream, mode="r|*", tarinfo=RecordingTarInfo)
        for member in tf:
            parts = split_name(member.name) if member.isfile() else None
            if parts is None:
                continue
            key, field = parts
            if current is not None and current["__key__"] != key:
                if wanted(index):
                    if oversized is not None:
                        _skip_oversized(stats, url, current, oversized)
                    else:
                        yield current
                index += 1
                current, oversized = None, None
            if current is None:
                if stop is not None and index >= stop:
                    if expected is not None and stop >= expected:
                        problem_of("shards_miscounted", url, f"more samples than the {expected} "
                                            f"{expected_from} says; the rest are not read (run `diffmm shards index`)")
                    abandoned = True
                    break
                current = {"__key__": key, "__url__": url, **base}
            n_members += 1
            if not wanted(index):
                continue  # tarfile skips the member's data
            if cap is not None and member.size > cap:
                oversized = f"{field}: {member.size} bytes > max_member_bytes={cap}"
                continue
            current[field] = tf.extractfile(member).read()  # type: ignore[union-attr]
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
            if abandoned and hasattr(stream, "kill"):
                stream.kill()
            stream.close()
        except OSError as e:  # a pipe command's exit status
            close_error = str(e)
    if abandoned:
        return index
    if close_error is not None:
        problem_of("shards_failed", url, close_error)
    elif problem is not None and n_members == 0 and "empty file" in problem:
        problem_of("shards_empty", url)
    elif problem is not None and n_members == 0 and not getattr(tf, "_diffmm_cut", False):
        problem_of("shards_failed", url, f"not a readable tar ({problem})")
    elif problem is not None:
        problem_of("shards_truncated", url, problem)
    if problem is not None:
        if current is not None and wanted(index) and first_read:
            # the sample being read when the stream broke may be incomplete: never use it
            stats.add("samples_in")
            stats.skip("truncated", f"{url}:{current['__key__']}")
        return index
    if current is not None:
        if wanted(index):
            if oversized is not None:
                _skip_oversized(stats, url, current, oversized)
            else:
                yield current
        index += 1
    elif n_members == 0 and close_error is None:
        problem_of("shards_empty", url)
        return index
    if expected is not None and close_error is None and (index < expected or (stop is None and index > expected)):
        problem_of("shards_miscounted", url, f"{index} samples, but {expected_from} says {expected} "
                            "(run `diffmm shards index` to rewrite it)")
    return index


def _skip_oversized(stats: DataStats, url: str, sample: dict, why: str) -> None:
    stats.add("samples_in")
    stats.skip("oversized", f"{url}:{sample['__key__']}", why)
