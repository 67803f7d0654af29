"""Callbacks the ``diffmm`` CLI always adds: checkpoints, data counters per epoch and a prediction writer."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter, ModelCheckpoint

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
        self.last_path: Optional[str] = None

    def write_on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Sequence[Any],
                           batch_indices: Optional[Sequence[Any]]) -> None:
        preds = predictions[0] if predictions and isinstance(predictions[0], list) else predictions
        if not preds:
            return
        out: dict[str, Any] = {}
        for key in preds[0]:
            values = [p[key] for p in preds]
            out[key] = values if key == "similarity" else torch.cat(values)
        keys = getattr(trainer.datamodule, "predict_keys", None) if trainer.datamodule is not None else None
        if callable(keys):
            rows = next((v.shape[0] for v in out.values() if torch.is_tensor(v) and v.dim() > 0), None)
            out["keys"] = keys()[:rows]
        folder = self.output_dir or trainer.log_dir or trainer.default_root_dir
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"predictions_rank{trainer.global_rank}.pt")
        from diffmm.hub.checkpoint import atomic_save

        atomic_save(out, path)
        self.last_path = path
        log.info("wrote %s (%s)", path, ", ".join(f"{k}: {tuple(v.shape) if torch.is_tensor(v) else len(v)}"
                                                  for k, v in out.items()))


class Checkpoint(ModelCheckpoint):
    """ModelCheckpoint that also refreshes ``last.ckpt`` when training ends between two periodic saves."""

    _last_step_saved_as_last = -1

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self.save_last:
            self._last_step_saved_as_last = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_last and self._last_step_saved_as_last != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
