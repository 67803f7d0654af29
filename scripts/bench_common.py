"""What the CPU benchmarks ``scripts/bench_*.py`` share: the run's environment, training-step runners timed in
interleaved rounds, torch.profiler tables and the JSON output.

The benchmarks run as ``python scripts/bench_x.py``, so this folder is on ``sys.path`` and they import it as
``bench_common``. ``scripts/gpu_check.py`` does not (it stands alone on the device machine).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile


def environment() -> dict:
    """CPU model (/proc/cpuinfo), torch version, threads and the 1-minute load average now."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return {"cpu": model.group(1) if model else platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_1m_start": os.getloadavg()[0]}


def add_timing_args(p: argparse.ArgumentParser, rounds: int, iters: int, iters_help: str) -> None:
    """The flags of the interleaved-rounds benchmarks (bench_models.py, bench_lm.py)."""
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--iters", type=int, default=iters, help=iters_help)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads (0 = torch's default)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with the main thread's CPU time (robust on a busy machine; meaningful with --threads 1)")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="instead of timing, print torch.profiler's top K ops by self CPU time for one step of each")
    p.add_argument("--json", default="")


def contrastive_loss(encode_image: Callable, encode_text: Callable, images: torch.Tensor,
                     texts: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE of both towers' normalised features (fixed logit scale): a CLIP training step's loss."""
    i, t = encode_image(images, normalize=True), encode_text(texts, normalize=True)
    logits = 14.3 * i @ t.T
    labels = torch.arange(len(i))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class Runner:
    """One model, its AdamW and a training step: ``loss_fn(*batch)`` (of the model), backward, optimizer step."""

    def __init__(self, name: str, model: torch.nn.Module, loss_fn: Callable, weight_decay: float, **adamw):
        self.name, self.model, self.loss_fn = name, model.train(), loss_fn
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), weight_decay=weight_decay,
                                     **adamw)

    def step(self, *batch: torch.Tensor) -> None:
        self.loss_fn(*batch).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def params_m(self) -> float:
        return sum(p.numel() for p in self.model.parameters()) / 1e6


def warm_up(steps: dict[str, Callable[[], object]], n: int) -> dict[str, float]:
    """``n`` calls of each step (the first compiles, fills caches); the seconds each step's calls took."""
    warm = {}
    for name, step in steps.items():
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        warm[name] = time.perf_counter() - t0
    return warm


def interleaved_rounds(steps: dict[str, Callable[[], object]], rounds: int, iters: int, cpu_time: bool,
                       tag: str = "") -> tuple[dict[str, list[float]], list[float]]:
    """Seconds per call of every step in each of ``rounds`` rounds of ``iters`` calls, and the 1-minute load after
    each round. The order alternates every round, so no step always runs first and machine noise hits all of them
    alike; ``cpu_time`` times with the main thread's CPU time instead of the wall clock."""
    clock = time.thread_time if cpu_time else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in steps}
    loads = []
    for rnd in range(rounds):
        for name, step in (list(steps.items()) if rnd % 2 == 0 else list(steps.items())[::-1]):
            t0 = clock()
            for _ in range(iters):
                step()
            times[name].append((clock() - t0) / iters)
        loads.append(os.getloadavg()[0])
        print(f"  {tag}round {rnd + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()) +
              f" (load {loads[-1]:.1f})", flush=True)
    return times, loads


def paired(peer: list[float], ours: list[float]) -> dict:
    """Per-round ratios ``peer / ours`` of step times taken back to back (> 1: ours is faster): median, range, all."""
    r = [p / o for p, o in zip(peer, ours)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "rounds": r}


def print_profile(title: str, fn: Callable[[], object], row_limit: int) -> None:
    """A heading (``title`` and the 1-minute load) and torch.profiler's table of the top ``row_limit`` ops by self
    CPU time during one call of ``fn``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    print(f"\n### {title} (load {os.getloadavg()[0]:.1f})\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit, max_name_column_width=40))


def write_json(path: str, result: dict) -> None:
    """``result`` as indented JSON at ``path`` (parent folders created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))
