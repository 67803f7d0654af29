"""LightningModule for associative-recall training (MQAR): an :class:`LMModule` whose loss is on the answers only.

Batches are ``{"inputs": (B, T), "targets": (B, T)}`` from :class:`~diffmm.train.recall_data.RecallDataModule`
(targets -100 except at query positions). The model is a :class:`~diffmm.models.lm.DiffLM` over the
task's small vocabulary, so no tokenizer is involved.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffmm.data.recall import IGNORE
from diffmm.eval.recall import answer_logits
from diffmm.train.lm_module import LMModule


class RecallLMModule(LMModule):
    """Trains a DIFF / Transformer LM on generated recall data; loss and accuracy on the answer positions.

    Args:
        model_name: an LM preset (``transformer-tiny``, ``diff-tiny``, ...); ``model_kwargs`` override it
            (``attention``, ``n_layer``, ``n_embd``, ``n_head``, ``intermediate_size``, ``block_size``, ...).
        vocab_size: the model's vocabulary, at least the task's (the data module checks).
        context_length: longest training sequence; default the model's ``block_size``.
        model: an already built model (Python use).
        lr, min_lr, weight_decay, betas, eps, warmup_steps, warmup_epochs, total_steps, grad_checkpointing,
            compile, log_lambdas: see :class:`~diffmm.train.base.TrainModule`. Defaults suit tiny models on
            this task (lr 1e-3, weight decay 0.1, 50 warmup steps).
    """

    def __init__(self, model_name: str = "transformer-tiny", model_kwargs: Optional[dict] = None,
                 vocab_size: int = 256, context_length: Optional[int] = None, model: Optional[nn.Module] = None, *,
                 lr: float = 1e-3, min_lr: float = 1e-4, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8, warmup_steps: int = 50,
                 warmup_epochs: Optional[float] = None, total_steps: Optional[int] = None,
                 grad_checkpointing: bool = False, compile: bool = False, log_lambdas: bool = True) -> None:
        if model is None:
            from diffmm.models.lm import DiffLM, LMConfig

            kwargs = dict(model_kwargs or {})
            if kwargs.setdefault("vocab_size", vocab_size) != vocab_size:
                raise ValueError(f"RecallLMModule: model_kwargs.vocab_size {kwargs['vocab_size']} != vocab_size "
                                 f"{vocab_size}; set one of them")
            model = DiffLM(LMConfig.from_name(model_name, **kwargs))
        super().__init__(model_name=model_name, model_kwargs=model_kwargs, tokenizer="recall",
                         context_length=context_length, model=model, lr=lr, min_lr=min_lr,
                         weight_decay=weight_decay, betas=betas, eps=eps, warmup_steps=warmup_steps,
                         warmup_epochs=warmup_epochs, total_steps=total_steps, grad_checkpointing=grad_checkpointing,
                         compile=compile, log_lambdas=log_lambdas)
        # hyper-parameters of this class (LMModule saved its own). model_kwargs becomes the whole LMConfig, so
        # the checkpoint rebuilds the model (diffmm export, diffmm eval recall) even when it was passed in.
        config = getattr(self.model, "config", None)
        if hasattr(config, "to_dict"):
            model_kwargs = config.to_dict()
        self._hparams = type(self._hparams)()
        self.save_hyperparameters(ignore=["model"])
        self.vocab_size = int(getattr(getattr(self.model, "config", None), "vocab_size", vocab_size))

    # ----- steps --------------------------------------------------------------------------------
    def _answers(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(batch, dict) or "inputs" not in batch or "targets" not in batch:
            raise TypeError("RecallLMModule expects batches {'inputs': (B, T), 'targets': (B, T)} "
                            "(diffmm.train.recall_data.RecallDataModule)")
        model = self._compiled if self._compiled is not None else self.model
        return answer_logits(model, batch["inputs"], batch["targets"])

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits, answers = self._answers(batch)
        loss = F.cross_entropy(logits, answers)
        #: answer accuracy of the last training batch (a tensor: reading it is the caller's sync)
        self.last_train_accuracy = (logits.detach().argmax(-1) == answers).float().mean()
        extra = {"train/recall_acc": float(self.last_train_accuracy)} if self.should_log_now() else None
        self.log_step(loss, int(batch["inputs"].numel()), "tokens_per_s", extra)
        return loss

    def _eval_step(self, batch: dict, stage: str) -> torch.Tensor:
        logits, answers = self._answers(batch)
        loss = F.cross_entropy(logits, answers, reduction="sum")
        correct = (logits.argmax(-1) == answers).sum()
        acc = self._eval_acc.setdefault(stage, torch.zeros(3, dtype=torch.float64, device=logits.device))
        acc += torch.stack([loss.detach().double(), correct.double(),
                            torch.tensor(float(answers.numel()), dtype=torch.float64, device=logits.device)])
        return loss / max(1, answers.numel())

    def _log_eval(self, stage: str) -> None:
        acc = self._eval_acc.pop(stage, None)
        if acc is None:
            acc = torch.zeros(3, dtype=torch.float64, device=self.device)
        acc = self.trainer.strategy.reduce(acc, reduce_op="sum")
        if float(acc[2]) == 0:
            return
        self.log_dict({f"{stage}/loss": float(acc[0] / acc[2]), f"{stage}/recall_acc": float(acc[1] / acc[2]),
                       f"{stage}/answers": float(acc[2])}, prog_bar=stage == "val")

    def predict_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor]:
        """Per sequence: the fraction of its queries answered (argmax) and whether all were."""
        inputs, targets = batch["inputs"], batch["targets"]
        logits, answers = self._answers(batch)
        hit = torch.zeros_like(targets, dtype=torch.float32)
        hit[targets != IGNORE] = (logits.argmax(-1) == answers).float()
        n = (targets != IGNORE).sum(1).clamp_min(1)
        acc = hit.sum(1) / n
        return {"recall_accuracy": acc.cpu(), "all_correct": (acc == 1).cpu()}
