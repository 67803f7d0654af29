"""Data position of streaming (webdataset-style) training data, so ``fit --ckpt_path`` resumes mid-epoch exactly.

An iterable shard stream has no index to seek to, but everything it yields in an epoch is a
function of ``(seed, epoch, rank, worker)``: shard order, sample shuffles (``diffmm.data`` seeds them)
and, with :class:`ResumableLoader`, the random image augmentations too (the DataLoader's worker
seeds, or in-process the torch RNG, are derived from the same numbers). The position is then
``(epoch, batches consumed in that epoch)``:

* saved in every checkpoint by the data module (``state_dict``), with the batch count taken from
  the trainer's progress (the loader itself runs ahead because Lightning prefetches),
* restored by replaying the epoch and dropping the consumed batches (``load_state_dict`` then
  the next ``iter``). The replay costs reading and decoding those batches again, about the time
  the data loader needs for them, not the training step.

The resumed run sees exactly the batches the uninterrupted run would have seen, provided the
shards, batch size, world size, number of workers and seed are unchanged (checked on load).
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterator, Optional

import torch

from diffmm.data.dist import worker_seed

log = logging.getLogger("diffmm.train")


class ResumableLoader:
    """Wraps a ``diffmm.data`` :class:`~diffmm.data.stream.ShardLoader` with an epoch-seeded, resumable iteration.

    Args:
        loader: the shard loader (``batch_size=None`` DataLoader over a ShardStream).
        seed: base seed of the augmentation RNG (the stream's own shuffles use its ``seed``).
        rank: this process's rank (mixed into the augmentation seed).
        default_epoch: called at ``iter()`` time when no position was restored; returns the epoch
            to run (the data module passes the trainer's epoch).
    """

    def __init__(self, loader: Any, seed: int = 0, rank: int = 0,
                 default_epoch: Optional[Callable[[], int]] = None) -> None:
        self.loader = loader
        self.seed, self.rank = seed, rank
        self.default_epoch = default_epoch
        self.epoch: int = -1          # epoch of the current / last iteration
        self._pending: Optional[tuple[int, int]] = None  # (epoch, batches to skip) restored from a checkpoint
        self.skipped_on_resume = 0

    # ----- Lightning's iterable protocol ------------------------------------------------------
    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def set_position(self, epoch: int, batches: int) -> None:
        """Make the next ``iter()`` run ``epoch`` starting after ``batches`` batches."""
        self._pending = (int(epoch), int(batches))

    def __iter__(self) -> Iterator[Any]:
        # The epoch and start are decided at the first next(), not here: Lightning may create the
        # iterator before it restores the checkpoint (FSDP restores after setup).
        return self._iterate()

    def _start(self) -> tuple[int, int]:
        if self._pending is not None:
            (epoch, skip), self._pending = self._pending, None
        else:
            epoch = self.default_epoch() if self.default_epoch is not None else self.epoch + 1
            skip = 0
        self.epoch = epoch
        return epoch, skip

    def _iterate(self) -> Iterator[Any]:
        epoch, skip = self._start()
        aug_seed = worker_seed(self.seed, epoch, self.rank, 0x5EED)
        in_process = getattr(self.loader, "num_workers", 0) == 0
        if not in_process:
            # the DataLoader draws the workers' base seed from this generator at iter() time
            self.loader.generator = torch.Generator().manual_seed(aug_seed)
        rng_state = torch.Generator().manual_seed(aug_seed).get_state() if in_process else None
        self.loader.set_epoch(epoch)
        it = iter(self.loader)
        n = 0
        while True:
            if in_process:  # augmentations run here: give them their own, epoch-seeded RNG stream
                outer = torch.get_rng_state()
                torch.set_rng_state(rng_state)
                try:
                    batch = next(it)
                except StopIteration:
                    break
                finally:
                    rng_state = torch.get_rng_state()
                    torch.set_rng_state(outer)
            else:
                try:
                    batch = next(it)
                except StopIteration:
                    break
            n += 1
            if n <= skip:
                continue
            if n == skip + 1 and skip:
                self.skipped_on_resume = skip
                log.info("resumed data at epoch %d after %d batches (replayed and dropped)", epoch, skip)
            yield batch
        if n < skip:  # only when the data changed between save and resume
            warnings.warn(f"resume: epoch {epoch} has {n} batches, fewer than the {skip} already consumed", stacklevel=2)
