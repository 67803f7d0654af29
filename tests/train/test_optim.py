"""AdamW groups (no decay on biases, norms, lambdas, logit_scale, 1-D params) and the warmup + cosine schedule."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from diffmm.nn import RMSNorm
from diffmm.train.optim import WarmupCosine, build_adamw, decay_split, param_groups, warmup_cosine_scheduler
from train_helpers import TinyCLIP


def test_decay_split_on_clip_standin():
    model = TinyCLIP()
    decay, no_decay = decay_split(model)
    assert set(decay) | set(no_decay) == {n for n, _ in model.named_parameters()}
    assert not set(decay) & set(no_decay)
    for name in no_decay:
        p = dict(model.named_parameters())[name]
        assert p.ndim < 2 or "lambda_" in name or "logit_scale" in name or name.endswith("bias"), name
    for name in ("logit_scale", "visual.blocks.0.attn.lambda_q1", "visual.blocks.0.attn.diff_norm.weight",
                 "visual.blocks.0.norm.weight", "visual.blocks.0.norm.bias", "visual.blocks.0.attn.q_proj.bias"):
        assert name in no_decay, name
    for name in ("visual.blocks.0.attn.q_proj.weight", "token_embedding.weight", "text_projection",
                 "visual.patch.weight", "visual.proj"):
        assert name in decay, name


def test_norm_weights_without_decay_even_if_2d():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.norm = RMSNorm(4)
            self.norm.weight = nn.Parameter(torch.ones(1, 4))  # a 2-D norm weight: still no decay

    decay, no_decay = decay_split(Odd())
    assert decay == ["lin.weight"] and set(no_decay) == {"lin.bias", "norm.weight"}


def test_param_groups_feed_adamw():
    model = TinyCLIP()
    groups = param_groups(model, 0.5)
    opt = build_adamw(groups, 1e-3, (0.9, 0.98), 1e-8)
    wd = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert wd == {"decay": 0.5, "no_decay": 0.0}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_warmup_cosine_values():
    f = WarmupCosine(warmup_steps=10, total_steps=110, min_ratio=0.02)
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.02 + 0.98 * 0.5)  # half way through the cosine
    assert f(110) == pytest.approx(0.02) and f(500) == pytest.approx(0.02)
    vals = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_scheduler_reaches_min_lr_and_restores():
    p = nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([p], lr=5e-4)
    sched = warmup_cosine_scheduler(opt, 3, 20, lr=5e-4, min_lr=1e-5)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(5e-4 / 3) and lrs[2] == pytest.approx(5e-4)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5)
    state = sched.state_dict()
    assert state["lr_lambdas"][0] == {"warmup_steps": 3, "total_steps": 20, "min_ratio": pytest.approx(0.02)}
    opt2 = torch.optim.AdamW([p], lr=5e-4)
    sched2 = warmup_cosine_scheduler(opt2, 0, 1, lr=5e-4)  # settings come back from the state dict
    sched2.load_state_dict(state)
    assert sched2.lr_lambdas[0].total_steps == 20 and sched2.last_epoch == 20


def test_bad_schedule_is_refused():
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(30, 20)
    assert math.isclose(WarmupCosine(0, 1)(0), 1.0)
