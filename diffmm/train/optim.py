"""AdamW parameter groups (no weight decay on biases, norms, lambdas and other 1-D parameters) and the
per-step linear-warmup + cosine learning-rate schedule."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
import torch.nn as nn

#: module types whose parameters never get weight decay
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.RMSNorm)

#: parameter-name fragments that never get weight decay (matched against the full dotted name)
NO_DECAY_NAMES: tuple[str, ...] = ("bias", "lambda_", "logit_scale", "logit_bias")


def _norm_types() -> tuple[type[nn.Module], ...]:
    from diffmm.nn import RMSNorm

    return (*NORM_TYPES, RMSNorm)


def decay_split(model: nn.Module, extra_no_decay: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """Names of trainable parameters (with weight decay, without weight decay).

    No decay for: parameters with fewer than 2 dimensions, parameters of norm layers, and names
    containing ``bias``, ``lambda_``, ``logit_scale`` or any of ``extra_no_decay``.
    """
    norm_types = _norm_types()
    in_norm = {f"{mn}.{pn}" if mn else pn for mn, m in model.named_modules() if isinstance(m, norm_types)
               for pn, _ in m.named_parameters(recurse=False)}
    fragments = (*NO_DECAY_NAMES, *extra_no_decay)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim < 2 or name in in_norm or any(f in leaf or f in name for f in fragments):
            no_decay.append(name)
        else:
            decay.append(name)
    return decay, no_decay


def param_groups(model: nn.Module, weight_decay: float, extra_no_decay: Sequence[str] = ()) -> list[dict]:
    """Two AdamW groups ``{"params", "weight_decay", "names", "name"}``: with weight decay (``name="decay"``) and
    without (``"no_decay"``); empty ones dropped. ``name`` labels the learning-rate curves."""
    params = dict(model.named_parameters())
    decay, no_decay = decay_split(model, extra_no_decay)
    groups = [{"params": [params[n] for n in decay], "weight_decay": weight_decay, "names": decay, "name": "decay"},
              {"params": [params[n] for n in no_decay], "weight_decay": 0.0, "names": no_decay, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_adamw(groups: Iterable[dict], lr: float, betas: tuple[float, float], eps: float,
                fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over ``groups``; ``fused`` defaults to True when every parameter is on CUDA."""
    groups = [dict(g) for g in groups]
    for g in groups:
        g.pop("names", None)
    if fused is None:
        fused = all(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


class WarmupCosine:
    """LR multiplier per optimizer step: linear warmup from 0 to 1, then cosine down to ``min_lr / lr``.

    A callable object (not a lambda) so ``LambdaLR.state_dict()`` stores its settings.

    Args:
        warmup_steps: steps of linear warmup; the multiplier at step ``s < warmup_steps`` is ``(s+1)/warmup_steps``.
        total_steps: step at which the cosine reaches its floor (held afterwards).
        min_ratio: floor multiplier (``min_lr / lr``).
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}")
        self.warmup_steps, self.total_steps, self.min_ratio = int(warmup_steps), int(total_steps), float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step >= self.total_steps:
            return self.min_ratio
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def settings(self) -> dict:
        return {"warmup_steps": self.warmup_steps, "total_steps": self.total_steps, "min_ratio": self.min_ratio}


class WarmupCosineLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` with :class:`WarmupCosine` for every group (stepped once per optimizer step) that follows
    the *current* settings after a restore.

    ``load_state_dict`` restores the step count only: the schedule (peak lr, warmup, total, floor) is the one
    this scheduler was built with, i.e. the resumed run's config, and the groups' lr is re-derived at the
    restored step. With unchanged settings this is exactly the saved lr; extending a run (a larger
    ``max_steps``, hence ``total_steps``) continues on the cosine over the new total instead of the
    old one's floor. :attr:`restore_changes` says what differed (empty when nothing did).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, lr: float,
                 min_lr: float = 0.0) -> None:
        self.restore_changes: dict[str, tuple] = {}
        super().__init__(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr / lr if lr > 0 else 0.0))

    @property
    def schedule(self) -> WarmupCosine:
        return self.lr_lambdas[0]

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("restore_changes", None)  # not part of the schedule's state
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        settings, base_lrs = self.schedule.settings(), list(self.base_lrs)
        super().load_state_dict(state_dict)  # step count, and the saved settings (overridden below)
        saved = self.schedule.settings()
        self.restore_changes = {k: (saved[k], v) for k, v in settings.items() if saved[k] != v}
        if [float(b) for b in self.base_lrs] != [float(b) for b in base_lrs]:
            self.restore_changes["lr"] = (self.base_lrs[0], base_lrs[0])
        for fn in self.lr_lambdas:
            fn.__dict__.update(settings)
        self.base_lrs = base_lrs
        before = [g["lr"] for g in self.optimizer.param_groups]
        for group, base, fn in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            group["initial_lr"] = base
            group["lr"] = base * fn(self.last_epoch)
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if self.restore_changes:
            self.restore_changes["lr_at_step"] = (before[0], self._last_lr[0], self.last_epoch)

    def describe_restore(self) -> str:
        """One line on how the restored schedule differs from the saved one ('' when it does not)."""
        if not self.restore_changes:
            return ""
        c = self.restore_changes
        names = {"total_steps": "total_steps", "warmup_steps": "warmup_steps", "min_ratio": "min_lr/lr", "lr": "lr"}
        diffs = ", ".join(f"{names[k]} {v[0]:g} -> {v[1]:g}" for k, v in c.items() if k in names)
        a, b, step = c["lr_at_step"]
        return (f"resume: lr schedule recomputed from the current settings ({diffs}; warmup {self.schedule.warmup_steps} "
                f"steps); lr at step {step} re-derived: {a:.3g} -> {b:.3g}")


def warmup_cosine_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                            lr: float, min_lr: float = 0.0) -> WarmupCosineLR:
    """:class:`WarmupCosineLR` for every group of ``optimizer``."""
    return WarmupCosineLR(optimizer, warmup_steps, total_steps, lr, min_lr)
