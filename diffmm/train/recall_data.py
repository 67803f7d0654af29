"""LightningDataModule of generated associative-recall data (MQAR): no files, every batch rebuilt from its seed.

    data:
      class_path: diffmm.train.recall_data.RecallDataModule
      init_args: {seq_lens: [64, 128], num_pairs: [4, 8, 16], noise: 1.0, batch_size: 32}

Training batches mix the settings of the grid ``seq_lens x num_pairs`` (combinations that do not
fit are left out) or an explicit ``tasks`` list; validation uses a fixed set of ``val_examples``
sequences per setting, drawn from a stream disjoint from training. The training position (batches
consumed) is saved in checkpoints, so ``fit --ckpt_path`` resumes with the very next batch.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import pytorch_lightning as pl
import torch

from diffmm.data.recall import RecallStream, RecallTask, eval_batches, task_grid
from diffmm.train.errors import ConfigError

log = logging.getLogger("diffmm.train")


def _grid(vocab_size: int, grid: dict, what: str) -> list[RecallTask]:
    try:
        tasks, skipped = task_grid(vocab_size, **grid)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from None
    if skipped:
        log.info("%s: left out %d setting(s) that do not fit: %s", what, len(skipped), ", ".join(skipped))
    return tasks


class _FixedBatches:
    """A fixed list of batches as one loader (a bare list would be read as one loader per batch)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


