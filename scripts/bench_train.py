"""Training-step throughput: diffmm's Lightning modules vs a plain PyTorch loop vs open_clip's training step.

    PYTHONPATH=. python scripts/bench_train.py       # CLIP-Tiny / DiffCLIP-Tiny on emoji shards + a tiny DIFF LM
    PYTHONPATH=. python scripts/bench_train.py --clip-models DiffCLIP-Tiny --clip-batch 64 --threads 2 --repeats 9 \
        --no-lm --json results/bench_train_diffclip.json       # DiffCLIP-Tiny vs open_clip, paired rounds (issue 32)

Every contender trains the same model (same init) on the same batches, cached in memory so the data loader is out
of the picture (``scripts/bench_data.py`` measures it). Time is measured the same way for all: from the request of
batch ``warmup`` to the request of the last batch, so all per-step overhead (hooks, logging, progress bar, LR
schedule, clipping) is inside.

* ``lightning``: ``pl.Trainer.fit`` with diffmm's module and what the ``diffmm`` CLI adds
  (TensorBoard + CSV loggers every 10 steps, LR monitor, ModelCheckpoint, progress bar, lambda logging).
* ``plain``: the same model, loss, AdamW groups, warmup+cosine, clipping, logit-scale clamp in a
  hand-written loop (loss ``.item()`` every 10 steps).
* ``open_clip``: ``open_clip_train.train.train_one_epoch`` (when installed; otherwise the plain loop with
  ``open_clip.loss.ClipLoss``) on open_clip's own CLIP of the same size (also the peer of DiffCLIP).

Runs alternate between contenders ``--repeats`` times (a round: every contender back to back, the order reversed
every round); the table shows medians, and the speed against open_clip as the median [range] of the per-round
ratios of the runs' median steps (open_clip / plain loop; CPU clock at 1 thread, else wall). The JSON records
the CPU model, torch version, threads and the 1-minute load average at start and end.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from argparse import Namespace
from typing import Callable

import open_clip
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss
from open_clip.model import CLIPTextCfg, CLIPVisionCfg
from pytorch_lightning.callbacks import LearningRateMonitor
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

import diffmm
from bench_common import environment, paired, write_json
from diffmm.models.clip.config import get_model_config
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.train.callbacks import Checkpoint
from diffmm.train.checkpoint_io import AtomicCheckpointIO
from diffmm.train.clip_module import CLIPModule
from diffmm.train.datamodules import ImageTextDataModule
from diffmm.train.lm_module import LMModule
from diffmm.train.losses import ContrastiveLoss, next_token_loss
from diffmm.train.optim import WarmupCosineLR, adamw


class TimedBatches:
    """Cached batches, iterated ``steps`` times; records when each batch is requested (wall and CPU clocks)."""
    def __init__(self, batches: list, steps: int, compile: bool = False) -> None:
        self.batches, self.steps, self.times, self.cpu, self.compile = batches, steps, [], [], compile

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        self.times, self.cpu = [], []
        for i in range(self.steps):
            self.times.append(time.perf_counter())
            self.cpu.append(time.process_time())
            yield self.batches[i % len(self.batches)]

    @property  # what open_clip_train's train_one_epoch reads: num_batches, num_samples
    def num_batches(self) -> int:
        return self.steps

    @property
    def num_samples(self) -> int:
        return self.steps * len(self.batches[0][0])

    def step_times(self, warmup: int, clock: str = "wall") -> list[float]:
        """Seconds of each measured step (request of batch i to request of batch i+1, i >= warmup)."""
        t = self.times if clock == "wall" else self.cpu
        return [b - a for a, b in zip(t[warmup:], t[warmup + 1:])]


# ----- data and losses -------------------------------------------------------------------------------
def clip_batches(n: int, batch: int, image_size: int, context_length: int, shards: str | None) -> list:
    """``n`` batches from ``shards`` (random images and captions without shards, or when they hold fewer)."""
    if shards:
        dm = ImageTextDataModule(shards, batch_size=batch, num_workers=0, image_size=image_size,
                                 context_length=context_length, shuffle_buffer=100)
        out = list(itertools.islice(dm.train_dataloader(), n))
        if len(out) == n:
            return out
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 3, image_size, image_size, generator=g),
             torch.randint(1, 49407, (batch, context_length), generator=g)) for _ in range(n)]


def lm_batches(n: int, batch: int, seq: int, vocab: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]


def clip_loss(model, batch):
    images, tokens = batch
    img, txt, scale = model(images, tokens)
    return ContrastiveLoss()(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), scale.clamp(max=100))


def open_clip_loss(model, batch):
    out = model(*batch)
    return ClipLoss()(out["image_features"], out["text_features"], out["logit_scale"])


def lm_loss(model, batch):
    return next_token_loss(model(batch[:, :-1]), batch[:, 1:])


# ----- contenders ------------------------------------------------------------------------------------
def run_lightning(module: pl.LightningModule, data: TimedBatches, steps: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision="32-true", gradient_clip_val=1.0,
                             log_every_n_steps=10, default_root_dir=root, enable_model_summary=False,
                             logger=[TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")],
                             callbacks=[LearningRateMonitor("step"),
                                        Checkpoint(dirpath=root, save_last=False, every_n_train_steps=10 ** 9)],
                             plugins=[AtomicCheckpointIO()], num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(module, train_dataloaders=data)


def run_plain(model: torch.nn.Module, data: TimedBatches, steps: int, loss_fn: Callable, lr: float, wd: float,
              clamp: bool) -> None:
    if data.compile:
        model.compile(fullgraph=True, dynamic=False)
    opt = adamw(model, lr, wd, (0.9, 0.98), 1e-8)
    sched = WarmupCosineLR(opt, 3, steps, lr, lr / 50)
    model.train()
    for i, batch in enumerate(data):
        loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if clamp:
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
        if i % 10 == 0:
            loss.item()


def run_open_clip(model: torch.nn.Module, data: TimedBatches, steps: int, lr: float, wd: float) -> str:
    """open_clip_train's ``train_one_epoch`` when installed, else the plain loop with ``ClipLoss``; which one ran."""
    if data.compile:
        model.compile(fullgraph=True, dynamic=False)
    try:
        from open_clip_train.scheduler import cosine_lr
        from open_clip_train.train import train_one_epoch
    except ImportError:  # an optional package
        run_plain(model, data, steps, open_clip_loss, lr, wd, clamp=True)
        return "the plain loop with open_clip.loss.ClipLoss (open_clip_train not installed)"
    opt = adamw(model, lr, wd, (0.9, 0.98), 1e-8)  # open_clip_train's parameter groups: the same rule
    args = Namespace(device="cpu", precision="fp32", distill=False, accum_freq=1, skip_scheduler=False,
                     horovod=False, grad_clip_norm=1.0, log_every_n_steps=10, batch_size=len(data.batches[0][0]),
                     world_size=1, rank=0, local_rank=0, wandb=False)
    loader = Namespace(dataloader=data, set_epoch=lambda epoch: None)
    logging.getLogger().setLevel(logging.WARNING)  # its per-step log lines would flood the table
    train_one_epoch(model, {"train": loader}, ClipLoss(), 0, opt, None, cosine_lr(opt, lr, 3, steps), None, args)
    return "open_clip_train.train_one_epoch"


