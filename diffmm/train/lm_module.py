"""LightningModule for next-token training of DIFF / Transformer language models."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffmm.data.tokenizers import load_lm_tokenizer
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.train.base import TrainModule
from diffmm.train.losses import IGNORE_INDEX, next_token_loss

#: an LM batch: packed token rows (B, T + 1), or (inputs (B, T), targets (B, T)) with -100 where nothing is scored
Batch = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def inputs_and_targets(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` (B, T) of a batch: packed rows are shifted by one token; a pair is taken as it is."""
    if isinstance(batch, (tuple, list)):
        return batch[0], batch[1]
    return batch[:, :-1], batch[:, 1:]


class LMModule(TrainModule):
    """Trains a :class:`diffmm.models.lm.DiffLM` on packed ``(B, context_length + 1)`` token rows, or on
    ``(inputs, targets)`` pairs whose targets are -100 where no loss is taken (the associative-recall data of
    :class:`~diffmm.train.datamodules.RecallDataModule`: loss and accuracy on the answers only).

    On training steps that log nothing, a ``DiffLM`` runs its head and loss fused, without logits
    (``return_logits=False``); logging steps compute the logits for the accuracy.

    Defaults follow the DIFF Transformer recipe (arXiv 2410.05258, App. E): AdamW betas (0.9, 0.98), weight decay
    0.05, 375 warmup steps, cosine decay; lr 1.5e-3 is its value at ~1B parameters.

    Args:
        model_name: an LM preset (``diffmm.models.lm_configs.list_lm_configs()``), e.g. ``diff-tiny``.
        model_kwargs: ``LMConfig`` overrides (``n_layer``, ``attention``, ``vocab_size``, ...).
        tokenizer: ``clip`` or a ``tokenizer.json`` path (the data module follows it); the model's
            vocabulary is the tokenizer's, padded to ``pad_vocab_to`` (unless ``model_kwargs`` sets it).
            ``None``: the data are token ids already (generated tasks); ``model_kwargs.vocab_size`` sets the vocabulary.
        context_length: training sequence length; default the preset's ``block_size``.
        pad_vocab_to: vocabulary rounding.
        model: an already built model (Python use; overrides ``model_name``).
        lr, min_lr, weight_decay, betas, eps, warmup_steps, warmup_epochs, total_steps,
            grad_checkpointing, compile, log_lambdas: see :class:`~diffmm.train.base.TrainModule`.
    """

    def __init__(self, model_name: str = "diff-tiny", model_kwargs: Optional[dict] = None,
                 tokenizer: Optional[str] = "clip", context_length: Optional[int] = None, pad_vocab_to: int = 64,
                 model: Optional[nn.Module] = None, *, lr: float = 1.5e-3, min_lr: float = 1.5e-4,
                 weight_decay: float = 0.05, betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8,
                 warmup_steps: int = 375, warmup_epochs: Optional[float] = None, total_steps: Optional[int] = None,
                 grad_checkpointing: bool = False, compile: bool = False, log_lambdas: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self.tokenizer = tokenizer
        if model is None:
            overrides = dict(model_kwargs or {})
            if tokenizer is None and "vocab_size" not in overrides:
                raise ValueError("LMModule: without a tokenizer, set the vocabulary in model_kwargs.vocab_size")
            if tokenizer is not None:
                tok_vocab = load_lm_tokenizer(tokenizer).vocab_size
                multiple = max(1, pad_vocab_to)  # rounded up: faster matmuls, the extra rows are never targets
                overrides.setdefault("vocab_size", multiple * math.ceil(tok_vocab / multiple))
                if overrides["vocab_size"] < tok_vocab:
                    raise ValueError(f"LMModule: model vocab_size {overrides['vocab_size']} < tokenizer {tokenizer!r} "
                                     f"vocabulary {tok_vocab}")
            model = DiffLM(LMConfig.from_name(model_name, **overrides))
        block_size = getattr(getattr(model, "config", None), "block_size", None)
        #: tokens per training sequence (the data module follows it)
        self.context_length = context_length or block_size
        if self.context_length is None:
            raise ValueError("LMModule: give context_length (the model has no config.block_size)")
        if block_size is not None and self.context_length > block_size:
            raise ValueError(f"LMModule: context_length {self.context_length} > the model's block_size {block_size}")
        self.setup_model(model)
        self._eval_acc: dict[str, torch.Tensor] = {}

    # ----- steps --------------------------------------------------------------------------------
    def scored(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, correct, n)``: mean cross entropy over the scored targets, how many of them the argmax gets
        right and how many there are (0-d tensors)."""
        idx, targets = inputs_and_targets(batch)
        logits = self.run_model(idx)  # (B, T, V)
        mask = targets != IGNORE_INDEX
        correct = ((logits.detach().argmax(-1) == targets) & mask).sum()
        return next_token_loss(logits, targets), correct, mask.sum()

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        extra, log_now = None, self.should_log_now()
        if log_now or not isinstance(self.model, DiffLM):
            loss, correct, n = self.scored(batch)
            if log_now:
                extra = {"train/ppl": math.exp(min(float(loss.detach()), 50.0)), "train/accuracy": float(correct / n)}
        else:  # no logits needed: the head and the loss run fused by chunks (DiffLM's fast training path)
            loss = self.run_model(*inputs_and_targets(batch), return_logits=False)[1]
        self.log_step(loss, inputs_and_targets(batch)[0].numel(), "tokens_per_s", extra)
        return loss

    def _eval_step(self, batch: Batch, stage: str) -> torch.Tensor:
        loss, correct, n = self.scored(batch)
        acc = self._eval_acc.setdefault(stage, torch.zeros(3, dtype=torch.float64, device=loss.device))
        acc += torch.stack([loss.detach().double() * n, correct.double(), n.double()])
        return loss

    def _log_eval(self, stage: str) -> None:
        acc = self._eval_acc.pop(stage, torch.zeros(3, dtype=torch.float64, device=self.device))  # none: no batch
        acc = self.trainer.strategy.reduce(acc, reduce_op="sum")  # token-weighted over all ranks
        if float(acc[2]) == 0:
            return
        loss = float(acc[0] / acc[2])
        self.log_dict({f"{stage}/loss": loss, f"{stage}/ppl": math.exp(min(loss, 50.0)),
                       f"{stage}/accuracy": float(acc[1] / acc[2]), f"{stage}/tokens": float(acc[2])},
                      prog_bar=stage == "val")

    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def predict_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        """Per row: mean negative log-likelihood and next-token accuracy over its scored targets."""
        idx, targets = inputs_and_targets(batch)
        logits = self.run_model(idx).float()  # (B, T, V)
        mask = (targets != IGNORE_INDEX).float()
        nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, T), 0 where ignored
        n = mask.sum(1).clamp_min(1)
        acc = ((logits.argmax(-1) == targets).float() * mask).sum(1) / n
        return {"nll": ((nll * mask).sum(1) / n).cpu(), "next_token_accuracy": acc.cpu()}
