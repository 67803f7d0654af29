"""Callbacks the ``diffmm`` CLI always adds: checkpoints that extend runs cleanly, the non-finite-loss guard, data
counters per epoch, a prediction writer and a progress bar with real step counts."""
from __future__ import annotations

import glob
import logging
import math
import os
from typing import Any, Literal, Optional, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter, ModelCheckpoint, TQDMProgressBar

from diffmm.train.checkpoint_io import AtomicCheckpointIO, atomic_save, remove_stale_temporaries
from diffmm.train.errors import TrainingDiverged

log = logging.getLogger("diffmm.train")


class DataStatsMonitor(pl.Callback):
    """Logs the data pipeline's counters (samples in/out, skips by reason, shard problems) per epoch.

    Counters are summed over ranks; a one-line summary goes to the log on rank 0.
    """

    def _report(self, trainer: pl.Trainer, stage: str) -> None:
        dm = trainer.datamodule
        stats = dm.data_stats(stage) if dm is not None and hasattr(dm, "data_stats") else None
        if stats is None:
            return
        counts = stats.all_reduce()
        if trainer.is_global_zero:
            log.info("epoch %d %s", trainer.current_epoch, stats.summary(counts))
        skipped = sum(v for k, v in counts.items() if k.startswith("skip_"))
        metrics = {f"data_{stage}/samples_in": counts.get("samples_in", 0),
                   f"data_{stage}/samples_out": counts.get("samples_out", 0), f"data_{stage}/skipped": skipped}
        metrics.update({f"data_{stage}/{k}": v for k, v in counts.items()
                        if v and (k.startswith("skip_") or k in ("shards_failed", "shards_truncated", "shards_empty",
                                                                 "shards_miscounted", "samples_reread"))})
        for logger in trainer.loggers:
            logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=trainer.global_step)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, "train")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._report(trainer, "val")


class PredictionWriter(BasePredictionWriter):
    """Writes ``predict`` outputs of each rank to ``<output_dir>/predictions_rank<R>.pt``.

    Each file holds a dict of tensors concatenated over batches (e.g. ``image_features``,
    ``text_features`` for CLIP; ``nll``, ``next_token_accuracy`` for LMs); the per-batch
    ``similarity`` matrices of CLIP are kept as a list; ``keys`` (when the data module provides
    ``predict_keys()``) lists the sample key of every row, in the same order.

    Args:
        output_dir: folder; default: the trainer's log dir (or ``default_root_dir``).
    """

    def __init__(self, output_dir: Optional[str] = None) -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = output_dir

    def write_on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Sequence[Any],
                           batch_indices: Optional[Sequence[Any]]) -> None:
        preds = predictions[0] if predictions and isinstance(predictions[0], list) else predictions
        if not preds:
            return
        out: dict[str, Any] = {}
        for key in preds[0]:
            values = [p[key] for p in preds]
            out[key] = values if key == "similarity" else torch.cat(values)
        keys = getattr(trainer.datamodule, "predict_keys", None)
        if callable(keys):
            rows = next((v.shape[0] for v in out.values() if torch.is_tensor(v) and v.dim() > 0), None)
            out["keys"] = keys()[:rows]
        path = os.path.join(self.output_dir or trainer.log_dir or trainer.default_root_dir,
                            f"predictions_rank{trainer.global_rank}.pt")
        atomic_save(out, path)
        log.info("wrote %s (%s)", path, ", ".join(f"{k}: {tuple(v.shape) if torch.is_tensor(v) else len(v)}"
                                                  for k, v in out.items()))


class NonFiniteGuard(pl.Callback):
    """Stops training (default) or skips the update when the loss is NaN or Inf.

    The loss of every (micro-)batch is checked before backward; the decision is taken before the
    optimizer step (one device sync per step, and one small all-reduce under DDP/FSDP so every rank
    agrees). Nothing is updated with non-finite gradients.

    Args:
        action: ``stop``: raise :class:`~diffmm.train.errors.TrainingDiverged` naming the step and the
            last good checkpoint (``diffmm fit`` exits with status 3 and writes no further checkpoint).
            ``skip``: drop the update (gradients are cleared before the optimizer step; the step counter
            and the lr schedule still advance), log ``train/skipped_steps`` and a warning, and stop as
            above once more than ``max_skips`` steps were skipped.
        max_skips: most steps ``skip`` may drop in a run (counted across resumes: saved in checkpoints).
    """

    def __init__(self, action: Literal["stop", "skip"] = "stop", max_skips: int = 10) -> None:
        if action not in ("stop", "skip"):
            raise ValueError(f"nonfinite.action must be 'stop' or 'skip', got {action!r}")
        if max_skips < 0:
            raise ValueError(f"nonfinite.max_skips must be >= 0, got {max_skips}")
        self.action, self.max_skips = action, int(max_skips)
        self.skipped = 0
        self._bad: Optional[torch.Tensor] = None   # any non-finite loss since the last optimizer step (on device)
        self._loss: Optional[torch.Tensor] = None  # the first non-finite loss of the step

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        loss = loss.detach()
        bad = ~torch.isfinite(loss).all()
        value = loss.float().reshape(-1)[0] if loss.numel() else torch.tensor(math.nan, device=loss.device)
        if self._bad is None:
            self._bad, self._loss = bad, value
        else:  # gradient accumulation: remember the first non-finite value of the step
            self._loss = torch.where(self._bad, self._loss, value)
            self._bad = self._bad | bad

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self._bad is None:
            return
        bad, self._bad = bool(self._bad), None
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)  # any rank
        if not bad:
            return
        value = self._loss.item() if self._loss is not None else math.nan
        value = value if not math.isfinite(value) else "on another rank"  # this rank's loss was fine
        step = trainer.global_step
        if self.action == "skip" and self.skipped < self.max_skips:
            self.skipped += 1
            optimizer.zero_grad(set_to_none=True)  # AdamW leaves parameters without gradients untouched
            if trainer.is_global_zero:
                log.warning("step %d: non-finite loss (%s); update skipped (%d of at most %d, nonfinite.max_skips)",
                            step, value, self.skipped, self.max_skips)
            pl_module.log("train/skipped_steps", float(self.skipped), on_step=True, on_epoch=False,
                          rank_zero_only=True)
            return
        # the newest checkpoint this run wrote (only rank 0 writes), else the one it resumed from
        io = trainer.strategy.checkpoint_io
        saved = io.last_saved if isinstance(io, AtomicCheckpointIO) else None
        path, saved_step = trainer.strategy.broadcast(saved) or (trainer.ckpt_path, None)
        good = (f"last good checkpoint: {path}" + (f" (step {saved_step})" if saved_step is not None else "")
                if path and os.path.exists(str(path)) else f"no checkpoint was written before step {step}")
        what = (f"non-finite loss ({value}) at step {step}, after {self.skipped} skipped step(s) "
                f"(nonfinite.max_skips={self.max_skips})" if self.action == "skip"
                else f"non-finite loss ({value}) at step {step} (epoch {trainer.current_epoch})")
        hint = ("Lower the lr, or raise --nonfinite.max_skips" if self.action == "skip"
                else "Lower the lr, or skip such steps with --nonfinite.action skip")
        raise TrainingDiverged(f"{what}: training stopped before the update; {good}. {hint}")

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))