def open_clip_twin(name: str) -> torch.nn.Module:
    """open_clip's CLIP with the sizes of diffmm config ``name`` (GELU in both towers)."""
    cfg = get_model_config(name)
    v, t = cfg.vision_cfg, cfg.text_cfg
    return open_clip.model.CLIP(cfg.embed_dim,
                                CLIPVisionCfg(layers=v.layers, width=v.width, head_width=v.head_width,
                                              mlp_ratio=v.mlp_ratio, patch_size=v.patch_size, image_size=v.image_size),
                                CLIPTextCfg(context_length=t.context_length, vocab_size=t.vocab_size, width=t.width,
                                            heads=t.heads, layers=t.layers, mlp_ratio=t.mlp_ratio), output_dict=True)


def clip_contenders(name: str, lr: float, wd: float) -> dict:
    """Lightning and the plain loop on diffmm's ``name``, open_clip's step on open_clip's CLIP of its size."""
    return {"lightning": lambda data, steps: run_lightning(
                CLIPModule(name, lr=lr, weight_decay=wd, warmup_steps=3, min_lr=lr / 50), data, steps),
            "plain": lambda data, steps: run_plain(diffmm.create_model(name), data, steps, clip_loss, lr, wd, True),
            "open_clip": lambda data, steps: run_open_clip(open_clip_twin(name), data, steps, lr, wd)}


