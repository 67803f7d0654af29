"""Training throughput of DiffCLIP against open_clip's CLIP of equal size (and diffmm's own CLIP twin), in one process.

One contrastive training step per model: both towers, symmetric InfoNCE on normalised features, backward,
AdamW step (the same optimizer settings for every model), on random images and captions. Models are timed in
interleaved rounds (the order alternates every round) and the median per model is reported, so machine noise
hits all of them alike; the 1-minute load average is printed beside the table. "paired" is the median over
rounds of open_clip's time / the model's time in the same round: a round's models share one load state, so
this ratio is steadier than the ratio of medians when the machine is not perfectly quiet. The JSON records the
CPU model, torch version, threads and the 1-minute load average at start and end.

    PYTHONPATH=. python scripts/bench_models.py                      # tiny (batch 64) and ViT-B-16 (batch 2), 2 threads
    PYTHONPATH=. python scripts/bench_models.py --sizes tiny --rounds 7 --json results/bench_models.json
    PYTHONPATH=. python scripts/bench_models.py --sizes tiny --compile    # also torch.compile'd diffmm models
    PYTHONPATH=. python scripts/bench_models.py --sizes tiny --profile 25 # torch.profiler top ops per model
    PYTHONPATH=. python scripts/bench_models.py --threads 1 --cpu-time    # on a busy machine: thread CPU time
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

import open_clip
import torch
import torch.nn.functional as F
from open_clip.model import CLIP
from torch.profiler import ProfilerActivity, profile

import diffmm

SIZES = {
    # name: (diffmm configs, open_clip config of equal size, batch)
    "tiny": (("DiffCLIP-Tiny", "CLIP-Tiny"),
             dict(embed_dim=128, vision_cfg=dict(image_size=64, patch_size=8, width=128, layers=4, head_width=32),
                  text_cfg=dict(context_length=32, vocab_size=49408, width=128, heads=4, layers=4)), 64),
    "vit-b-16": (("DiffCLIP-ViT-B-16", "CLIP-ViT-B-16"), "ViT-B-16", 2),
}
OPEN_CLIP = "open_clip CLIP"


def environment() -> dict:
    """CPU model (/proc/cpuinfo), torch version, threads and the 1-minute load average now."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return {"cpu": model.group(1) if model else platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_1m_start": os.getloadavg()[0]}


