"""Train the demo's models through diffmm's Lightning code (``CLIPModule`` / ``LMModule`` + data modules).

Both models of a pair get the same seed, the same data order (the data module's seed), the same
steps, batch and optimizer recipe. The CSV log of each run (``<out>/runs/<model>-seed<k>/``) feeds the
loss curves.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from diffmm.demo.config import DemoConfig
from diffmm.demo.data import DemoData, spec

log = logging.getLogger("diffmm.demo")


@dataclass
class TrainResult:
    """One finished training run."""

    name: str
    seed: int
    model: nn.Module
    metrics_csv: str
    seconds: float
    steps: int
    final_loss: float
    throughput: Optional[float]
    throughput_unit: str
    params: int
    lambdas: dict[str, float] = field(default_factory=dict)
    lambda_start: dict[str, float] = field(default_factory=dict)
    lambda_init: dict[str, float] = field(default_factory=dict)
    data: str = ""

    def summary(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "steps": self.steps, "final_train_loss": self.final_loss,
                self.throughput_unit: self.throughput, "params": self.params, "lambdas": self.lambdas,
                "lambda_start": self.lambda_start, "lambda_init": self.lambda_init, "metrics_csv": self.metrics_csv, "data": self.data}


def _quiet_lightning() -> None:
    for name in ("pytorch_lightning.utilities.rank_zero", "pytorch_lightning.accelerators.cuda",
                 "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*`IterableDataset` has `__len__` defined.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*isn't worth it.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")


def _loss_callback(label: str, steps: int, lines: bool):
    """A Lightning callback that keeps every step's ``train/loss`` and, when ``lines``, prints one line per
    ~10% of training (for logs, where progress bars do not render)."""
    import pytorch_lightning as pl

    class LossRecorder(pl.Callback):
        def __init__(self) -> None:
            self.every = max(1, steps // 10)
            self.t0 = time.perf_counter()
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs  # what training_step returned
            self.losses.append(float(loss) if loss is not None else math.nan)
            step = trainer.global_step
            if not lines or (step % self.every and step != steps):
                return
            dt = time.perf_counter() - self.t0
            print(f"  {label}: step {step}/{steps}  loss {self.losses[-1]:.4f}  {dt:.0f} s", file=sys.stderr,
                  flush=True)

    return LossRecorder()


def _trainer(cfg: DemoConfig, run_dir: str, steps: int, label: str):
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger

    from diffmm.train.callbacks import DataStatsMonitor

    _quiet_lightning()
    bars = sys.stderr.isatty()
    recorder = _loss_callback(label, steps, lines=not bars)
    callbacks = [DataStatsMonitor(), recorder]
    logger = CSVLogger(run_dir, name="csv", version="")
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=steps, max_epochs=-1,
                         logger=logger, enable_checkpointing=False, log_every_n_steps=cfg.log_every,
                         limit_val_batches=0, num_sanity_val_steps=0, enable_model_summary=False,
                         enable_progress_bar=bars, gradient_clip_val=1.0, callbacks=callbacks,
                         default_root_dir=run_dir)
    return trainer, logger, recorder


def _final_loss(losses: list[float]) -> float:
    """Mean training loss over the last 10% of the steps (less noisy than the last batch)."""
    if not losses:
        return math.nan
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def _fresh(run_dir: str) -> str:
    """``run_dir`` emptied (the logs of an earlier demo run there are replaced)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    return run_dir


def _lambdas(model: nn.Module) -> tuple[dict[str, float], dict[str, float]]:
    from diffmm.train.monitor import lambda_layers, lambda_values

    layers = lambda_layers(model)
    vals = {k[len("lambda/"):]: v for k, v in lambda_values(layers).items() if k.startswith("lambda/")}
    inits = {n: float(getattr(m, "lambda_init", math.nan)) for n, m in layers.items()}
    return vals, inits