def lm_contenders(cfg: LMConfig, lr: float, wd: float) -> dict:
    """Lightning and the plain loop on a DIFF LM of ``cfg``."""
    return {"lightning": lambda data, steps: run_lightning(LMModule(
                model=DiffLM(cfg), context_length=cfg.block_size, lr=lr, weight_decay=wd, warmup_steps=3,
                min_lr=lr / 50), data, steps),
            "plain": lambda data, steps: run_plain(DiffLM(cfg), data, steps, lm_loss, lr, wd, clamp=False)}


# ----- measure and report ----------------------------------------------------------------------------
def measure(label: str, unit: str, contenders: dict, batches: list, args, items: int, steps: int | None = None) -> dict:
    """Per-step wall and process-CPU times of every contender, pooled over alternating runs (on a shared machine the
    CPU time of this process, one compute thread, counts only the work done: the fairer overhead measure), and each
    run's median step. A contender may return a note (which open_clip step ran); the last one is kept."""
    steps = steps or args.steps
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in contenders}
    runs: dict[str, list[float]] = {k: [] for k in contenders}  # median step of each run (CPU clock at 1 thread)
    notes = {}
    for r in range(args.repeats):
        for name, fn in (list(contenders.items()) if r % 2 == 0 else list(contenders.items())[::-1]):
            data = TimedBatches(batches, steps, args.compile)
            torch.manual_seed(0)  # every contender's model from the same initialisation
            notes[name] = fn(data, steps)
            for clock in ("wall", "cpu"):
                times[name][clock] += data.step_times(args.warmup, clock)
            runs[name].append(statistics.median(data.step_times(args.warmup, "cpu" if args.threads == 1 else "wall")))
            print(f"# {label} run {r + 1}/{args.repeats} {name}: median step wall "
                  f"{statistics.median(times[name]['wall']):.4f} s, cpu {statistics.median(times[name]['cpu']):.4f} s",
                  file=sys.stderr)
    med = {k: {c: statistics.median(v[c]) for c in v} for k, v in times.items()}
    return {"label": label, "unit": unit, "items": items, "step_times": times, "median_step_s": med,
            "rate_cpu": {k: items / m["cpu"] for k, m in med.items()}, "run_median_wall_s": runs,
            "rate_wall": {k: items / m["wall"] for k, m in med.items()}, "note": notes.get("open_clip"),
            "speed_vs_open_clip": {k: paired(runs["open_clip"], runs[k]) for k in runs} if "open_clip" in runs
            else None}