class RecallDataModule(pl.LightningDataModule):
    """Generated MQAR batches ``{"inputs", "targets"}`` for :class:`~diffmm.train.recall_module.RecallLMModule`.

    Args:
        vocab_size: task vocabulary; default (None) the model's ``vocab_size``.
        seq_lens, num_pairs: the training grid.
        noise: distractor level (probability of a random key/value token on a filler position).
        num_queries: queries per sequence (capped at the pairs); None = every pair.
        query_power: query-offset law exponent (Zoology 0.01; 1 = uniform).
        tasks: explicit training settings (dicts of :class:`~diffmm.data.recall.RecallTask` fields, the
            vocabulary filled in); replaces the grid.
        weights: mixture weights of the training settings (default uniform).
        val_seq_lens, val_num_pairs: validation grid (default the training grid).
        val_examples: validation sequences per setting.
        batch_size, val_batch_size: sequences per batch.
        batch_tokens: when set, training batches hold ``batch_tokens // seq_len`` sequences of their setting
            (the same tokens per step for every length) instead of ``batch_size``.
        num_workers: DataLoader workers (generation is cheap: 0 runs it in the training process).
        seed: data seed (training stream and validation set).
        context_length, tokenizer: linked from the model by the CLI; the longest sequence must fit
            ``context_length``.
    """

    def __init__(self, vocab_size: Optional[int] = None, seq_lens: list[int] = (64, 128),
                 num_pairs: list[int] = (4, 8, 16), noise: float = 1.0, num_queries: Optional[int] = None,
                 query_power: float = 0.01, tasks: Optional[list[dict]] = None, weights: Optional[list[float]] = None,
                 val_seq_lens: Optional[list[int]] = None, val_num_pairs: Optional[list[int]] = None,
                 val_examples: int = 256, batch_size: int = 32, val_batch_size: Optional[int] = None,
                 batch_tokens: Optional[int] = None, num_workers: int = 0, seed: int = 0,
                 context_length: Optional[int] = None, tokenizer: Optional[str] = None) -> None:
        super().__init__()
        if batch_size < 1 or (val_batch_size is not None and val_batch_size < 1):
            raise ConfigError(f"data.batch_size / val_batch_size must be >= 1, got {batch_size} / {val_batch_size}")
        if val_examples < 0:
            raise ConfigError(f"data.val_examples must be >= 0, got {val_examples}")
        self.vocab_size = vocab_size
        self.grid = dict(seq_lens=list(seq_lens), num_pairs=list(num_pairs), noise=float(noise),
                         num_queries=num_queries, query_power=float(query_power))
        self.task_dicts, self.weights = tasks, weights
        self.val_grid = dict(self.grid, seq_lens=list(val_seq_lens or seq_lens),
                             num_pairs=list(val_num_pairs or num_pairs))
        self.val_examples, self.batch_size = int(val_examples), int(batch_size)
        self.val_batch_size = int(val_batch_size or batch_size)
        if batch_tokens is not None and batch_tokens < 1:
            raise ConfigError(f"data.batch_tokens must be >= 1, got {batch_tokens}")
        self.batch_tokens = batch_tokens
        self.num_workers, self.seed, self.context_length = int(num_workers), int(seed), context_length
        self.train_tasks: list[RecallTask] = []
        self.val_tasks: list[RecallTask] = []
        self._start = 0  # training batches of this rank already consumed (restored from a checkpoint)
        if vocab_size is not None:
            self._build(vocab_size)

    # ----- settings -----------------------------------------------------------------------------
    def _build(self, vocab_size: int) -> None:
        if self.task_dicts:
            try:
                self.train_tasks = [RecallTask.from_dict({"vocab_size": vocab_size, **dict(t)},
                                                         source=f"data.tasks[{i}]")
                                    for i, t in enumerate(self.task_dicts)]
            except (TypeError, ValueError) as e:
                raise ConfigError(str(e)) from None
        else:
            self.train_tasks = _grid(vocab_size, self.grid, "data")
        self.val_tasks = _grid(vocab_size, self.val_grid, "data.val") if self.val_examples else []
        if self.weights is not None and len(self.weights) != len(self.train_tasks):
            raise ConfigError(f"data.weights has {len(self.weights)} entries for {len(self.train_tasks)} training "
                              f"settings ({', '.join(t.name for t in self.train_tasks)})")
        longest = max(t.seq_len for t in self.train_tasks + self.val_tasks)
        if self.context_length is not None and longest > self.context_length:
            raise ConfigError(f"data: sequences of {longest} tokens exceed the model's context_length "
                              f"{self.context_length} (raise model block_size)")

    def setup(self, stage: Optional[str] = None) -> None:
        model = getattr(getattr(self.trainer, "lightning_module", None), "model", None) if self.trainer else None
        model_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if self.vocab_size is None:
            if model_vocab is None:
                raise ConfigError("data.vocab_size is not set and the model has no config.vocab_size")
            self.vocab_size = int(model_vocab)
            self._build(self.vocab_size)
        elif not self.train_tasks:
            self._build(self.vocab_size)
        if model_vocab is not None and self.vocab_size > model_vocab:
            raise ConfigError(f"data.vocab_size {self.vocab_size} exceeds the model's vocab_size {model_vocab}")

    def _world(self) -> tuple[int, int]:
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        return 0, 1

    # ----- loaders ------------------------------------------------------------------------------
    def train_dataloader(self):
        if not self.train_tasks:
            self.setup("fit")
        rank, world = self._world()
        ds = RecallStream(self.train_tasks, self.batch_size, seed=self.seed, weights=self.weights, rank=rank,
                          world_size=world, start=self._start, batch_tokens=self.batch_tokens)
        self._start = 0
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=self.num_workers)

    def _eval_loader(self):
        if self.val_examples == 0:
            return []
        if not self.val_tasks:
            self.setup("validate")
        rank, world = self._world()
        batches = [b.as_training() for t in self.val_tasks
                   for b in eval_batches(t, self.val_examples, self.val_batch_size, self.seed)]
        return _FixedBatches(batches[rank::world])

    def val_dataloader(self):
        return self._eval_loader()

    def test_dataloader(self):
        return self._eval_loader()

    def predict_dataloader(self):
        return self._eval_loader()

    # ----- data position in checkpoints ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.trainer is None:
            return {}
        done = int(self.trainer.fit_loop.epoch_loop.batch_progress.total.processed)
        return {"batches": done, "seed": self.seed, "batch_size": self.batch_size, "batch_tokens": self.batch_tokens,
                "tasks": [t.name for t in self.train_tasks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        for key, now in (("seed", self.seed), ("batch_size", self.batch_size), ("batch_tokens", self.batch_tokens),
                         ("tasks", [t.name for t in self.train_tasks] or state.get("tasks"))):
            if key in state and state[key] != now:
                log.warning("resume: data.%s changed since the checkpoint (%s -> %s); the batches differ from "
                            "the uninterrupted run", key, state[key], now)
        self._start = int(state.get("batches", 0))