class Runner:
    """One model, its AdamW and (optionally) its compiled encoders."""

    def __init__(self, name: str, model: torch.nn.Module, compile_model: bool = False):
        self.name, self.model = name, model.train()
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.2)
        self.encode_image, self.encode_text = model.encode_image, model.encode_text
        if compile_model:
            self.encode_image = torch.compile(model.encode_image)
            self.encode_text = torch.compile(model.encode_text)

    def step(self, img: torch.Tensor, txt: torch.Tensor) -> None:
        i, t = self.encode_image(img, normalize=True), self.encode_text(txt, normalize=True)
        logits = 14.3 * i @ t.T
        labels = torch.arange(len(i))
        ((F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def warmed_up(size: str, args) -> tuple[list[Runner], dict, tuple]:
    """The size's runners after ``--warmup`` steps each, the seconds those took, and the batch (images, texts)."""
    (diff_name, twin_name), oc_cfg, batch = SIZES[size]
    torch.manual_seed(0)
    runners = [Runner(diff_name, diffmm.create_model(diff_name)),
               Runner(f"{twin_name} (diffmm)", diffmm.create_model(twin_name)),
               Runner(OPEN_CLIP, open_clip.create_model(oc_cfg) if isinstance(oc_cfg, str) else CLIP(**oc_cfg))]
    if args.compile:
        runners += [Runner(f"{diff_name} (compile)", diffmm.create_model(diff_name), compile_model=True),
                    Runner(f"{twin_name} (diffmm, compile)", diffmm.create_model(twin_name), compile_model=True)]
    cfg, batch = runners[0].model.config, args.batch or batch
    g = torch.Generator().manual_seed(0)
    img = torch.randn(batch, 3, cfg.vision_cfg.image_size, cfg.vision_cfg.image_size, generator=g)
    txt = torch.randint(1, 49000, (batch, cfg.text_cfg.context_length), generator=g)
    txt[:, -1] = 49407  # EOT
    warm = {}
    for r in runners:
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            r.step(img, txt)
        warm[r.name] = time.perf_counter() - t0
    return runners, warm, (img, txt)


def bench_size(size: str, args) -> list[dict]:
    iters = args.iters or (5 if size == "tiny" else 1)
    rounds = args.rounds if size == "tiny" else max(2, args.rounds // 2)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    runners, warm, data = warmed_up(size, args)
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    loads = []
    for rnd in range(rounds):
        for r in (runners if rnd % 2 == 0 else runners[::-1]):
            t0 = clock()
            for _ in range(iters):
                r.step(*data)
            times[r.name].append((clock() - t0) / iters)
        loads.append(os.getloadavg()[0])
        print(f"  {size} round {rnd + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()) +
              f" (load {loads[-1]:.1f})", flush=True)
    ref, batch = statistics.median(times[OPEN_CLIP]), len(data[0])
    rows = []
    for r in runners:
        med = statistics.median(times[r.name])
        paired = statistics.median(o / t for o, t in zip(times[OPEN_CLIP], times[r.name]))
        rows.append(dict(size=size, model=r.name, batch=batch, params_m=sum(p.numel() for p in r.model.parameters())
                         / 1e6, sec_per_step=med, samples_per_s=batch / med, speed_vs_open_clip=ref / med,
                         speed_vs_open_clip_paired=paired,
                         warmup_s=warm[r.name], loadavg_1m=[min(loads), max(loads)], all_s=times[r.name]))
    return rows


def profile_steps(args) -> int:
    """torch.profiler table (top ``args.profile`` ops by self CPU time) of one training step per model."""
    for size in args.sizes.split(","):
        runners, _, data = warmed_up(size, args)
        for r in runners:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                r.step(*data)
            print(f"\n### {size} {r.name}: one training step, {torch.get_num_threads()} threads "
                  f"(load {os.getloadavg()[0]:.1f})\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile,
                                            max_name_column_width=40))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,vit-b-16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=0, help="steps per round (default: 5 tiny, 1 ViT-B-16)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=0, help="override the batch of every size")
    p.add_argument("--threads", type=int, default=2, help="torch threads (0 = torch's default)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with the main thread's CPU time (robust on a busy machine; meaningful with --threads 1)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd diffmm models")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="instead of timing, print torch.profiler's top K ops by self CPU time for one step of each")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        args.warmup = max(1, args.warmup)
        return profile_steps(args)
    env = environment()
    rows = [row for size in args.sizes.split(",") for row in bench_size(size, args)]
    env["load_1m_end"] = os.getloadavg()[0]
    loads = [x for r in rows for x in r["loadavg_1m"]]
    print(f"\ntorch {env['torch']}, {env['threads']} threads, CPU ({env['cpu']}), fp32, forward+backward+AdamW, "
          f"{'thread CPU time' if args.cpu_time else 'wall time'}, median of interleaved rounds; 1-min load "
          f"{min(loads):.1f}-{max(loads):.1f}\n")
    print("| size | model | batch | params (M) | s/step | samples/s | speed vs open_clip | paired | warm-up s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['model']} | {r['batch']} | {r['params_m']:.1f} | {r['sec_per_step']:.3f} "
              f"| {r['samples_per_s']:.1f} | {r['speed_vs_open_clip']:.2f}x "
              f"| {r['speed_vs_open_clip_paired']:.2f}x | {r['warmup_s']:.1f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**env, "clock": "thread_cpu" if args.cpu_time else "wall",
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
