"""Base iterable dataset over webdataset shards: shard assignment, epochs, shuffling, batching.

A sample goes: tar reader (raw bytes per field) -> shuffle buffer -> the user's webdataset
``stages`` (:mod:`diffmm.data.stages`) -> :meth:`ShardStream._process` (decode into an item, or a
counted skip) -> :meth:`ShardStream._pack` (items into batch rows; sequence packing for text) ->
:meth:`ShardStream._collate` (rows into a batch). Subclasses define ``_process`` and ``_collate``.
Batches are built inside the DataLoader workers, so use ``batch_size=None`` in the DataLoader
(:class:`ShardLoader` does).

Epoch modes (docs/data.md, "Epoch modes and DDP"): ``resampled=True`` draws shards with replacement forever,
cut at a batch quota; ``equalize=True`` (training) gives every rank exactly ``len(dataset)`` batches, from one
contiguous sample range per rank x worker when shard sizes are known (:mod:`diffmm.data.sizes`; a worker that runs
short re-reads its range, ``samples_reread``), else from whole shards; ``equalize=False`` (evaluation) reads each
sample exactly once, disjoint over ranks and workers.
"""
from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import random
from typing import Any, Iterator, Sequence

import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset

from diffmm.data.dist import (ShardSlice, assign_shards, batch_quota, detect_rank_world, plan_ranges, worker_id_count,
                              worker_seed)
from diffmm.data.sizes import ShardCount, UnknownShardSize, shard_counts
from diffmm.data.stages import Handler, Stage, run_stages
from diffmm.data.stats import DataStats
from diffmm.data.tar_reader import MAX_MEMBER_BYTES, PIPE_TIMEOUT, ReadLimits, iter_tar_samples
from diffmm.data.urls import check_shards_exist, expand_sources

#: a worker that reads this many shards in a row without a single sample gives up (resampled mode)
MAX_BARREN_SHARDS = 200
#: in quota modes (which re-read data until the quota is met), this many skipped samples in a row stop the run
MAX_CONSECUTIVE_SKIPS = 1000


