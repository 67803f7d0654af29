"""The one optimizer and schedule of diffmm's training: AdamW with decay / no-decay groups, and a per-step linear
warmup + cosine learning rate that follows the current settings when a run is resumed or extended."""
from __future__ import annotations

import fnmatch
import logging
import math
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from diffmm.nn import RMSNorm

log = logging.getLogger("diffmm.train")

#: module types whose parameters never get weight decay
NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.RMSNorm, RMSNorm)
#: parameter-name fragments that never get weight decay (matched against the full dotted name)
NO_DECAY_NAMES = ("bias", "lambda_", "logit_scale", "logit_bias")


def param_groups(model: nn.Module, weight_decay: float, no_decay: Sequence[str] = (),
                 lrs: Optional[Mapping[str, float]] = None) -> list[dict]:
    """AdamW groups ``{"params", "weight_decay", "name"}``: ``"decay"`` (matrices) and ``"no_decay"`` (parameters
    with fewer than 2 dimensions, parameters of norm layers, and names containing ``bias``, ``lambda_``,
    ``logit_scale`` or a fragment of ``no_decay``); empty groups are dropped. ``name`` labels the lr curves.
    Frozen parameters (``requires_grad=False``) are left out.

    ``lrs`` maps parameter-name prefixes, or glob patterns matched against the whole name (``fnmatch``, e.g.
    ``"*.lambda_*"``), to their own learning rate (e.g. ``{"text.transformer.": 1e-5}``; the first key that matches
    a name wins): those parameters get groups ``"decay <prefix>"`` / ``"no_decay <prefix>"`` with ``"lr"`` set (the
    schedule scales each group's own lr)."""
    in_norm = {id(p) for m in model.modules() if isinstance(m, NORM_TYPES) for p in m.parameters(recurse=False)}
    fragments = (*NO_DECAY_NAMES, *no_decay)
    prefixes = list(lrs or {})
    split: dict[tuple[str, Optional[str]], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            plain = p.ndim < 2 or id(p) in in_norm or any(f in name for f in fragments)
            prefix = next((x for x in prefixes if name.startswith(x) or fnmatch.fnmatchcase(name, x)),
                          None)
            split.setdefault(("no_decay" if plain else "decay", prefix), []).append(p)
    groups = []
    for prefix in [None, *prefixes]:
        for kind, wd in (("decay", weight_decay), ("no_decay", 0.0)):
            params = split.get((kind, prefix))
            if params:
                extra = {} if prefix is None else {"lr": float(lrs[prefix])}
                groups.append({"params": params, "weight_decay": wd, "name": kind + (f" {prefix}" if prefix else ""),
                               **extra})
    return groups


def adamw(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
          no_decay: Sequence[str] = (), lrs: Optional[Mapping[str, float]] = None) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; the fused implementation (one kernel over all tensors) when every parameter
    is a floating-point tensor on CUDA or the CPU. On a CPU torch's default is a per-tensor loop: 23 -> 5 ms a step
    for DiffCLIP-Tiny's 181 tensors, 390 -> 28 ms for the 58M LM (2 threads; docs/attention.md, "CPU step")."""
    groups = param_groups(model, weight_decay, no_decay, lrs)
    fused = all(p.device.type in ("cuda", "cpu") and p.is_floating_point() for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


class WarmupCosine:
    """LR multiplier per optimizer step: linear warmup from 0 to 1, then cosine down to ``min_ratio``, held after.

    A callable object (not a lambda) so ``LambdaLR.state_dict()`` stores its settings.

    Args:
        warmup_steps: steps of linear warmup; the multiplier at step ``s < warmup_steps`` is ``(s+1)/warmup_steps``.
        total_steps: step at which the cosine reaches its floor.
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


class WarmupCosineLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` with :class:`WarmupCosine` for every group (stepped once per optimizer step) that follows the
    *current* settings after a restore.

    ``load_state_dict`` restores the step count only: the schedule (peak lr, warmup, total, floor) is the one this
    scheduler was built with, i.e. the resumed run's config, and the groups' lr is re-derived at the restored step.
    With unchanged settings this is exactly the saved lr; extending a run (a larger ``max_steps``, hence
    ``total_steps``) continues on the cosine over the new total instead of the old one's floor.
    An info line (rank 0) says what differed.

    Args:
        optimizer: its groups all follow the schedule.
        warmup_steps, total_steps: of :class:`WarmupCosine`.
        lr, min_lr: peak and floor learning rates.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, lr: float,
                 min_lr: float = 0.0) -> None:
        super().__init__(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr / lr if lr > 0 else 0.0))

    def load_state_dict(self, state_dict: dict) -> None:
        now = dict(vars(self.lr_lambdas[0]), lr=self.base_lrs[0])
        saved = dict(state_dict["lr_lambdas"][0] or {}, lr=state_dict["base_lrs"][0])
        before = self.optimizer.param_groups[0]["lr"]  # the saved lr (Lightning restores the optimizer first)
        self.last_epoch, self._step_count = state_dict["last_epoch"], state_dict["_step_count"]
        for group, base, fn in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            group["initial_lr"], group["lr"] = base, base * fn(self.last_epoch)
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        names = {"total_steps": "total_steps", "warmup_steps": "warmup_steps", "min_ratio": "min_lr/lr", "lr": "lr"}
        diffs = ", ".join(f"{names[k]} {saved[k]:g} -> {now[k]:g}" for k in names if float(saved[k]) != float(now[k]))
        if diffs and not (dist.is_available() and dist.is_initialized() and dist.get_rank() > 0):
            log.info("resume: lr schedule recomputed from the current settings (%s; warmup %d steps); lr at step %d "
                     "re-derived: %.3g -> %.3g", diffs, now["warmup_steps"], self.last_epoch, before, self._last_lr[0])
