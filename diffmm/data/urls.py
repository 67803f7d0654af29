"""Shard lists: brace expansion, weighted sources, existence checks and opening a shard as a stream.

A *source spec* is one string or a list of strings. Inside a string, ``::`` separates
sources (open_clip convention) and each source may use brace expansion, e.g.
``"cc3m/{00000..00331}.tar::cc12m/{00000..01242}.tar"``, and, for local files, glob patterns
(``"cc3m/*.tar"``, expanded after the braces and sorted). A source that starts with
``pipe:`` is a shell command whose stdout is the tar stream (object stores:
``pipe:aws s3 cp s3://bucket/{0..9}.tar -``).
"""
from __future__ import annotations

import glob
import os
import select
import signal
import subprocess
from dataclasses import dataclass
from typing import BinaryIO, Iterable, Sequence

import braceexpand
import webdataset

@dataclass(frozen=True)
class Source:
    """One data source: its expanded shard urls and its sampling weight."""

    urls: tuple[str, ...]
    weight: float = 1.0


def expand_sources(spec: str | Sequence[str], weights: Sequence[float] | None = None) -> list[Source]:
    """Expand a source spec into :class:`Source` objects.

    Args:
        spec: shard url pattern(s); ``::`` separates sources.
        weights: one positive weight per source (default: all 1).

    Raises:
        ValueError: weights do not match the number of sources, or a source is empty.
    """
    parts = [spec] if isinstance(spec, str) else list(spec)
    specs = [p for part in parts for p in str(part).split("::") if p.strip()]
    if not specs:
        raise ValueError("no shard urls given")
    weights = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(specs):
        raise ValueError(f"got {len(weights)} source weights for {len(specs)} sources: {specs}")
    if any(w <= 0 for w in weights):
        raise ValueError(f"source weights must be positive, got {weights}")
    return [Source(urls=tuple(u for pattern in braceexpand.braceexpand(s.strip()) for u in expand_glob(pattern)),
                   weight=w) for s, w in zip(specs, weights)]


def _has_magic(url: str) -> bool:
    return any(c in url for c in "*?[")


def expand_glob(url: str) -> list[str]:
    """A local url with ``*``, ``?`` or ``[...]`` -> the matching files, sorted; anything else as it is.

    A pattern that matches nothing is returned unchanged, so the existence check names it.
    """
    if not is_local(url) or not _has_magic(url):
        return [url]
    prefix = "file://" if url.startswith("file://") else ""
    found = sorted(glob.glob(local_path(url)))
    return [prefix + f for f in found] if found else [url]


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
        hint = " (no file matches the pattern)" if any(_has_magic(u) for u in missing) else ""
        raise FileNotFoundError(f"{len(missing)} shard(s) not found: {shown}{hint}")


class PipeStream:
    """Read the stdout of a shell command.

    ``read`` raises ``TimeoutError`` (an ``OSError``) when the command sends nothing for ``timeout``
    seconds, and kills it; ``close()`` raises ``OSError`` on a non-zero exit status. The command runs
    in its own process group, so ``kill()`` also ends the programs it started.
    """

    def __init__(self, command: str, timeout: float | None = None) -> None:
        self.command, self.timeout = command, timeout
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.stdout = self.proc.stdout
        self._fd = self.stdout.fileno()
        self._killed = False

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (fewer when that is what the command has sent so far; ``b""`` at the end)."""
        if self.timeout is None or n <= 0:
            return self.stdout.read(n)  # (tarfile always asks for a block size)
        ready, _, _ = select.select([self._fd], [], [], self.timeout)
        if not ready:
            self.kill()
            raise TimeoutError(f"pipe command sent no data for {self.timeout:g} s (pipe_timeout): {self.command!r}")
        return os.read(self._fd, n)

    def kill(self) -> None:
        """End the command (and its children) now."""
        if self.proc.poll() is None:
            self._killed = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()

    def close(self) -> None:
        self.stdout.close()
        rc = self.proc.wait()
        err = self.proc.stderr.read().decode("utf-8", "replace").strip() if self.proc.stderr else ""
        if self.proc.stderr:
            self.proc.stderr.close()
        if rc != 0 and not self._killed:
            raise OSError(f"pipe command exited with status {rc}: {self.command!r} {err[:200]}")


def open_shard(url: str, timeout: float | None = None) -> BinaryIO:
    """Open a shard url for streaming reads (local path, ``pipe:cmd`` or any url ``webdataset.gopen`` knows).

    ``timeout``: seconds a ``pipe:`` command may stay silent before it is killed (``None``: no limit).
    """
    if url.startswith("pipe:"):
        return PipeStream(url[len("pipe:"):], timeout)  # type: ignore[return-value]
    if is_local(url):
        return open(local_path(url), "rb", buffering=1 << 20)
    return webdataset.gopen(url, "rb")

