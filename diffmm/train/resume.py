"""Where training stands, so ``fit --ckpt_path`` resumes exactly, from any checkpoint, again and again (what is
guaranteed and how: docs/fault_tolerance.md, "Exact resume").

One record, :class:`TrainingProgress`, is the source of truth: the data epoch, the batches trained in it and in
all, the optimizer step and every rank's RNG states. It counts trained batches itself, writes itself into every
checkpoint as ``checkpoint["progress"]`` and, on resume, sets Lightning's loop counters from it. The training data
follows the record: everything a shard stream yields in an epoch is a function of ``(seed, epoch, rank, worker)``
(with :class:`ResumableLoader`, the augmentations too), so a resumed epoch is replayed and its first ``batches``
batches dropped. Checkpoints written before the record resume from the training loader's saved data position.
"""
from __future__ import annotations

import copy
import logging
import math
import random
import warnings
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytorch_lightning as pl
import torch
import torch.distributed as dist

from diffmm.data.dist import worker_seed
from diffmm.data.stream import ShardLoader

log = logging.getLogger("diffmm.train")
_END = object()

#: the checkpoint key of :class:`TrainingProgress`'s record
PROGRESS_KEY = "progress"


def rng_states() -> dict[str, Any]:
    """This process's RNG states (torch, Python, NumPy, CUDA if initialised), loadable with ``weights_only=True``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` returned."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def set_loop_progress(fit_loop: dict, record: dict) -> None:
    """Set the counters of a checkpoint's ``loops["fit_loop"]`` to what Lightning saves at the end of a training
    batch of an uninterrupted run at ``record``'s position: mid-epoch after ``batches`` batches, or (``batches``
    0) epoch ``epoch`` not yet started, the previous one complete."""
    epoch, batches, total, step = (int(record[k]) for k in ("epoch", "batches", "total_batches", "global_step"))
    mid = int(batches > 0)
    epochs = {"ready": epoch + mid, "started": epoch + mid, "processed": epoch, "completed": epoch}
    fit_loop["epoch_progress"] = {"total": dict(epochs), "current": dict(epochs)}

    def done(n: int) -> dict:
        return {"ready": n, "started": n, "processed": n, "completed": n - mid}

    fit_loop["epoch_loop.batch_progress"] = {"total": done(total), "current": done(batches), "is_last_batch": False}
    fit_loop.setdefault("epoch_loop.state_dict", {})["_batches_that_stepped"] = step - mid


class TrainingProgress(pl.Callback):
    """The record of where training stands (module doc); the ``diffmm`` CLI always adds it.

    Attributes:
        epoch: the data epoch being trained (or about to start).
        batches: batches of ``epoch`` trained on this rank (``< epoch_batches``).
        total_batches: batches trained on this rank since the run began.
    """

    def __init__(self) -> None:
        self.epoch = self.batches = self.total_batches = 0
        self.epoch_batches: float = math.inf
        self.reshard: Optional[dict] = None  # the saved layout of an epoch interrupted on another world size
        self._rng: Optional[list] = None  # every rank's RNG states, restored when training starts

    def position(self) -> dict[str, Any]:
        """``{"epoch", "batches", "epoch_batches"}``: where the training data stands (and ``reshard`` while an
        epoch interrupted on another world size is finished: see :meth:`ResumableLoader._resharded`)."""
        pos = {"epoch": self.epoch, "batches": self.batches, "epoch_batches": self.epoch_batches}
        return {**pos, "reshard": self.reshard} if self.reshard else pos

    def _next_epoch(self) -> None:
        self.epoch, self.batches, self.reshard = self.epoch + 1, 0, None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.total_batches += 1
        self.batches += 1
        self.epoch_batches = trainer.num_training_batches
        if self.batches >= self.epoch_batches:
            self._next_epoch()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # an epoch that ran out of data before its length (no length; the rest of a resharded epoch) is over too;
        # one cut by a step limit or early stopping is not
        if self.batches and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._next_epoch()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        states = rng_states()
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            gathered: list = [None] * trainer.world_size
            dist.all_gather_object(gathered, states)  # every rank saves (Lightning writes on rank 0)
        else:
            gathered = [states]
        dm = trainer.datamodule
        record = {**self.position(), "total_batches": self.total_batches, "global_step": trainer.global_step,
                  "world_size": trainer.world_size, "batch_size": getattr(dm, "batch_size", None),
                  "num_workers": getattr(dm, "num_workers", None), "rng": gathered}
        checkpoint[PROGRESS_KEY] = record
        checkpoint["epoch"] = self.epoch
        if "fit_loop" in (checkpoint.get("loops") or {}):
            set_loop_progress(checkpoint["loops"]["fit_loop"], record)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        record = checkpoint.get(PROGRESS_KEY) or record_from_loader_state(checkpoint)
        if record is None:
            return
        self.epoch, self.batches = int(record["epoch"]), int(record["batches"])
        self.total_batches, self.epoch_batches = int(record["total_batches"]), record.get("epoch_batches", math.inf)
        self.reshard = record.get("reshard")
        world, now = int(record.get("world_size") or trainer.world_size), trainer.world_size
        workers = record.get("num_workers")
        moved = world != now or (workers is not None and workers != getattr(trainer.datamodule, "num_workers", workers))
        if moved and self.batches and math.isfinite(self.epoch_batches) and self.reshard is None:
            # finish the epoch from the saved layout: its W x (L - b) remaining batches, split over the new ranks
            per_epoch = int(self.epoch_batches)
            self.reshard = {"world_size": world, "batches": self.batches, "epoch_batches": per_epoch,
                            "num_workers": record.get("num_workers")}
            self.batches = per_epoch * world // now - (per_epoch - self.batches) * world // now
            record = {**record, "batches": self.batches}
            if trainer.is_global_zero:
                log.info("resume: a checkpoint of %d rank(s) x %s worker(s) on %d rank(s): the rest of epoch %d (%d "
                         "batches per rank of the saved layout) is split over the ranks now, each sample once", world,
                         workers, now, self.epoch, per_epoch - self.reshard["batches"])
        rng = record.get("rng")
        self._rng = rng if rng and len(rng) == trainer.world_size else None
        if rng and self._rng is None and trainer.is_global_zero:
            log.info("resume: the checkpoint has the RNG states of %d rank(s), this run has %d: RNGs start afresh",
                     len(rng), trainer.world_size)
        if "fit_loop" in (checkpoint.get("loops") or {}):
            set_loop_progress(checkpoint["loops"]["fit_loop"], record)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng is not None:
            set_rng_states(self._rng[trainer.global_rank])
            self._rng = None


def record_from_loader_state(checkpoint: dict) -> Optional[dict]:
    """The progress record of a checkpoint written before :class:`TrainingProgress` existed: its epoch and
    batches from the training loader's saved position (``None`` without one)."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    loaders = (fit.get("state_dict") or {}).get("combined_loader") or []
    if not loaders or "epoch" not in (loaders[0] or {}):
        return None
    pos = loaders[0]
    epoch, batches, per_epoch = int(pos["epoch"]), int(pos["batches"]), pos.get("epoch_batches", math.inf)
    if batches >= per_epoch:
        epoch, batches = epoch + 1, 0
    total = int(((fit.get("epoch_loop.batch_progress") or {}).get("total") or {}).get("processed", 0))
    return {"epoch": epoch, "batches": batches, "epoch_batches": per_epoch, "total_batches": total,
            "global_step": int(checkpoint.get("global_step", 0))}


