"""LightningModule for next-token training of DIFF / Transformer language models."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from diffmm.train.base import TrainModule
from diffmm.train.losses import next_token_loss


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (faster matmuls; unused rows are never targets)."""
    return multiple * math.ceil(vocab_size / multiple) if multiple > 1 else vocab_size


class LMModule(TrainModule):
    """Trains a :class:`diffmm.models.lm.DiffLM` on packed ``(B, context_length + 1)`` token rows.

    Defaults follow the DIFF paper's recipe (App. E, SPEC section 2): AdamW betas (0.9, 0.98),
    weight decay 0.05, 375 warmup steps, cosine decay; lr 1.5e-3 is its ~1B-scale value.

    Args:
        model_name: an LM preset (``diffmm.models.lm_configs.list_lm_configs()``), e.g. ``diff-tiny``.
        model_kwargs: ``LMConfig`` overrides (``n_layer``, ``attention``, ...).
        tokenizer: ``clip`` or a ``tokenizer.json`` path (linked to the data module); the model's
            vocabulary is the tokenizer's, padded to ``pad_vocab_to`` (unless ``model_kwargs`` sets it).
        context_length: training sequence length; default the preset's ``block_size``.
        pad_vocab_to: vocabulary rounding.
        model: an already built model (Python use; overrides ``model_name``).
        lr, min_lr, weight_decay, betas, eps, warmup_steps, warmup_epochs, total_steps,
            grad_checkpointing, compile, log_lambdas: see :class:`~diffmm.train.base.TrainModule`.
    """

    def __init__(self, model_name: str = "diff-tiny", model_kwargs: Optional[dict] = None, tokenizer: str = "clip",
                 context_length: Optional[int] = None, pad_vocab_to: int = 64, model: Optional[nn.Module] = None, *,
                 lr: float = 1.5e-3, min_lr: float = 1.5e-4, weight_decay: float = 0.05,
                 betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8,
                 warmup_steps: int = 375, warmup_epochs: Optional[float] = None, total_steps: Optional[int] = None,
                 grad_checkpointing: bool = False, compile: bool = False, log_lambdas: bool = True) -> None:
        super().__init__(lr=lr, min_lr=min_lr, weight_decay=weight_decay, betas=betas, eps=eps,
                         warmup_steps=warmup_steps, warmup_epochs=warmup_epochs, total_steps=total_steps,
                         grad_checkpointing=grad_checkpointing, compile=compile, log_lambdas=log_lambdas)
        self.save_hyperparameters(ignore=["model"])
        self._tokenizer = tokenizer
        if model is None:
            from diffmm.data.tokenizers import load_lm_tokenizer
            from diffmm.models.lm import DiffLM, LMConfig

            overrides = dict(model_kwargs or {})
            tok_vocab = load_lm_tokenizer(tokenizer).vocab_size
            overrides.setdefault("vocab_size", padded_vocab(tok_vocab, pad_vocab_to))
            if overrides["vocab_size"] < tok_vocab:
                raise ValueError(f"LMModule: model vocab_size {overrides['vocab_size']} < tokenizer {tokenizer!r} "
                                 f"vocabulary {tok_vocab}")
            config = LMConfig.from_name(model_name, **overrides)
            model = DiffLM(config)
        block_size = getattr(getattr(model, "config", None), "block_size", None)
        self._context_length = context_length or block_size
        if self._context_length is None:
            raise ValueError("LMModule: give context_length (the model has no config.block_size)")
        if block_size is not None and self._context_length > block_size:
            raise ValueError(f"LMModule: context_length {self._context_length} > the model's block_size {block_size}")
        self.setup_model(model)
        self._eval_acc: dict[str, torch.Tensor] = {}

    @property
    def context_length(self) -> int:
        """Tokens per training sequence (linked to the data module's ``context_length``)."""
        return int(self._context_length)

    @property
    def tokenizer(self) -> str:
        """Tokenizer spec (linked to the data module)."""
        return self._tokenizer

    @property
    def image_size(self) -> None:
        return None

    # ----- steps --------------------------------------------------------------------------------
    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        idx, targets = batch[:, :-1], batch[:, 1:]  # (B, T), (B, T)
        logits = self.run_model(idx)
        return next_token_loss(logits, targets)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        extra = {"train/ppl": math.exp(min(float(loss.detach()), 50.0))} if self.should_log_now() else None
        self.log_step(loss, tokens, "tokens_per_s", extra)
        return loss

    def _eval_step(self, batch: torch.Tensor, stage: str) -> torch.Tensor:
        loss = self._loss(batch)
        n = batch.shape[0] * (batch.shape[1] - 1)
        acc = self._eval_acc.setdefault(stage, torch.zeros(2, dtype=torch.float64, device=loss.device))
        acc += torch.stack([loss.detach().double() * n, torch.tensor(float(n), dtype=torch.float64, device=loss.device)])
        return loss

    def _log_eval(self, stage: str) -> None:
        acc = self._eval_acc.pop(stage, None)
        if acc is None:
            acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        acc = self.trainer.strategy.reduce(acc, reduce_op="sum")  # token-weighted over all ranks
        if float(acc[1]) == 0:
            return
        loss = float(acc[0] / acc[1])
        self.log_dict({f"{stage}/loss": loss, f"{stage}/ppl": math.exp(min(loss, 50.0)),
                       f"{stage}/tokens": float(acc[1])}, prog_bar=stage == "val")

    def on_validation_epoch_start(self) -> None:
        self._eval_acc.pop("val", None)

    def on_test_epoch_start(self) -> None:
        self._eval_acc.pop("test", None)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "val")

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        """Per-sequence mean negative log-likelihood and next-token accuracy of each row."""
        idx, targets = batch[:, :-1], batch[:, 1:]
        logits = self.run_model(idx).float()  # (B, T, V)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, T)
        acc = (logits.argmax(-1) == targets).float().mean(1)
        return {"nll": nll.mean(1).cpu(), "next_token_accuracy": acc.cpu()}