def shuffle_buffer(items: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """Shuffle a stream with a buffer of ``size`` items (reservoir-style swap)."""
    buf: list[Any] = []
    for x in items:
        if len(buf) < size:
            buf.append(x)
            continue
        i = rng.randrange(size)
        yield buf[i]
        buf[i] = x
    rng.shuffle(buf)
    yield from buf


class ShardStream(IterableDataset):
    """Batches from webdataset shards, correct under DDP and DataLoader workers.

    Args:
        urls: shard spec (brace expansion, ``pipe:``, ``::`` between sources).
        batch_size: items per batch (per rank).
        weights: per-source weights (resampled mode only).
        resampled: draw shards with replacement (see module doc).
        equalize: same batch count on every rank (ignored when resampled).
        samples_per_epoch: items per epoch over all ranks; default: the ``sizes.json`` total.
        shuffle: shuffle shards per epoch and samples through a buffer.
        shuffle_buffer: sample shuffle buffer size (raw samples, before decoding).
        seed: base seed; the epoch, rank and worker are mixed in.
        rank, world_size: override the detected distributed setup.
        name: used in logs.
        max_member_bytes: skip samples with a tar member larger than this (never read; ``None``: no cap).
        pipe_timeout: seconds a ``pipe:`` command may send nothing before it is killed (``None``: no limit).
        stages: webdataset pipeline stages run on each raw sample before decoding (``wds.map(f)``,
            ``wds.select(pred)``, ``wds.decode("pil")``, ...; see :mod:`diffmm.data.stages`).
        handler: what a stage's exception does, as in webdataset: ``wds.reraise_exception`` (default),
            ``wds.warn_and_continue`` / ``wds.ignore_and_continue`` (skip the sample, counted).
    """

    def __init__(self, urls: str | Sequence[str], batch_size: int, *, weights: Sequence[float] | None = None,
                 resampled: bool = False, equalize: bool = True, samples_per_epoch: int | None = None,
                 shuffle: bool = True, shuffle_buffer: int = 1000, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, name: str = "data", max_member_bytes: int | None = MAX_MEMBER_BYTES,
                 pipe_timeout: float | None = PIPE_TIMEOUT, stages: Sequence[Stage] = (),
                 handler: Handler = wds.reraise_exception) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sources = expand_sources(urls, weights)
        self.urls = [u for s in self.sources for u in s.urls]
        check_shards_exist(self.urls)
        if not resampled and len({s.weight for s in self.sources}) > 1:
            raise ValueError("source weights need resampled=True (finite epochs read every shard once)")
        self.batch_size = batch_size
        self.resampled = resampled
        self.equalize = equalize or resampled
        self._samples_per_epoch = samples_per_epoch
        self.shuffle = shuffle
        self.shuffle_buffer = shuffle_buffer if shuffle else 0
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size or neither")
        self.stats = DataStats(name)
        self.name = name
        self._epoch = mp.get_context().Value("q", -1)   # shared with workers; -1 = never set
        self._local_iters = 0
        self._dist_snapshot: tuple[int, int] | None = None
        self.limits = ReadLimits(max_member_bytes, pipe_timeout)
        self.stages, self.handler = tuple(stages), handler
        #: yield ``(batch, keys)`` with the sample key of every row (``diffmm predict`` uses it)
        self.with_keys = False
        self._counts: dict[str, ShardCount] | None = None
        self._counts_known: bool | None = None   # None: not looked up yet

    # ----- epochs and distributed setup -------------------------------------------------------
    def use_context(self, ctx) -> None:
        """Create the state shared with DataLoader workers (epoch, counters) in multiprocessing context ``ctx``."""
        self._epoch = ctx.Value("q", self._epoch.value)
        self.stats.use_context(ctx)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (changes shard order, shuffles and resampling); visible to running workers."""
        self._epoch.value = int(epoch)

    def rank_world(self) -> tuple[int, int]:
        """(rank, world size): explicit arguments, else the main-process snapshot, else detected now."""
        if self.rank is not None:
            return self.rank, self.world_size  # type: ignore[return-value]
        if self._dist_snapshot is not None:
            return self._dist_snapshot
        return detect_rank_world()

    def __getstate__(self) -> dict:
        # Pickled in the main process when workers are spawned: record the rank there, because a
        # spawned worker has no torch.distributed and (under Lightning) no RANK variable.
        state = self.__dict__.copy()
        if self.rank is None and state["_dist_snapshot"] is None:
            state["_dist_snapshot"] = detect_rank_world()
        return state

    # ----- epoch length -----------------------------------------------------------------------
    def shard_counts(self) -> dict[str, ShardCount] | None:
        """Samples per shard (looked up, or counted and cached, on first use); ``None`` if unknowable."""
        if self._counts_known is None:
            try:
                self._counts = shard_counts(self.urls, progress=self.rank_world()[0] == 0)
                self._counts_known = True
            except UnknownShardSize:
                self._counts, self._counts_known = None, False
        return self._counts

    @property
    def samples_per_epoch(self) -> int:
        """Items per epoch over all ranks (explicit, else the shards' sample counts)."""
        if self._samples_per_epoch is None:
            counts = self.shard_counts()
            if counts is None:
                raise ValueError(f"{self.name}: the number of samples of {self.urls[0]!r} is unknown (not a local "
                                 "shard); pass samples_per_epoch")
            self._samples_per_epoch = sum(c.samples for c in counts.values())
        return self._samples_per_epoch

    def __len__(self) -> int:
        """Batches this rank yields per epoch (exact in quota modes and for finite image streams)."""
        _, world = self.rank_world()
        if self.equalize:
            return self.samples_per_epoch // (self.batch_size * world)
        return self._finite_len()

    def _finite_len(self) -> int:
        rank, world = self.rank_world()
        n_workers = max(1, getattr(self, "_num_workers_hint", 1))
        if self.shard_counts() is None:
            raise ValueError(f"{self.name}: the number of samples of {self.urls[0]!r} is unknown (not a local "
                             "shard); the length of a finite stream needs local shards")
        total = 0
        for w in range(n_workers):   # with known counts every slice is a sample range of plan_ranges
            samples = sum(sl.stop - sl.start for sl in self._slices(list(self.urls), rank, world, w, n_workers))
            total += math.ceil(samples / self.batch_size)
        return total

    def _slices(self, urls: list[str], rank: int, world: int, worker: int, n_workers: int) -> list[ShardSlice]:
        """This worker's shard slices for an epoch whose shard order is ``urls``."""
        counts = self.shard_counts()
        if counts is None:
            return assign_shards(urls, rank, world, worker, n_workers)
        if self.equalize:
            weights = [batch_quota(self.samples_per_epoch, self.batch_size, world, n_workers, w)[1]
                       for _ in range(world) for w in range(n_workers)]
        else:
            weights = [1] * (world * n_workers)
        plans = plan_ranges(urls, [counts[u].samples for u in urls], weights, [counts[u].source for u in urls])
        mine = plans[rank * n_workers + worker]
        if self.equalize and not mine and weights[rank * n_workers + worker] > 0:
            # an explicit samples_per_epoch larger than the data: this worker repeats the whole set
            mine = [ShardSlice(u, size=counts[u].samples, size_from=counts[u].source) for u in urls]
        return mine

    # ----- iteration --------------------------------------------------------------------------
    def _resampled_slices(self, rng: random.Random) -> Iterator[ShardSlice]:
        weights = [s.weight for s in self.sources]
        while True:
            src = rng.choices(self.sources, weights=weights)[0]
            yield ShardSlice(rng.choice(src.urls))

    def _passes(self, mine: list[ShardSlice], rng: random.Random, produced: list[int]) -> Iterator[dict]:
        """Raw samples of this worker's shards, shuffled within each pass; repeated passes if equalizing.

        Shuffling per pass (not across passes) means a worker yields all of its samples once
        before it repeats any, whatever the buffer size.
        """
        for n_pass in itertools.count():
            before = produced[0]
            order = list(mine)
            if self.shuffle:
                rng.shuffle(order)
            samples = self._raw_samples(iter(order), produced, first_read=n_pass == 0)
            if self.shuffle_buffer > 1:
                samples = shuffle_buffer(samples, self.shuffle_buffer, rng)
            if n_pass == 0:
                yield from samples
            else:
                for sample in samples:
                    self.stats.add("samples_reread")
                    yield sample
            if not self.equalize:
                return
            if produced[0] == before:
                raise RuntimeError(f"{self.name}: no sample at all in this worker's shards "
                                   f"{[s.url for s in mine][:4]}; cannot fill the epoch (see the shard counts)")

    def _raw_samples(self, slices: Iterator[ShardSlice], produced: list[int], first_read: bool = True
                     ) -> Iterator[dict]:
        barren = 0
        for sl in slices:
            before = produced[0]
            for sample in iter_tar_samples(sl.url, self.stats, sl.offset, sl.stride, start=sl.start, stop=sl.stop,
                                           expected=sl.size, expected_from=sl.size_from, limits=self.limits,
                                           first_read=first_read):
                produced[0] += 1
                yield sample
            barren = barren + 1 if produced[0] == before else 0
            if self.resampled and barren >= MAX_BARREN_SHARDS:
                raise RuntimeError(f"{self.name}: {barren} shards in a row gave no usable sample (last: {sl.url})")

    def _process(self, sample: dict) -> Any | None:
        """Turn one raw sample into an item, or count a skip and return ``None``."""
        raise NotImplementedError

    def _keyed_items(self, samples: Iterator[dict]) -> Iterator[tuple[str, Any]]:
        """``(sample key, item)`` for each raw sample that the stages keep and :meth:`_process` turns into
        an item; counts ``samples_in``, ``samples_out`` and (through the two) every skip."""
        skips = 0
        for sample in samples:
            self.stats.add("samples_in")
            if self.stages:
                sample = run_stages(sample, self.stages, self.handler, self.stats)
            item = None if sample is None else self._process(sample)
            if item is None:
                skips += 1
                if self.equalize and skips >= MAX_CONSECUTIVE_SKIPS:
                    raise RuntimeError(f"{self.name}: {skips} samples in a row were skipped; giving up "
                                       f"({self.stats.summary()})")
                continue
            skips = 0
            self.stats.add("samples_out")
            yield sample["__key__"], item

    def _pack(self, items: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``(key, batch row)`` from ``(sample key, item)``: one row per item here; subclasses may regroup."""
        return items

    def _collate(self, items: list[Any]) -> Any:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        rank, world = self.rank_world()
        worker, n_workers = worker_id_count()
        epoch = self._epoch.value if self._epoch.value >= 0 else self._local_iters
        self._local_iters += 1
        rng = random.Random(worker_seed(self.seed, epoch, rank, worker))
        produced = [0]
        if self.resampled:
            samples = self._raw_samples(self._resampled_slices(rng), produced)
            if self.shuffle_buffer > 1:
                samples = shuffle_buffer(samples, self.shuffle_buffer, rng)
        else:
            urls = list(self.urls)
            if self.shuffle:
                random.Random(worker_seed(self.seed, epoch)).shuffle(urls)  # same order on every rank
            mine = self._slices(urls, rank, world, worker, n_workers)
            samples = self._passes(mine, rng, produced)
        quota = None
        if self.equalize:
            quota = batch_quota(self.samples_per_epoch, self.batch_size, world, n_workers, worker)[1]
            if quota == 0:
                return
        batch: list[Any] = []
        keys: list[str] = []
        n_batches = 0
        for key, item in self._pack(self._keyed_items(samples)):
            batch.append(item)
            keys.append(key)
            if len(batch) == self.batch_size:
                yield self._emit(batch, keys)
                batch, keys = [], []
                n_batches += 1
                if quota is not None and n_batches >= quota:
                    return
        if batch and quota is None:
            yield self._emit(batch, keys)

    def _emit(self, items: list[Any], keys: list[str]) -> Any:
        batch = self._collate(items)
        return (batch, keys) if self.with_keys else batch


class ShardLoader(DataLoader):
    """DataLoader for a :class:`ShardStream` (batches come from the workers).

    Each ``iter(loader)`` starts a new epoch: it sets the dataset's epoch (the next integer, or
    the value given to :meth:`set_epoch`), keeps the last epoch's counters in
    :attr:`last_epoch_stats` and zeroes the counters.
    """

    def __init__(self, dataset: ShardStream, num_workers: int = 0, **kwargs: Any) -> None:
        kwargs.setdefault("persistent_workers", False)
        kwargs.setdefault("pin_memory", False)
        super().__init__(dataset, batch_size=None, num_workers=num_workers, **kwargs)
        if num_workers > 0 and self.multiprocessing_context is not None:
            dataset.use_context(self.multiprocessing_context)  # shared state must come from the workers' context
        dataset._num_workers_hint = max(1, num_workers)
        self._next_epoch = 0
        self.last_epoch_stats: dict[str, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch``."""
        self._next_epoch = int(epoch)

    def __iter__(self):  # type: ignore[override]
        ds: ShardStream = self.dataset  # type: ignore[assignment]
        if not ds.resampled:
            ds.shard_counts()  # look up / count once here, not in every worker
        self.last_epoch_stats = ds.stats.snapshot()
        ds.stats.reset()
        ds.set_epoch(self._next_epoch)
        self._next_epoch += 1
        return super().__iter__()