class ResumableLoader:
    """Wraps a ``diffmm.data`` :class:`~diffmm.data.stream.ShardLoader` with an epoch-seeded, resumable iteration.

    Args:
        loader: the shard loader (``batch_size=None`` DataLoader over a ShardStream).
        seed: base seed of the augmentation RNG (the stream's own shuffles use its ``seed``).
        rank: this process's rank (mixed into the augmentation seed).
        progress: called when an epoch's iteration starts and by :meth:`state_dict`; returns where training
            stands, ``{"epoch", "batches", ...}`` (:meth:`TrainingProgress.position`). Without it the loader
            counts epochs itself (0, 1, ...; or from the position given to :meth:`load_state_dict`).
        signature: called by :meth:`state_dict`; settings that must match on resume (shards, batch size, world
            size, workers, seed), compared by :meth:`load_state_dict`.
    """

    def __init__(self, loader: Any, seed: int = 0, rank: int = 0,
                 progress: Optional[Callable[[], dict]] = None,
                 signature: Optional[Callable[[], dict]] = None) -> None:
        self.loader = loader
        self.seed, self.rank = seed, rank
        self.progress, self.signature = progress, signature
        self.epoch: int = -1          # epoch of the current / last iteration
        self.yielded = 0              # batches yielded (the replay included) in the current epoch
        self._pending: Optional[tuple[int, int]] = None  # (epoch, batches to skip) given to load_state_dict
        #: sample keys of the rows yielded this epoch, when the dataset emits ``(batch, keys)`` (``with_keys``)
        self.keys: list[str] = []

    # ----- Lightning's stateful-dataloader protocol (it also tells Lightning the loader resumes mid-epoch) ----
    def state_dict(self) -> dict:
        """``{"epoch", "batches", ...signature}``: where the stream stands; ``{}`` before the first epoch."""
        if self.progress is not None:
            pos = self.progress()
        elif self._pending is not None:
            pos = {"epoch": self._pending[0], "batches": self._pending[1]}
        elif self.epoch < 0:
            return {}
        else:
            pos = {"epoch": self.epoch, "batches": self.yielded}
        return {**pos, **(self.signature() if self.signature else {})}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from :meth:`state_dict`) with the next ``iter()``; warns if settings changed.
        With ``progress``, the position comes from it and ``state`` only tells what changed."""
        if not state:
            return
        if self.signature is not None:
            now = self.signature()
            followed = ("world_size", "num_workers") if self.progress is not None else ()  # TrainingProgress reshards
            changed = {k: (state[k], v) for k, v in now.items() if k in state and state[k] != v and k not in followed}
            if changed:
                log.warning("resume: data settings changed since the checkpoint (%s); the data position is "
                            "approximate", ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items()))
        self._pending = (int(state["epoch"]), int(state["batches"]))

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

    def _start(self) -> tuple[int, int, Optional[dict]]:
        """(epoch, batches to skip, the saved layout of a resharded epoch) of the iteration that starts now."""
        if self.progress is not None:
            pos = self.progress()
            self._pending = None
            return int(pos["epoch"]), int(pos["batches"]), pos.get("reshard")
        if self._pending is not None:
            (epoch, skip), self._pending = self._pending, None
            return epoch, skip, None
        return self.epoch + 1, 0, None

    def _epoch_batches(self, loader: Any, rank: int, epoch: int) -> Iterator[Any]:
        """Every batch of ``epoch`` that ``loader`` yields as rank ``rank``, augmentations seeded by both."""
        aug_seed = worker_seed(self.seed, epoch, rank, 0x5EED)
        in_process = getattr(loader, "num_workers", 0) == 0
        # the DataLoader draws the workers' base seed from this generator at iter() time (never the global RNG)
        loader.generator = torch.Generator().manual_seed(aug_seed)
        rng_state = torch.Generator().manual_seed(aug_seed).get_state()
        loader.set_epoch(epoch)
        it = iter(loader)
        while True:
            # in-process augmentations get their own, epoch-seeded RNG stream (the caller's is left as it was)
            with torch.random.fork_rng(devices=[], enabled=in_process):
                if in_process:
                    torch.set_rng_state(rng_state)
                batch = next(it, _END)
                rng_state = torch.get_rng_state()
            if batch is _END:
                return
            yield batch

    def _resharded(self, epoch: int, saved: dict) -> Iterator[Any]:
        """The rest of an epoch interrupted on ``saved["world_size"]`` ranks, on this world size: the saved ranks'
        streams are replayed (their rank, workers and seeds), their remaining batches taken in order (batch
        index, then saved rank) and dealt round-robin to the ranks now; every remaining sample is trained once,
        and fewer than one global batch is left out."""
        world, done, per_epoch = saved["world_size"], saved["batches"], saved["epoch_batches"]
        now = self.dataset.rank_world()[1]
        keep = (per_epoch - done) * world // now  # batches of each rank now
        streams = []
        for rank in range(world):
            ds = copy.copy(self.dataset)
            ds.rank, ds.world_size, ds._dist_snapshot = rank, world, None
            workers = self.loader.num_workers if saved.get("num_workers") is None else saved["num_workers"]
            streams.append(self._epoch_batches(ShardLoader(ds, num_workers=workers), rank, epoch))
        k = 0
        for i in range(per_epoch):
            for stream in streams:
                batch = next(stream, _END)
                if batch is _END or k >= keep * now:
                    return
                if i < done:
                    continue
                if k % now == self.rank % now:
                    yield batch
                k += 1

    def _iterate(self) -> Iterator[Any]:
        epoch, skip, saved = self._start()
        self.epoch, self.yielded = epoch, skip
        batches = self._resharded(epoch, saved) if saved else self._epoch_batches(self.loader, self.rank, epoch)
        if saved:
            skip = 0
        keyed = bool(getattr(self.dataset, "with_keys", False))
        self.keys = []
        n = 0
        for batch in batches:
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