class Checkpoint(ModelCheckpoint):
    """ModelCheckpoint with diffmm's rules.

    * ``last.ckpt`` is also refreshed when training ends between two periodic saves.
    * No checkpoint is written while the weights or the optimizer state hold NaN or Inf, and none is deleted to
      make room meanwhile (the rule of :class:`~diffmm.train.checkpoint_io.AtomicCheckpointIO`, which the CLI
      installs); no checkpoint at all after the run diverged (:class:`NonFiniteGuard`).
    * At the start of ``fit``, temporary files a killed save left in the folder are removed (when their process is
      gone), and so is an older checkpoint a save killed before it removed it (``save_top_k: 1``).
    """

    saved_at_step = -1  # global step of the newest checkpoint the trainer wrote in this run

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and trainer.is_global_zero:
            remove_stale_temporaries(str(self.dirpath or ""))
            remove_stale_temporaries(trainer.default_root_dir)  # SLURM's hpc_ckpt_* are written there

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_older(trainer)

    def _remove_older(self, trainer: pl.Trainer) -> None:
        """Keep-one checkpoints (``save_top_k: 1``, no monitor): remove older ones, which a save killed between
        writing its file and removing the previous one left behind (Lightning forgets them on resume), and the one
        the run resumed from (Lightning never removes it), at the start and at the end of ``fit``."""
        best, folder = self.best_model_path, os.path.realpath(str(self.dirpath or ""))
        if not (trainer.is_global_zero and self.monitor is None and self.save_top_k == 1 and best
                and os.path.isfile(best) and os.path.dirname(os.path.realpath(best)) == folder):
            return
        newest = os.path.getmtime(best)
        for path in sorted(glob.glob(os.path.join(folder, f"*{self.FILE_EXTENSION}"))):
            name = os.path.basename(path)
            if os.path.realpath(path) != os.path.realpath(best) and not name.startswith(
                    (self.CHECKPOINT_NAME_LAST, "hpc_ckpt_")) and os.path.getmtime(path) < newest:
                trainer.strategy.remove_checkpoint(path)
                log.info("removed %s: an older checkpoint than %s (checkpoint.save_top_k 1)", path, best)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.saved_at_step = trainer.global_step

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, TrainingDiverged):
            super().on_exception(trainer, pl_module, exception)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and self.saved_at_step != trainer.global_step:
            name = f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
            self.last_model_path = self.last_model_path or os.path.join(str(self.dirpath), name)
            trainer.save_checkpoint(self.last_model_path, self.save_weights_only)
        self._remove_older(trainer)


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar with real step counts in step-limited runs (``max_steps``).

    * The epoch bar's total is the batches this run will still take in the epoch, counted from where the epoch
      (or a mid-epoch resume) started, so a resumed or extended run shows e.g. ``4/6``, never ``6/3``.
    * The global ``step S/max_steps`` among the bar's metrics.
    """

    _offset, _step0 = 0, 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a mid-epoch resume does not call on_train_epoch_start: count from the restored position
        self._offset = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        self._step0 = trainer.global_step
        super().on_train_start(trainer, pl_module)
        if trainer.fit_loop.restarted_mid_epoch:
            bar = self.train_progress_bar
            bar.reset(total=self.total_train_batches)
            bar.initial = bar.n = self._offset
            bar.set_description(f"Epoch {trainer.current_epoch}")

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._offset, self._step0 = 0, trainer.global_step
        super().on_train_epoch_start(trainer, *args)

    @property
    def total_train_batches(self) -> float:
        t = self.trainer
        if t.max_steps < 1:  # not step-limited (Lightning's default: -1)
            return t.num_training_batches
        return min(t.num_training_batches, self._offset + max(0, t.max_steps - self._step0) * t.accumulate_grad_batches)

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        items = super().get_metrics(trainer, pl_module)
        if trainer.max_steps > 0:
            items = {"step": f"{trainer.global_step}/{trainer.max_steps}", **items}
        return items
