"""One associative-recall training run in Python (no config file): parameter-matched models, Lightning fit, losses.

Used by ``scripts/recall_compare.py`` and the demo's recall section; ``diffmm fit --config
configs/recall_*.yaml`` runs the same module and data module from a config.

Parameter matching (:func:`matched_lm_kwargs`): at one width E and head count H every attention type
keeps the Transformer's width and heads (DIFF V1: H/2 differential heads of two components, the
same projections; DIFF V2: H heads, 2H query maps, which adds ``E^2 + E*H`` per layer). The SwiGLU
hidden size of a variant is then moved by whole units so that its total parameter count is as close
as possible to the standard Transformer's (one unit = ``3E`` parameters per layer).
"""
from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from diffmm.data.recall import RecallTask

log = logging.getLogger("diffmm.train")


def _count(kwargs: dict[str, Any]) -> dict[str, int]:
    from diffmm.models.lm import DiffLM, LMConfig

    with torch.device("meta"):
        return DiffLM(LMConfig(**kwargs)).param_report()


def matched_lm_kwargs(attention: str, n_embd: int, n_head: int, n_layer: int, vocab_size: int, block_size: int,
                      *, match: str = "standard", **extra: Any) -> dict[str, Any]:
    """``LMConfig`` kwargs of ``attention`` at this width, its total parameters matched to ``match``'s.

    Only ``intermediate_size`` (SwiGLU hidden) changes, and only for a type whose count differs from
    the reference by at least half a hidden unit per layer (V1's extra ``6d`` per layer does not).
    """
    from diffmm.models.lm import swiglu_hidden

    base = dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head, **extra)
    kwargs = dict(base, attention=attention)
    if attention == match:
        return kwargs
    ref = _count(dict(base, attention=match))["total"]
    delta = _count(kwargs)["total"] - ref
    unit = 3 * n_embd * n_layer  # parameters of one SwiGLU hidden unit over all layers
    shift = int(math.ceil(delta / unit - 0.5))  # nearest; a tie keeps the hidden size
    if shift:
        hidden = (base.get("intermediate_size") or swiglu_hidden(n_embd, base.get("mlp_multiple_of", 64))) - shift
        if hidden < 1:
            raise ValueError(f"matched_lm_kwargs: cannot match {attention} to {match} at width {n_embd} "
                             f"(SwiGLU hidden would be {hidden})")
        kwargs["intermediate_size"] = hidden
    return kwargs


def param_counts(model_kwargs: dict[str, Any]) -> dict[str, int]:
    """``DiffLM.param_report()`` of the config (built on the meta device)."""
    return _count(model_kwargs)


@dataclass
class RecallTrainConfig:
    """Budget and recipe of one recall training run.

    Attributes:
        tasks: training settings (mixed uniformly; one setting per batch).
        steps: optimizer steps.
        batch_size: sequences per batch (or see ``batch_tokens``).
        batch_tokens: tokens per batch (sequences = batch_tokens // seq_len of the batch's setting).
        lr, min_lr, warmup, weight_decay: AdamW with linear warmup and cosine decay to ``min_lr``.
        grad_clip: gradient-norm clipping.
        log_every: steps between recorded losses.
    """

    tasks: Sequence[RecallTask]
    steps: int = 1000
    batch_size: int = 32
    batch_tokens: Optional[int] = None
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 10


@dataclass
class RecallRun:
    """A trained model and what its training recorded."""

    model: nn.Module
    seconds: float
    steps: int
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean answer loss since the last entry)
    accuracies: list[tuple[int, float]] = field(default_factory=list)
    lambdas: dict[str, float] = field(default_factory=dict)

    def final_loss(self, fraction: float = 0.1) -> float:
        """Mean recorded loss over the last ``fraction`` of the run."""
        if not self.losses:
            return math.nan
        tail = [v for s, v in self.losses if s > self.steps * (1 - fraction)] or [self.losses[-1][1]]
        return sum(tail) / len(tail)

    def summary(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "steps": self.steps, "final_train_loss": self.final_loss(),
                "losses": self.losses, "train_accuracy": self.accuracies, "lambdas": self.lambdas}


def _recorder(every: int, label: str, steps: int, lines: bool):
    import pytorch_lightning as pl

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[tuple[int, float]] = []
            self.accs: list[tuple[int, float]] = []
            self._sum = self._acc = 0.0
            self._n = 0
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self._sum += float(loss)
            self._acc += float(getattr(pl_module, "last_train_accuracy", math.nan))
            self._n += 1
            step = trainer.global_step
            if step % every == 0 or step == steps:
                self.losses.append((step, self._sum / self._n))
                self.accs.append((step, self._acc / self._n))
                self._sum = self._acc = 0.0
                self._n = 0
                if lines and (step % max(every, steps // 10) == 0 or step == steps):
                    print(f"  {label}: step {step}/{steps}  answer loss {self.losses[-1][1]:.3f}  "
                          f"train acc {self.accs[-1][1]:.3f}  {time.perf_counter() - self.t0:.0f} s",
                          file=sys.stderr, flush=True)

    return Recorder()


def train_recall(model_kwargs: dict[str, Any], cfg: RecallTrainConfig, seed: int, *, label: str = "recall",
                 print_progress: bool = True) -> RecallRun:
    """Train ``DiffLM(LMConfig(**model_kwargs))`` on the recall mixture with Lightning, on CPU.

    The seed fixes the initialisation (``seed_everything``) and the data stream, so every attention
    type trained with the same seed sees the same batches.
    """
    import pytorch_lightning as pl

    from diffmm.models.lm import DiffLM, LMConfig
    from diffmm.train.monitor import lambda_layers, lambda_values
    from diffmm.train.recall_data import RecallDataModule
    from diffmm.train.recall_module import RecallLMModule

    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero",
                 "pytorch_lightning.accelerators.cuda"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")
    pl.seed_everything(seed, verbose=False)
    model = DiffLM(LMConfig(**model_kwargs))
    module = RecallLMModule(model=model, vocab_size=model.config.vocab_size, lr=cfg.lr, min_lr=cfg.min_lr,
                            weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup, total_steps=cfg.steps,
                            log_lambdas=False)
    dm = RecallDataModule(tasks=[{k: v for k, v in t.to_dict().items() if k != "vocab_size"} for t in cfg.tasks],
                          vocab_size=cfg.tasks[0].vocab_size, batch_size=cfg.batch_size, batch_tokens=cfg.batch_tokens,
                          val_examples=0, seed=seed, context_length=model.config.block_size)
    recorder = _recorder(cfg.log_every, label, cfg.steps, print_progress)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=cfg.steps, max_epochs=-1,
                         logger=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                         enable_model_summary=False, enable_progress_bar=False, gradient_clip_val=cfg.grad_clip,
                         callbacks=[recorder])
    t0 = time.perf_counter()
    trainer.fit(module, dm)
    seconds = time.perf_counter() - t0
    if trainer.global_step != cfg.steps:
        raise RuntimeError(f"{label}: training stopped at step {trainer.global_step} of {cfg.steps}")
    model = module.model.eval()
    lam = {k[len("lambda/"):]: v for k, v in lambda_values(lambda_layers(model)).items() if k.startswith("lambda/")}
    return RecallRun(model, seconds, cfg.steps, recorder.losses, recorder.accs, lam)
