"""What the CLIP and LM training modules share: the optimizer recipe, the schedule, compile,
gradient checkpointing and periodic logging of lambdas and throughput. No model math here."""
from __future__ import annotations

import functools
import logging
import math
import warnings
from typing import Any, Optional

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.utils.checkpoint

from diffmm.train.callbacks import NonFiniteGuard
from diffmm.train.monitor import Throughput, lambda_layers, lambda_values
from diffmm.train.optim import WarmupCosineLR, adamw

_BLOCK_LIST_NAMES = ("blocks", "resblocks", "layers", "h")

log = logging.getLogger("diffmm.train")


def enable_grad_checkpointing(model: nn.Module) -> int:
    """Turn on activation checkpointing; returns how many blocks were wrapped (-1: the model's own switch).

    Uses the model's ``set_grad_checkpointing(True)`` (open_clip/timm convention) when it has one;
    otherwise recomputes each element of ``nn.ModuleList``s named ``blocks``/``resblocks``/``layers``/``h``
    in backward (the forward is wrapped on the instance, so state-dict keys do not change).
    """
    if callable(getattr(model, "set_grad_checkpointing", None)):
        model.set_grad_checkpointing(True)
        return -1
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1] in _BLOCK_LIST_NAMES:
            for block in mod:
                if getattr(block, "_diffmm_ckpt", False):
                    continue
                orig = block.forward

                @functools.wraps(orig)
                def fwd(*args, _orig=orig, **kwargs):
                    if torch.is_grad_enabled():
                        return torch.utils.checkpoint.checkpoint(_orig, *args, use_reentrant=False, **kwargs)
                    return _orig(*args, **kwargs)

                block.forward = fwd
                block._diffmm_ckpt = True
                n += 1
    if n == 0:
        warnings.warn(f"grad_checkpointing: {type(model).__name__} has no set_grad_checkpointing() and no block "
                      f"list named {_BLOCK_LIST_NAMES}; running without it", stacklevel=2)
    return n