def _fit(module, datamodule, cfg: DemoConfig, run_dir: str, steps: int, label: str, seed: int,
         items_per_step: int, unit: str) -> TrainResult:
    """Fit for ``steps``; the throughput is ``steps * items_per_step`` over the wall time of ``fit``
    (data loading and start-up included)."""
    trainer, logger, recorder = _trainer(cfg, run_dir, steps, label)
    start, _ = _lambdas(module.model)  # lambda at step 0 (lambda_init + the random lambda vectors' term)
    t0 = time.perf_counter()
    trainer.fit(module, datamodule)
    seconds = time.perf_counter() - t0
    if trainer.global_step != steps:
        raise RuntimeError(f"{label}: training stopped at step {trainer.global_step} of {steps}")
    csv_path = os.path.join(logger.log_dir, "metrics.csv")
    model = module.model.eval()
    lambdas, inits = _lambdas(model)
    stats = datamodule.data_stats("train")
    loss = _final_loss(recorder.losses)
    if not math.isfinite(loss):
        raise FloatingPointError(f"{label}: the training loss is not finite ({loss})")
    return TrainResult(label, seed, model, csv_path, seconds, steps, loss, steps * items_per_step / seconds, unit,
                       sum(p.numel() for p in model.parameters()), lambdas, start, inits,
                       stats.summary() if stats is not None else "")


def train_clip(cfg: DemoConfig, data: DemoData, model_name: str, seed: int) -> TrainResult:
    """Contrastive training of ``model_name`` on the training emoji styles."""
    import pytorch_lightning as pl

    from diffmm.train import CLIPModule, ImageTextDataModule

    pl.seed_everything(seed, workers=True, verbose=False)
    module = CLIPModule(model_name=model_name, model_kwargs=dict(cfg.clip_model_kwargs) or None, lr=cfg.clip_lr,
                        min_lr=cfg.clip_min_lr, weight_decay=cfg.clip_weight_decay, warmup_steps=cfg.clip_warmup,
                        total_steps=cfg.clip_steps, log_lambdas=True)
    dm = ImageTextDataModule(train_shards=spec(data.train_shards), batch_size=cfg.clip_batch,
                             num_workers=cfg.num_workers, seed=seed, image_size=module.image_size,
                             context_length=module.context_length, tokenizer="clip")
    run_dir = _fresh(os.path.join(cfg.out, "runs", f"{model_name}-seed{seed}"))
    return _fit(module, dm, cfg, run_dir, cfg.clip_steps, f"{model_name} seed {seed}", seed,
                cfg.clip_batch, "samples_per_s")


def train_lm(cfg: DemoConfig, data: DemoData, preset: str, seed: int) -> TrainResult:
    """Next-token training of the LM preset ``preset`` on the Python-docs training split."""
    import pytorch_lightning as pl

    from diffmm.train import LMModule, TextDataModule

    pl.seed_everything(seed, workers=True, verbose=False)
    module = LMModule(model_name=preset, model_kwargs=dict(cfg.lm_model_kwargs), tokenizer=data.tokenizer,
                      lr=cfg.lm_lr, min_lr=cfg.lm_min_lr, weight_decay=cfg.lm_weight_decay,
                      warmup_steps=cfg.lm_warmup, total_steps=cfg.lm_steps, log_lambdas=True)
    dm = TextDataModule(train_shards=spec(data.lm_train_shards), batch_size=cfg.lm_batch,
                        num_workers=cfg.num_workers, seed=seed, context_length=module.context_length,
                        tokenizer=data.tokenizer)
    run_dir = _fresh(os.path.join(cfg.out, "runs", f"{preset}-seed{seed}"))
    return _fit(module, dm, cfg, run_dir, cfg.lm_steps, f"{preset} seed {seed}", seed,
                cfg.lm_batch * module.context_length, "tokens_per_s")


def set_threads(threads: int) -> int:
    """Set torch's CPU threads: ``threads`` > 0 as given; 0 = all cores, or 1 when the load average
    already reaches the core count (spinning OpenMP threads then cost more than they give)."""
    if threads <= 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        busy = hasattr(os, "getloadavg") and os.getloadavg()[0] >= cores
        threads = 1 if busy else cores
    torch.set_num_threads(threads)
    return threads
