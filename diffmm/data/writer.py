"""Write webdataset tar shards with reproducible bytes and a ``sizes.json``."""
from __future__ import annotations

import io
import json
import os
import re
import tarfile

from diffmm.data.urls import SIZES_FILE

_KEY_RE = re.compile(r"^[A-Za-z0-9_\-/]+$")


def sanitize_key(text: str) -> str:
    """A valid sample key from arbitrary text (no dots; letters, digits, ``_``, ``-``)."""
    key = re.sub(r"[^A-Za-z0-9_\-]+", "_", text).strip("_")
    return key or "_"


class ShardWriter:
    """Write samples into ``{directory}/{prefix}-{index:06d}.tar``, starting a new shard at ``maxcount``
    samples or ``maxsize`` bytes, and record per-shard counts in ``{directory}/sizes.json``.

    Existing ``{prefix}-NNNNNN.tar`` files in ``directory`` are deleted first (a rerun replaces them).
    Tar members get fixed metadata (mtime 0, uid/gid 0, mode 0644), so the same samples in the same
    order give byte-identical shards.

    Args:
        directory: output folder (created).
        prefix: shard file name prefix.
        maxcount: most samples per shard.
        maxsize: most bytes per shard (a shard holds at least one sample).
    """

    def __init__(self, directory: str, prefix: str = "shard", maxcount: int = 10000, maxsize: int = 1 << 30) -> None:
        if maxcount < 1 or maxsize < 1:
            raise ValueError(f"maxcount and maxsize must be >= 1, got {maxcount}, {maxsize}")
        os.makedirs(directory, exist_ok=True)
        self.directory, self.prefix = directory, prefix
        self.maxcount, self.maxsize = maxcount, maxsize
        self.sizes: dict[str, int] = {}
        self.shards: list[str] = []
        self._tar: tarfile.TarFile | None = None
        self._count = 0
        self._bytes = 0
        self._keys: set[str] = set()
        self.total = 0
        self._stale = re.compile(re.escape(prefix) + r"-\d{6}\.tar$")
        for name in os.listdir(directory):  # a rerun replaces the shards of an earlier one
            if self._stale.match(name):
                os.remove(os.path.join(directory, name))

    def _open_next(self) -> None:
        self._close_current()
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        path = os.path.join(self.directory, name)
        self._tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)
        self.shards.append(path)
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
        """Close the last shard and merge the counts into ``sizes.json``; returns this writer's counts."""
        self._close_current()
        path = os.path.join(self.directory, SIZES_FILE)
        sizes: dict[str, int] = {}
        if os.path.exists(path):
            with open(path) as f:
                sizes = json.load(f)
        sizes = {k: v for k, v in sizes.items() if not self._stale.match(k)}
        sizes.update(self.sizes)
        with open(path, "w") as f:
            json.dump(sizes, f, indent=1, sort_keys=True)
        return dict(self.sizes)

    @property
    def pattern(self) -> str:
        """Brace pattern of the shards written so far (``dir/prefix-{000000..000003}.tar``)."""
        if not self.shards:
            return ""
        last = len(self.shards) - 1
        if last == 0:
            return self.shards[0]
        return os.path.join(self.directory, f"{self.prefix}-{{000000..{last:06d}}}.tar")

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
