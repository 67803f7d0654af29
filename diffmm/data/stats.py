"""Per-epoch data counters shared by all DataLoader workers of one process.

:class:`DataStats` keeps its counts in a ``multiprocessing`` shared-memory array created in the
main process. The dataset holds it; DataLoader workers (fork or spawn) inherit it when the
dataset is sent to them, so their increments are visible to the main process at once, also with
``persistent_workers=True``. Read it with :meth:`DataStats.snapshot` / :meth:`summary`, zero it
with :meth:`reset` at the start of an epoch, and sum it over DDP ranks with
:meth:`all_reduce`.
"""
from __future__ import annotations

import logging
import multiprocessing as mp

import torch
import torch.distributed as dist

log = logging.getLogger("diffmm.data")

#: counter names, in report order. ``samples_in`` = ``samples_out`` + sum of the ``skip_*`` counts.
COUNTERS: tuple[str, ...] = (
    "shards_opened",
    "shards_failed",      # could not be opened or the stream failed (missing file, pipe error)
    "shards_truncated",   # tar stream ended inside a member or header
    "shards_empty",       # no samples at all
    "shards_miscounted",  # fewer (or more) samples than its sizes.json / *_stats.json entry says
    "samples_in",
    "samples_out",
    "samples_reread",     # read again in the same epoch to fill a batch quota (skips, miscounted shards)
    "skip_corrupt_image",
    "skip_missing_image",
    "skip_missing_text",
    "skip_empty_text",    # a caption or document of nothing but white space
    "skip_bad_utf8",
    "skip_truncated",     # the sample being read when its shard was cut off
    "skip_bad_label",
    "skip_oversized",     # a tar member over max_member_bytes (never read into memory)
    "skip_image_too_large",  # more pixels than max_image_pixels (decompression bombs)
    "skip_filtered",      # dropped by a user's pipeline stage (e.g. wds.select)
    "skip_stage_error",   # a user's pipeline stage raised and the handler said continue
    "skip_other",
)
SKIP_REASONS: tuple[str, ...] = tuple(c[len("skip_"):] for c in COUNTERS if c.startswith("skip_"))


class DataStats:
    """Shared counters (see :data:`COUNTERS`) plus a rate-limited warning per skip reason."""

    def __init__(self, name: str = "data") -> None:
        self.name = name
        self._values = mp.get_context().Array("q", len(COUNTERS), lock=True)
        self._index = {c: i for i, c in enumerate(COUNTERS)}
        self._warned: set[str] = set()

    def use_context(self, ctx) -> None:
        """Move the counters into shared memory of multiprocessing context ``ctx`` (e.g. a DataLoader's
        ``multiprocessing_context="spawn"`` when the default is fork); the counts are kept."""
        values = ctx.Array("q", len(COUNTERS), lock=True)
        with self._values.get_lock():
            values[:] = self._values[:]
        self._values = values

    def add(self, counter: str, n: int = 1) -> None:
        """Increment ``counter`` by ``n``."""
        i = self._index[counter]
        with self._values.get_lock():
            self._values[i] += n

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        """Count one skipped sample; log the first occurrence of each reason at WARNING, the rest at DEBUG."""
        self.add("skip_" + reason)
        msg = f"{self.name}: skipped sample {where} ({reason}{': ' + detail if detail else ''})"
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning(msg + " [further ones of this kind are logged at DEBUG]")
        else:
            log.debug(msg)

    def shard_problem(self, counter: str, url: str, detail: str = "") -> None:
        """Count a shard-level problem and log it (always at WARNING: these are rare and matter)."""
        self.add(counter)
        log.warning(f"{self.name}: {counter.replace('shards_', 'shard ')} {url}{': ' + detail if detail else ''}")

    def snapshot(self) -> dict[str, int]:
        """The current counts as a plain dict."""
        with self._values.get_lock():
            return {c: int(self._values[i]) for c, i in self._index.items()}

    def reset(self) -> None:
        """Zero all counters (call at the start of each epoch)."""
        with self._values.get_lock():
            for i in range(len(COUNTERS)):
                self._values[i] = 0

    @property
    def skipped(self) -> int:
        """Total skipped samples."""
        snap = self.snapshot()
        return sum(snap["skip_" + r] for r in SKIP_REASONS)

    def summary(self, counts: dict[str, int] | None = None) -> str:
        """One line: samples in/out/skipped with non-zero reasons and shard problems."""
        c = self.snapshot() if counts is None else counts
        skipped = sum(c.get("skip_" + r, 0) for r in SKIP_REASONS)
        reasons = ", ".join(f"{r}={c['skip_' + r]}" for r in SKIP_REASONS if c.get("skip_" + r))
        shards = f"shards opened={c['shards_opened']}"
        for k in ("shards_failed", "shards_truncated", "shards_empty", "shards_miscounted"):
            if c.get(k):
                shards += f" {k.split('_')[1]}={c[k]}"
        reread = f" reread={c['samples_reread']}" if c.get("samples_reread") else ""
        return (f"{self.name}: samples in={c['samples_in']} out={c['samples_out']} skipped={skipped}{reread}"
                f"{' (' + reasons + ')' if reasons else ''}; {shards}")

    def all_reduce(self) -> dict[str, int]:
        """Sum the counts over DDP ranks (needs ``torch.distributed`` initialised; else local counts)."""
        snap = self.snapshot()
        if not (dist.is_available() and dist.is_initialized()):
            return snap
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([snap[c] for c in COUNTERS], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return {c: int(v) for c, v in zip(COUNTERS, t.tolist())}

    def __getstate__(self) -> dict:
        return {"name": self.name, "_values": self._values, "_index": self._index, "_warned": set()}