class TrainModule(pl.LightningModule):
    """Base LightningModule: AdamW with decay/no-decay groups, per-step warmup + cosine, logging.

    Subclasses set ``self.model`` and implement ``training_step`` etc. with :meth:`run_model`
    (the compiled model when ``compile=True``) and call :meth:`log_step` from ``training_step``.

    Every run is guarded against a non-finite loss: unless the trainer already has one, a
    :class:`~diffmm.train.callbacks.NonFiniteGuard` (stop on the first NaN/Inf loss) is added.
    On resume the lr schedule follows the current settings (see :class:`~diffmm.train.optim.WarmupCosineLR`).

    Args:
        lr: peak learning rate.
        min_lr: learning rate at the end of the cosine.
        weight_decay: AdamW weight decay of the decayed group (matrices; see :mod:`diffmm.train.optim`).
        betas, eps: AdamW.
        warmup_steps: linear warmup steps (ignored when ``warmup_epochs`` is set).
        warmup_epochs: warmup length in epochs (may be fractional), converted with the steps per epoch.
        total_steps: end of the cosine; default: the trainer's estimated optimizer steps.
        grad_checkpointing: recompute activations in backward.
        compile: ``torch.compile`` the model's forward (state-dict keys do not change).
        log_lambdas: log every differential layer's lambda at each logging step (not under FSDP).
    """

    def __init__(self, *, lr: float, min_lr: float, weight_decay: float, betas: tuple[float, float],
                 eps: float, warmup_steps: int, warmup_epochs: Optional[float], total_steps: Optional[int],
                 grad_checkpointing: bool, compile: bool, log_lambdas: bool) -> None:
        super().__init__()
        self.lr, self.min_lr, self.weight_decay = lr, min_lr, weight_decay
        self.betas, self.eps = tuple(betas), eps
        self.warmup_steps, self.warmup_epochs, self.total_steps = warmup_steps, warmup_epochs, total_steps
        self.grad_checkpointing, self.compile_model, self.log_lambdas = grad_checkpointing, compile, log_lambdas
        self._throughput = Throughput()
        self._lambda_layers: dict[str, nn.Module] | None = None
        self._compiled: Any = None

    # ----- model setup --------------------------------------------------------------------------
    def setup_model(self, model: nn.Module) -> None:
        """Attach ``model`` and apply grad checkpointing (compile happens in :meth:`configure_model`)."""
        self.model = model
        if self.grad_checkpointing:
            enable_grad_checkpointing(model)

    def configure_model(self) -> None:
        if self.compile_model and self._compiled is None:
            # stored outside nn.Module's registry: no duplicate `_orig_mod.` keys in checkpoints
            object.__setattr__(self, "_compiled", torch.compile(self.model))

    def run_model(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through the compiled model when compiled, else the model."""
        fn = self._compiled if self._compiled is not None else self.model
        return fn(*args, **kwargs)

    # ----- optimizer and schedule ---------------------------------------------------------------
    def extra_no_decay(self) -> tuple[str, ...]:
        """Extra parameter-name fragments without weight decay (subclasses may add)."""
        return ()

    def _schedule_steps(self) -> tuple[int, int]:
        trainer = self.trainer
        total = self.total_steps or int(trainer.estimated_stepping_batches)
        if not math.isfinite(total) or total <= 0:
            raise ValueError("cannot infer the schedule length (infinite data and no max_steps); set model total_steps")
        warmup = self.warmup_steps
        if self.warmup_epochs is not None:
            if trainer.train_dataloader is None:
                trainer.fit_loop.setup_data()  # what estimated_stepping_batches does when it needs the length
            batches = trainer.num_training_batches
            if not math.isfinite(batches):
                raise ValueError("warmup_epochs needs a data length per epoch (sizes.json or samples_per_epoch); "
                                 "use warmup_steps")
            per_epoch = math.ceil(batches / max(1, trainer.accumulate_grad_batches))
            warmup = int(round(self.warmup_epochs * per_epoch))
        return min(warmup, total), total

    def configure_callbacks(self) -> list[pl.Callback]:
        """A :class:`NonFiniteGuard` (stop on a NaN/Inf loss) unless the trainer has one (e.g. from the CLI)."""
        if any(isinstance(cb, NonFiniteGuard) for cb in self.trainer.callbacks):
            return []
        return [NonFiniteGuard()]

    def on_train_start(self) -> None:
        for config in self.trainer.lr_scheduler_configs:
            note = config.scheduler.describe_restore() if isinstance(config.scheduler, WarmupCosineLR) else ""
            if note and self.trainer.is_global_zero:
                log.info("%s", note)

    def configure_optimizers(self) -> dict:
        opt = adamw(self.model, self.lr, self.weight_decay, self.betas, self.eps, self.extra_no_decay())
        sched = WarmupCosineLR(opt, *self._schedule_steps(), self.lr, self.min_lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    # ----- logging ------------------------------------------------------------------------------
    def should_log_now(self) -> bool:
        """True on the training steps where the trainer writes logs (every ``log_every_n_steps`` optimizer steps
        and the last one; heavier metrics are only computed then)."""
        try:
            trainer = self.trainer
        except RuntimeError:  # no trainer attached
            return False
        return (trainer.global_step + 1) % trainer.log_every_n_steps == 0 or trainer.should_stop

    def sharded(self) -> bool:
        """True under FSDP-style strategies (parameters are only whole inside forward/backward)."""
        try:
            return "FSDP" in type(self.trainer.strategy).__name__
        except RuntimeError:  # no trainer attached
            return False

    def on_train_epoch_start(self) -> None:
        self._throughput = Throughput()

    def log_step(self, loss: torch.Tensor, items: int, rate_name: str, extra: Optional[dict] = None) -> None:
        """Log the loss, throughput, lambdas and ``extra`` on the trainer's logging steps.

        Nothing is logged on the other steps: loggers only write on logging steps anyway, and each
        ``self.log`` call costs about a millisecond of Python.

        Args:
            items: items this rank processed in this step (samples or tokens); rates are global.
            rate_name: e.g. ``samples_per_s`` / ``tokens_per_s``.
        """
        self._throughput.add(items)
        if not self.should_log_now():
            return
        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False)
        metrics: dict[str, float] = dict(extra or {})
        rate = self._throughput.rate()
        if rate is not None:
            metrics[f"train/{rate_name}"] = rate * self.trainer.world_size
            metrics[f"train/{rate_name}_per_device"] = rate
        if self.log_lambdas and not self.sharded():  # under FSDP the lambda vectors are sharded views
            if self._lambda_layers is None:
                self._lambda_layers = lambda_layers(self.model)
            metrics.update(lambda_values(self._lambda_layers))
        if metrics:
            # values are identical (lambdas) or per-rank (rates): log rank 0's, no collective needed
            self.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
