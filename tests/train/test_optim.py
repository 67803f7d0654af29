"""AdamW groups (no decay on biases, norms, lambdas, logit_scale, 1-D params) and the warmup + cosine schedule."""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn as nn

from diffmm.nn import RMSNorm
from diffmm.train.optim import WarmupCosine, WarmupCosineLR, adamw, param_groups
from train_helpers import TinyCLIP


def decay_split(model: nn.Module, no_decay=()) -> tuple[list[str], list[str]]:
    """Names of the parameters of param_groups' (decay, no_decay) groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: [names[id(p)] for p in g["params"]] for g in param_groups(model, 0.1, no_decay)}
    return groups.get("decay", []), groups.get("no_decay", [])


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
    opt = adamw(model, 1e-3, 0.5, (0.9, 0.98), 1e-8)
    wd = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert wd == {"decay": 0.5, "no_decay": 0.0}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_adamw_is_fused_on_the_cpu_and_steps_as_the_loop():
    """The fused kernel on CPU parameters (torch's default there is a per-tensor loop): the same fp32 update as the
    loop up to rounding, over a few steps with weight decay."""
    torch.manual_seed(0)
    model, twin = TinyCLIP(), TinyCLIP()
    twin.load_state_dict(model.state_dict())
    opt = adamw(model, 1e-2, 0.1, (0.9, 0.98), 1e-8)
    assert opt.defaults["fused"] is True
    loop = torch.optim.AdamW(param_groups(twin, 0.1), lr=1e-2, betas=(0.9, 0.98), eps=1e-8, foreach=False)
    for _ in range(3):
        for m in (model, twin):
            for i, p in enumerate(m.parameters()):
                p.grad = torch.sin(torch.arange(p.numel(), dtype=p.dtype) + i).reshape(p.shape)
        opt.step()
        loop.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6, msg=name)
    with torch.device("meta"):
        assert adamw(TinyCLIP(), 1e-2, 0.1, (0.9, 0.98), 1e-8).defaults["fused"] is None  # elsewhere: torch's choice


def test_warmup_cosine_values():
    f = WarmupCosine(warmup_steps=10, total_steps=110, min_ratio=0.02)
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.02 + 0.98 * 0.5)  # half way through the cosine
    assert f(110) == pytest.approx(0.02) and f(500) == pytest.approx(0.02)
    vals = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_scheduler_reaches_min_lr_and_restores(caplog):
    p = nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([p], lr=5e-4)
    sched = WarmupCosineLR(opt, 3, 20, lr=5e-4, min_lr=1e-5)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(5e-4 / 3) and lrs[2] == pytest.approx(5e-4)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5)
    state = sched.state_dict()
    assert state["lr_lambdas"][0] == {"warmup_steps": 3, "total_steps": 20, "min_ratio": pytest.approx(0.02)}
    # restoring with the same settings: the same step and exactly the saved lr, and no note
    opt2 = torch.optim.AdamW([p], lr=5e-4)
    sched2 = WarmupCosineLR(opt2, 3, 20, lr=5e-4, min_lr=1e-5)
    opt2.load_state_dict(opt.state_dict())
    with caplog.at_level(logging.INFO, logger="diffmm.train"):
        sched2.load_state_dict(state)
    assert sched2.last_epoch == 20 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert "recomputed" not in caplog.text


def test_restored_schedule_follows_the_new_total(caplog):
    """Extending a finished run: the cosine continues over the new total from the restored step, warmup unchanged."""
    p = nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    sched = WarmupCosineLR(opt, 2, 10, lr=1e-3, min_lr=1e-5)
    for _ in range(10):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5)  # the first run ended on the floor
    opt2 = torch.optim.AdamW([p], lr=1e-3)
    sched2 = WarmupCosineLR(opt2, 2, 20, lr=1e-3, min_lr=1e-5)  # Lightning's order: build, then restore
    opt2.load_state_dict(opt.state_dict())  # the optimizer state brings the old lr back ...
    with caplog.at_level(logging.INFO, logger="diffmm.train"):
        sched2.load_state_dict(sched.state_dict())  # ... the schedule re-derives it for the new total
    fresh = WarmupCosine(2, 20, 1e-5 / 1e-3)
    lrs = []
    for step in range(10, 20):
        lrs.append(opt2.param_groups[0]["lr"])
        assert lrs[-1] == pytest.approx(1e-3 * fresh(step)), step
        opt2.step()
        sched2.step()
    assert lrs[0] == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 8 / 18)))  # ~0.59e-3
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-5)
    assert sched2.lr_lambdas[0].total_steps == 20 and sched2.state_dict()["lr_lambdas"][0]["total_steps"] == 20
    note = caplog.text
    assert "total_steps 10 -> 20" in note and "warmup 2 steps" in note and "lr at step 10 re-derived: 1e-05 -> " in note


def test_schedule_floor_when_warmup_fills_the_run():
    f = WarmupCosine(warmup_steps=3, total_steps=3, min_ratio=0.02)
    assert [f(s) for s in range(5)] == [pytest.approx(1 / 3), pytest.approx(2 / 3), 1.0, 0.02, 0.02]


def test_bad_schedule_is_refused():
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(30, 20)
    assert math.isclose(WarmupCosine(0, 1)(0), 1.0)
