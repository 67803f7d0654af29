"""What the CLIP and LM training modules share: the optimizer recipe, the schedule, compile,
gradient checkpointing and periodic logging of lambdas and throughput. No model math here."""
from __future__ import annotations

import functools
import math
import time
import warnings
from typing import Any, Optional

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.utils.checkpoint

from diffmm.hub.formats import MODEL_KEY
from diffmm.models.hub_mixin import DiffmmHubMixin, model_record
from diffmm.train.callbacks import NonFiniteGuard
from diffmm.train.monitor import lambda_layers, lambda_values
from diffmm.train.optim import WarmupCosineLR, adamw

_BLOCK_LIST_NAMES = ("blocks", "resblocks", "layers", "h")


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

    Subclasses take the arguments below, save them with ``save_hyperparameters`` (read back from ``self.hparams``),
    attach their network with :meth:`setup_model`, implement ``training_step`` etc. with :meth:`run_model` (the
    compiled model when ``compile=True``) and call :meth:`log_step` from ``training_step``.

    Every run is guarded against a non-finite loss: unless the trainer already has one, a
    :class:`~diffmm.train.callbacks.NonFiniteGuard` (stop on the first NaN/Inf loss) is added.
    On resume the lr schedule follows the current settings (see :class:`~diffmm.train.optim.WarmupCosineLR`).

    Args:
        lr: peak learning rate.
        min_lr: learning rate at the end of the cosine.
        weight_decay: AdamW weight decay of the decayed group (matrices; see :mod:`diffmm.train.optim`); a
            subclass taking ``no_decay`` (name fragments) keeps those parameters out of it too.
        betas, eps: AdamW.
        warmup_steps: linear warmup steps (ignored when ``warmup_epochs`` is set).
        warmup_epochs: warmup length in epochs (may be fractional), converted with the steps per epoch.
        total_steps: end of the cosine; default: the trainer's estimated optimizer steps.
        grad_checkpointing: recompute activations in backward.
        compile: ``torch.compile`` the model's forward (state-dict keys do not change).
        log_lambdas: log every differential layer's lambda at each logging step (not under FSDP).
    """

    _lambda_layers: Optional[dict[str, nn.Module]] = None
    _compiled: Any = None
    _window: Optional[list] = None  # throughput: [start time, items counted since]

    # ----- model setup --------------------------------------------------------------------------
    def setup_model(self, model: nn.Module) -> None:
        """Attach ``model`` and apply grad checkpointing (compile happens in :meth:`configure_model`)."""
        self.model = model
        if self.hparams.grad_checkpointing:
            enable_grad_checkpointing(model)

    def configure_model(self) -> None:
        if self.hparams.compile and self._compiled is None:
            # stored outside nn.Module's registry: no duplicate `_orig_mod.` keys in checkpoints
            object.__setattr__(self, "_compiled", torch.compile(self.model))

    def run_model(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through the compiled model when compiled, else the model."""
        fn = self._compiled if self._compiled is not None else self.model
        return fn(*args, **kwargs)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the model's record (its kind and config, as an export's ``config.json``) so that
        ``diffmm.load_pretrained`` rebuilds it from the checkpoint alone (models that open_clip builds have none)."""
        if isinstance(self.model, DiffmmHubMixin):
            checkpoint[MODEL_KEY] = model_record(self.model)

    # ----- optimizer and schedule ---------------------------------------------------------------
    def _schedule_steps(self) -> tuple[int, int]:
        trainer, hp = self.trainer, self.hparams
        total = hp.total_steps or int(trainer.estimated_stepping_batches)
        if not math.isfinite(total) or total <= 0:
            raise ValueError("cannot infer the schedule length (infinite data and no max_steps); set model total_steps")
        warmup = hp.warmup_steps
        if hp.warmup_epochs is not None:
            if trainer.train_dataloader is None:
                trainer.fit_loop.setup_data()  # what estimated_stepping_batches does when it needs the length
            batches = trainer.num_training_batches
            if not math.isfinite(batches):
                raise ValueError("warmup_epochs needs a data length per epoch (sizes.json or samples_per_epoch); "
                                 "use warmup_steps")
            per_epoch = math.ceil(batches / max(1, trainer.accumulate_grad_batches))
            warmup = int(round(hp.warmup_epochs * per_epoch))
        return min(warmup, total), total

    def configure_callbacks(self) -> list[pl.Callback]:
        """A :class:`NonFiniteGuard` (stop on a NaN/Inf loss) unless the trainer has one (e.g. from the CLI)."""
        if any(isinstance(cb, NonFiniteGuard) for cb in self.trainer.callbacks):
            return []
        return [NonFiniteGuard()]

    def param_lrs(self) -> dict[str, float]:
        """Parameter-name prefixes of ``self.model`` with their own peak lr (default: none; every group at ``lr``)."""
        return {}

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        opt = adamw(self.model, hp.lr, hp.weight_decay, tuple(hp.betas), hp.eps, tuple(hp.get("no_decay") or ()),
                    self.param_lrs())
        sched = WarmupCosineLR(opt, *self._schedule_steps(), hp.lr, hp.min_lr)
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
        return "FSDP" in type(self.trainer.strategy).__name__

    def on_train_epoch_start(self) -> None:
        self._window = None

    def log_step(self, loss: torch.Tensor, items: int, rate_name: str, extra: Optional[dict] = None) -> None:
        """Log the loss, throughput, lambdas and ``extra`` on the trainer's logging steps.

        Nothing is logged on the other steps: loggers only write on logging steps anyway, and each
        ``self.log`` call costs about a millisecond of Python.

        Args:
            items: items this rank processed in this step (samples or tokens); rates are global.
            rate_name: e.g. ``samples_per_s`` / ``tokens_per_s``: items per second of wall clock (data loading
                included) since the previous logging step; the first step of an epoch only starts the clock.
        """
        now = time.perf_counter()
        if self._window is None:
            self._window = [now, 0]
        else:
            self._window[1] += items
        if not self.should_log_now():
            return
        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False)
        metrics: dict[str, float] = dict(extra or {})
        (start, counted), self._window = self._window, [now, 0]
        if counted:
            rate = counted / max(now - start, 1e-9)
            metrics[f"train/{rate_name}"] = rate * self.trainer.world_size
            metrics[f"train/{rate_name}_per_device"] = rate
        if self.hparams.log_lambdas and not self.sharded():  # under FSDP the lambda vectors are sharded views
            if self._lambda_layers is None:
                self._lambda_layers = lambda_layers(self.model)
            metrics.update(lambda_values(self._lambda_layers))
        if metrics:
            # values are identical (lambdas) or per-rank (rates): log rank 0's, no collective needed
            self.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