def print_table(results: list[dict], args, env: dict, step_note: str) -> None:
    print(f"\n## Training-step throughput (CPU {env['cpu']}, torch {env['torch']}, {args.threads} compute thread(s); "
          f"{args.repeats} alternating runs per contender, first {args.warmup} steps of each run excluded; 1-min load "
          f"{env['load_1m_start']:.1f} at the start, {env['load_1m_end']:.1f} at the end)\n")
    print("Rates from the median step time measured on this process's CPU clock (wall-clock rates in brackets)"
          f"{'; plain loop and open_clip step compiled (--compile), Lightning eager' if args.compile else ''}.\n")
    print("| workload | unit | plain PyTorch | diffmm Lightning | open_clip step | Lightning overhead (CPU) | "
          "Lightning overhead (wall) | plain loop vs open_clip (paired) |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        c, w, sp = res["rate_cpu"], res["rate_wall"], res["speed_vs_open_clip"]
        oc, oc_ratio = "-", "-"
        if sp:
            oc = f"{c['open_clip']:.1f} ({w['open_clip']:.1f})"
            oc_ratio = f"{sp['plain']['median']:.2f}x [{sp['plain']['min']:.2f}-{sp['plain']['max']:.2f}]"
        print(f"| {res['label']} | {res['unit']} | {c['plain']:.1f} ({w['plain']:.1f}) | "
              f"{c['lightning']:.1f} ({w['lightning']:.1f}) | {oc} | {100 * (c['plain'] / c['lightning'] - 1):+.1f}% | "
              f"{100 * (w['plain'] / w['lightning'] - 1):+.1f}% | {oc_ratio} |")
    m = results[-1]["median_step_s"]  # the framework-cost row (unless --no-lm)
    if not args.no_lm:
        print(f"\nFramework cost per step (near-empty model): plain loop {1e3 * m['plain']['cpu']:.2f} ms, Lightning + "
              f"diffmm callbacks/loggers {1e3 * m['lightning']['cpu']:.2f} ms CPU (+"
              f"{1e3 * (m['lightning']['cpu'] - m['plain']['cpu']):.2f} ms per step).")
    if step_note:
        print(f"\nopen_clip step: {step_note}, on open_clip's CLIP of the same size.")
    print("Lightning overhead = extra time per step relative to the plain loop (target <= 5%).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clip-models", default="CLIP-Tiny,DiffCLIP-Tiny")
    p.add_argument("--clip-batch", type=int, default=32)
    p.add_argument("--shards", default="data/emoji/noto/emoji-noto-{000000..000001}.tar",
                   help="image-text shards for the cached batches (synthetic data when missing)")
    p.add_argument("--lm-model", default="diff-tiny")
    p.add_argument("--lm-kwargs",
                   default='{"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 128, "vocab_size": 8192}')
    p.add_argument("--lm-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="compute threads (1: CPU time = work done)")
    p.add_argument("--null-steps", type=int, default=200, help="steps of the framework-cost run")
    p.add_argument("--no-lm", action="store_true", help="CLIP models only (no LM, no framework-cost run)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--compile", action="store_true", help="plain loop and open_clip: model.compile(fullgraph=True)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    env = environment()
    lr, wd = 5e-4, 0.5
    shards = args.shards
    if shards and not os.path.exists(shards.replace("{000000..000001}", "000000")):
        print(f"# {shards} not found: synthetic batches", file=sys.stderr)
        shards = None

    results = []
    for name in [m for m in args.clip_models.split(",") if m]:
        cfg = get_model_config(name)
        batches = clip_batches(4, args.clip_batch, cfg.vision_cfg.image_size, cfg.text_cfg.context_length, shards)
        results.append(measure(f"{name} (batch {args.clip_batch})", "samples/s", clip_contenders(name, lr, wd),
                               batches, args, items=args.clip_batch))
    lm_cfg = LMConfig.from_name(args.lm_model, **json.loads(args.lm_kwargs))
    null_cfg = LMConfig.from_name("diff-tiny", n_layer=1, n_embd=8, n_head=2, vocab_size=16, block_size=4)
    for cfg, label, batch, steps in [] if args.no_lm else [  # the last: framework cost (a near-empty model)
            (lm_cfg, f"LM {args.lm_model} L{lm_cfg.n_layer} E{lm_cfg.n_embd} V{lm_cfg.vocab_size}", args.lm_batch, 0),
            (null_cfg, "framework (1-layer width-8 LM)", 1, args.null_steps)]:
        results.append(measure(f"{label} (batch {batch}x{cfg.block_size})", "steps/s" if steps else "tokens/s",
                               lm_contenders(cfg, lr, 0.05), lm_batches(4, batch, cfg.block_size, cfg.vocab_size), args,
                               items=1 if steps else batch * cfg.block_size, steps=steps))
    env["load_1m_end"] = os.getloadavg()[0]
    step_note = next((r["note"] for r in results if r["note"]), "")
    print_table(results, args, env, step_note)
    if args.json:
        write_json(args.json, {**env, "results": results, "args": vars(args), "open_clip_step": step_note})
    return 0


if __name__ == "__main__":
    sys.exit(main())
