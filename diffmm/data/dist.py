"""Who am I (rank, world size, DataLoader worker) and which shards and batches are mine.

Handles the webdataset 1.0.2 traps under Lightning:

* its default node splitter raises for world size > 1 and ``split_by_node`` reads ``RANK``, which
  Lightning's launcher does not set (it sets ``LOCAL_RANK``, ``NODE_RANK`` and ``WORLD_SIZE``), so
  every rank would read the same shards. We ask ``torch.distributed`` first, then ``RANK``, then
  ``NODE_RANK``/``LOCAL_RANK``, and refuse to guess (error) when ``WORLD_SIZE > 1`` and none is set.
  Datasets snapshot the answer when they are pickled for spawned workers.
* uneven batch counts hang gloo/NCCL: every rank gets the same batch quota (:func:`batch_quota`).

When the sample count of every shard is known (``sizes.json``, img2dataset stats, or counted, see
:mod:`diffmm.data.sizes`), :func:`plan_ranges` cuts the epoch's shard sequence into one contiguous
sample range per rank x worker, sized by its batch quota: every sample is read at most once per
epoch and fewer than one global batch is left out. Without counts (``pipe:`` urls),
:func:`assign_shards` splits whole shards (or every k-th sample when there are fewer shards than workers).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist
import torch.utils.data


@dataclass(frozen=True)
class ShardSlice:
    """A shard url and the samples of it this worker keeps: ``index % stride == offset`` and
    ``start <= index < stop``; ``size`` is the shard's stated sample count (checked while reading)."""

    url: str
    offset: int = 0
    stride: int = 1
    start: int = 0
    stop: Optional[int] = None
    size: Optional[int] = None
    size_from: str = "sizes.json"


def detect_rank_world() -> tuple[int, int]:
    """Global rank and world size of this process.

    Order: initialised ``torch.distributed``; env ``RANK``/``WORLD_SIZE``; env ``NODE_RANK`` +
    ``LOCAL_RANK`` (Lightning's launcher; multi-node also needs ``LOCAL_WORLD_SIZE``).

    Raises:
        RuntimeError: ``WORLD_SIZE > 1`` but the rank cannot be determined.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return 0, 1
    if "RANK" in env:
        return int(env["RANK"]), world
    if "LOCAL_RANK" in env:
        local, node = int(env["LOCAL_RANK"]), int(env.get("NODE_RANK", env.get("GROUP_RANK", "0")))
        if node == 0:
            return local, world
        if "LOCAL_WORLD_SIZE" in env:
            return node * int(env["LOCAL_WORLD_SIZE"]) + local, world
    raise RuntimeError(
        f"WORLD_SIZE={world} but the global rank is unknown (no torch.distributed, RANK or LOCAL_RANK+NODE_RANK); "
        "pass rank= and world_size= to the dataset")


def worker_id_count() -> tuple[int, int]:
    """(worker id, number of workers) of the current DataLoader worker; (0, 1) in the main process."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def assign_shards(urls: list[str], rank: int, world: int, worker: int, num_workers: int) -> list[ShardSlice]:
    """The shards (or shard slices) of one worker; disjoint over all ranks x workers, covering all.

    With at least as many shards as global workers, worker ``g = rank * num_workers + worker`` gets
    ``urls[g::G]``. With fewer shards, worker ``g`` reads shard ``g % len(urls)`` and keeps every
    k-th sample, k being the number of workers sharing that shard.
    """
    if not urls:
        return []
    n_global = world * num_workers
    g = rank * num_workers + worker
    if len(urls) >= n_global:
        return [ShardSlice(u) for u in urls[g::n_global]]
    s = g % len(urls)
    sharing = [h for h in range(n_global) if h % len(urls) == s]
    return [ShardSlice(urls[s], sharing.index(g), len(sharing))]


def batch_quota(samples_per_epoch: int, batch_size: int, world: int, num_workers: int, worker: int) -> tuple[int, int]:
    """(batches per rank, batches of this worker) for one epoch; the same on every rank.

    Batches per rank = ``samples_per_epoch // (batch_size * world)`` (the incomplete global batch
    is dropped), spread over the workers as evenly as possible.
    """
    per_rank = samples_per_epoch // (batch_size * world)
    base, extra = divmod(per_rank, num_workers)
    return per_rank, base + (1 if worker < extra else 0)


def plan_ranges(urls: Sequence[str], sizes: Sequence[int], weights: Sequence[int],
                size_from: Optional[Sequence[str]] = None) -> list[list[ShardSlice]]:
    """Cut the samples of ``urls`` (in this order) into one contiguous range per global worker.

    Global worker ``g`` gets samples ``[N * W_g // W, N * W_{g+1} // W)`` of the concatenated
    shards (``N`` samples, ``W_g`` the sum of the weights before ``g``, ``W`` their total), so the
    ranges are disjoint, cover every sample, and a worker of weight (batch quota) ``q`` gets at least
    ``q * batch`` samples whenever ``N >= W * batch``. A range becomes slices of at most two partial
    shards and whole shards between them.
    """
    total_w, n = sum(weights), sum(sizes)
    bounds = [0] + [n * acc // total_w if total_w else n for acc in itertools.accumulate(weights)]
    starts = list(itertools.accumulate(sizes, initial=0))
    plans: list[list[ShardSlice]] = [[] for _ in weights]
    g = 0
    for i, (url, size) in enumerate(zip(urls, sizes)):
        lo, hi = starts[i], starts[i + 1]
        source = size_from[i] if size_from else "sizes.json"
        while g < len(weights) and bounds[g + 1] <= lo:
            g += 1
        if size == 0:  # an empty shard still goes to a worker: the reader checks (and reports) it
            plans[min(g, len(weights) - 1)].append(ShardSlice(url, start=0, stop=0, size=0, size_from=source))
            continue
        for h in range(g, len(weights)):
            if bounds[h] >= hi:
                break
            a, b = max(lo, bounds[h]), min(hi, bounds[h + 1])
            if b > a:
                plans[h].append(ShardSlice(url, start=a - lo, stop=b - lo, size=size, size_from=source))
    return plans


def worker_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (seed, epoch, rank, worker, ...)."""
    h = 1469598103934665603
    for p in parts:
        for b in int(p).to_bytes(8, "little", signed=True):
            h = ((h ^ b) * 1099511628211) & ((1 << 64) - 1)
    return h >> 1
