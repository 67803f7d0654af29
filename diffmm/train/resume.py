"""Data position of streaming (webdataset-style) training data, so ``fit --ckpt_path`` resumes mid-epoch exactly.

An iterable shard stream has no index to seek to, but everything it yields in an epoch is a
function of ``(seed, epoch, rank, worker)``: shard order, sample shuffles (``diffmm.data`` seeds them)
and, with :class:`ResumableLoader`, the random image augmentations too (the DataLoader's worker
seeds, or in-process the torch RNG, are derived from the same numbers). The position is then
``(epoch, batches consumed in that epoch)``:

* saved in every checkpoint through Lightning's stateful-dataloader protocol: Lightning calls the
  training loader's ``state_dict()`` when it saves (stored under the fit loop's
  ``combined_loader`` state) and ``load_state_dict()`` when ``fit --ckpt_path`` restores it, so it
  also knows the loader is resumable mid-epoch. The batch count comes from the trainer's progress
  (the data module passes it in as ``position``), because the loader itself runs ahead while
  Lightning prefetches,
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
_END = object()


class ResumableLoader:
    """Wraps a ``diffmm.data`` :class:`~diffmm.data.stream.ShardLoader` with an epoch-seeded, resumable iteration.

    Args:
        loader: the shard loader (``batch_size=None`` DataLoader over a ShardStream).
        seed: base seed of the augmentation RNG (the stream's own shuffles use its ``seed``).
        rank: this process's rank (mixed into the augmentation seed).
        default_epoch: called at ``iter()`` time when no position was restored; returns the epoch
            to run (the data module passes the trainer's epoch).
        position: called by :meth:`state_dict`; returns ``{"epoch", "batches"}`` (batches consumed;
            the data module passes the trainer's progress, plus ``epoch_batches``); default: what
            this loader has yielded.
        signature: called by :meth:`state_dict`; settings that must match on resume (shards, batch
            size, world size, workers, seed), compared by :meth:`load_state_dict`.
    """

    def __init__(self, loader: Any, seed: int = 0, rank: int = 0,
                 default_epoch: Optional[Callable[[], int]] = None,
                 position: Optional[Callable[[], dict]] = None,
                 signature: Optional[Callable[[], dict]] = None) -> None:
        self.loader = loader
        self.seed, self.rank = seed, rank
        self.default_epoch = default_epoch
        self.position, self.signature = position, signature
        self.epoch: int = -1          # epoch of the current / last iteration
        self.yielded = 0              # batches yielded (the replay included) in the current epoch
        self._pending: Optional[tuple[int, int]] = None  # (epoch, batches to skip) restored from a checkpoint
        #: sample keys of the rows yielded this epoch, when the dataset emits ``(batch, keys)`` (``with_keys``)
        self.keys: list[str] = []

    # ----- Lightning's stateful-dataloader protocol -------------------------------------------
    def state_dict(self) -> dict:
        """``{"epoch", "batches", ...signature}``: where the stream stands; ``{}`` before the first epoch."""
        if self._pending is not None and self.epoch < 0:  # restored but not iterated yet: keep that position
            pos = {"epoch": self._pending[0], "batches": self._pending[1]}
        elif self.epoch < 0:
            return {}
        elif self.position is not None:
            pos = self.position()
        else:
            pos = {"epoch": self.epoch, "batches": self.yielded}
        return {**pos, **(self.signature() if self.signature else {})}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from :meth:`state_dict`) with the next ``iter()``; warns if settings changed."""
        if not state:
            return
        if self.signature is not None:
            now = self.signature()
            changed = {k: (state[k], v) for k, v in now.items() if k in state and state[k] != v}
            if changed:
                log.warning("resume: data settings changed since the checkpoint (%s); the data position is "
                            "approximate", ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items()))
        self._pending = (int(state["epoch"]), int(state["batches"]))  # taken by the next iter()

    # ----- Lightning's iterable protocol ------------------------------------------------------
    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def __iter__(self) -> Iterator[Any]:
        # The epoch and start are decided at the first next(), not here: Lightning may create the
        # iterator before it restores the checkpoint (FSDP restores after setup).
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        if self._pending is not None:
            (epoch, skip), self._pending = self._pending, None
        else:
            epoch, skip = self.default_epoch() if self.default_epoch is not None else self.epoch + 1, 0
        self.epoch, self.yielded = epoch, skip
        aug_seed = worker_seed(self.seed, epoch, self.rank, 0x5EED)
        in_process = getattr(self.loader, "num_workers", 0) == 0
        if not in_process:
            # the DataLoader draws the workers' base seed from this generator at iter() time
            self.loader.generator = torch.Generator().manual_seed(aug_seed)
        rng_state = torch.Generator().manual_seed(aug_seed).get_state()
        self.loader.set_epoch(epoch)
        keyed = bool(getattr(self.dataset, "with_keys", False))
        self.keys = []
        it = iter(self.loader)
        n = 0
        while True:
            # in-process augmentations get their own, epoch-seeded RNG stream (the caller's is left as it was)
            with torch.random.fork_rng(devices=[], enabled=in_process):
                if in_process:
                    torch.set_rng_state(rng_state)
                batch = next(it, _END)
                rng_state = torch.get_rng_state()
            if batch is _END:
                break
            n += 1
            if keyed:
                batch, keys = batch
            if n <= skip:
                continue
            if keyed:
                self.keys.extend(keys)
            if n == skip + 1 and skip:
                log.info("resumed data at epoch %d after %d batches (replayed and dropped)", epoch, skip)
            self.yielded = n
            yield batch
        if n < skip:  # only when the data changed between save and resume
            warnings.warn(f"resume: epoch {epoch} has {n} batches, fewer than the {skip} already consumed",
                          stacklevel=2)
