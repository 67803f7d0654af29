"""Write webdataset tar shards with reproducible bytes and a ``sizes.json``, replacing old shards only on success."""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import shutil
import tarfile
import tempfile

from diffmm.data.files import read_json, write_json_atomic
from diffmm.data.sizes import SIZES_FILE

_KEY_RE = re.compile(r"^[A-Za-z0-9_\-/]+$")
_TMP_TAG = "-writing-"


def sanitize_key(text: str) -> str:
    """A valid sample key from arbitrary text (no dots; letters, digits, ``_``, ``-``)."""
    key = re.sub(r"[^A-Za-z0-9_\-]+", "_", text).strip("_")
    return key or "_"


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a plain file name prefix, else raise a one-line ``ValueError``.

    Shards always go into the output folder: a prefix with a path separator or ``..`` could
    write (and, on a rerun, delete) files elsewhere.
    """
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if not prefix or any(s in prefix for s in seps) or ".." in prefix or "\0" in prefix:
        raise ValueError(f"--prefix {prefix!r} must be a plain file name prefix (no '/', '\\' or '..'); "
                         "shards always go into the output folder")
    return prefix


class SkipCounter:
    """Input rows a writer skipped, by reason; ``str()`` is
    ``"3 rows skipped (missing image=2, bad image=1); first ..."``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def add(self, reason: str, detail: str) -> None:
        """Count one skipped row; ``detail`` (the row and the problem) is kept for the first of each reason."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first.setdefault(reason, detail)

    @property
    def total(self) -> int:
        """Rows skipped for any reason."""
        return sum(self.counts.values())

    def __str__(self) -> str:
        if not self.counts:
            return ""
        parts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        first = "; ".join(f"first {k}: {v}" for k, v in sorted(self.first.items()))
        return f"{self.total} rows skipped ({parts}); {first}"


class ShardWriter:
    """Write samples into ``{directory}/{prefix}-{index:06d}.tar``, starting a new shard at ``maxcount``
    samples or ``maxsize`` bytes, and record per-shard counts in ``{directory}/sizes.json``.

    Shards are written into a hidden temporary folder inside ``directory`` and moved into place by
    :meth:`close` (the ``with`` block's successful end): only then are old ``{prefix}-NNNNNN.tar``
    files that the new set does not overwrite deleted and ``sizes.json`` updated. If the block
    raises, :meth:`abort` removes the temporary folder and the old shards stay as they were.
    Tar members get fixed metadata (mtime 0, uid/gid 0, mode 0644), so the same samples in the same
    order give byte-identical shards.

    Args:
        directory: output folder (created).
        prefix: shard file name prefix (a plain name: no path separators or ``..``).
        maxcount: most samples per shard.
        maxsize: most bytes per shard (a shard holds at least one sample).
    """

    def __init__(self, directory: str, prefix: str = "shard", maxcount: int = 10000, maxsize: int = 1 << 30) -> None:
        if maxcount < 1 or maxsize < 1:
            raise ValueError(f"maxcount and maxsize must be >= 1, got {maxcount}, {maxsize}")
        check_prefix(prefix)
        os.makedirs(directory, exist_ok=True)
        self.directory, self.prefix = directory, prefix
        self.maxcount, self.maxsize = maxcount, maxsize
        self.sizes: dict[str, int] = {}
        self.shards: list[str] = []   # final paths (they exist once close() has run)
        self._tar: tarfile.TarFile | None = None
        self._count = 0
        self._bytes = 0
        self._keys: set[str] = set()
        self.total = 0
        #: input rows the tool feeding this writer skipped (``--skip_bad true``), by reason
        self.skipped = SkipCounter()
        self._stale = re.compile(re.escape(prefix) + r"-\d{6}\.tar$")
        self._tmpdir: str | None = tempfile.mkdtemp(prefix=f".{prefix}{_TMP_TAG}", dir=directory)
        self._closed = False

    def _open_next(self) -> None:
        self._close_current()
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._tar = tarfile.open(os.path.join(self._tmpdir, name), "w", format=tarfile.USTAR_FORMAT)
        self.shards.append(os.path.join(self.directory, name))
        self.sizes[name] = 0
        self._count = 0
        self._bytes = 0

    def _close_current(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def write(self, key: str, fields: dict[str, bytes | str]) -> None:
        """Add one sample: ``fields`` maps extension (``"png"``, ``"txt"``, ``"json"``) to bytes or str.

        Raises:
            ValueError: bad or duplicate key, or a field name with a dot.
        """
        if self._closed:
            raise ValueError("ShardWriter is closed")
        if not _KEY_RE.match(key):
            raise ValueError(f"sample key {key!r} must match {_KEY_RE.pattern} (no dots); use sanitize_key()")
        if key in self._keys:
            raise ValueError(f"duplicate sample key {key!r}")
        self._keys.add(key)
        payload = {f: (v.encode("utf-8") if isinstance(v, str) else bytes(v)) for f, v in fields.items()}
        size = sum(len(v) + 1024 for v in payload.values())
        if self._tar is None or self._count >= self.maxcount or (self._count > 0 and self._bytes + size > self.maxsize):
            self._open_next()
        for field in sorted(payload):
            data = payload[field]
            info = tarfile.TarInfo(f"{key}.{field}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            self._tar.addfile(info, io.BytesIO(data))
        self._count += 1
        self._bytes += size
        self.sizes[os.path.basename(self.shards[-1])] += 1
        self.total += 1

    def close(self) -> dict[str, int]:
        """Move the new shards into place, delete the old ones of this prefix, merge ``sizes.json``.

        Returns this writer's counts (shard file name -> samples).
        """
        if self._closed:
            return dict(self.sizes)
        self._close_current()
        for path in self.shards:
            os.replace(os.path.join(self._tmpdir, os.path.basename(path)), path)
        new = set(self.sizes)
        for name in os.listdir(self.directory):  # a rerun replaces the shards of an earlier one
            if self._stale.match(name) and name not in new:
                os.remove(os.path.join(self.directory, name))
        path = os.path.join(self.directory, SIZES_FILE)
        kept = {k: v for k, v in (read_json(path) or {}).items() if not self._stale.match(k)}
        write_json_atomic(path, {**kept, **self.sizes}, sort_keys=True)
        self._remove_tmp()
        for leftover in glob.glob(os.path.join(glob.escape(self.directory), f".{glob.escape(self.prefix)}{_TMP_TAG}*")):
            shutil.rmtree(leftover, ignore_errors=True)  # from a writer that was killed
        self._closed = True
        return dict(self.sizes)

    def abort(self) -> None:
        """Drop what was written; the output folder keeps its old shards and ``sizes.json``."""
        if self._closed:
            return
        with contextlib.suppress(Exception):
            self._close_current()
        self._remove_tmp()
        self.shards, self.sizes, self.total = [], {}, 0
        self._closed = True

    def _remove_tmp(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    @property
    def pattern(self) -> str:
        """Brace pattern of the shards written (``dir/prefix-{000000..000003}.tar``)."""
        if not self.shards:
            return ""
        last = len(self.shards) - 1
        if last == 0:
            return self.shards[0]
        return os.path.join(self.directory, f"{self.prefix}-{{000000..{last:06d}}}.tar")

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
