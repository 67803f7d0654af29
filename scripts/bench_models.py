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
import os
import statistics
from functools import partial

import open_clip
import torch
from open_clip.model import CLIP

import diffmm
from bench_common import (Runner, add_timing_args, contrastive_loss, environment, interleaved_rounds, print_profile,
                          warm_up, write_json)

SIZES = {
    # name: (diffmm configs, open_clip config of equal size, batch)
    "tiny": (("DiffCLIP-Tiny", "CLIP-Tiny"),
             dict(embed_dim=128, vision_cfg=dict(image_size=64, patch_size=8, width=128, layers=4, head_width=32),
                  text_cfg=dict(context_length=32, vocab_size=49408, width=128, heads=4, layers=4)), 64),
    "vit-b-16": (("DiffCLIP-ViT-B-16", "CLIP-ViT-B-16"), "ViT-B-16", 2),
}
OPEN_CLIP = "open_clip CLIP"


def runner(name: str, model: torch.nn.Module, compile_model: bool = False) -> Runner:
    """One model with its AdamW (the same settings for every model) and, optionally, compiled encoders."""
    encoders = model.encode_image, model.encode_text
    if compile_model:
        encoders = torch.compile(model.encode_image), torch.compile(model.encode_text)
    return Runner(name, model, partial(contrastive_loss, *encoders), weight_decay=0.2, eps=1e-8)


def warmed_up(size: str, args) -> tuple[list[Runner], dict, dict, int]:
    """The size's runners, their training steps on one batch of random images and texts after ``--warmup`` calls
    each, the seconds those took, and the batch size."""
    (diff_name, twin_name), oc_cfg, batch = SIZES[size]
    torch.manual_seed(0)
    runners = [runner(diff_name, diffmm.create_model(diff_name)),
               runner(f"{twin_name} (diffmm)", diffmm.create_model(twin_name)),
               runner(OPEN_CLIP, open_clip.create_model(oc_cfg) if isinstance(oc_cfg, str) else CLIP(**oc_cfg))]
    if args.compile:
        runners += [runner(f"{diff_name} (compile)", diffmm.create_model(diff_name), compile_model=True),
                    runner(f"{twin_name} (diffmm, compile)", diffmm.create_model(twin_name), compile_model=True)]
    cfg, batch = runners[0].model.config, args.batch or batch
    g = torch.Generator().manual_seed(0)
    img = torch.randn(batch, 3, cfg.vision_cfg.image_size, cfg.vision_cfg.image_size, generator=g)
    txt = torch.randint(1, 49000, (batch, cfg.text_cfg.context_length), generator=g)
    txt[:, -1] = 49407  # EOT
    steps = {r.name: partial(r.step, img, txt) for r in runners}
    return runners, steps, warm_up(steps, args.warmup), batch


def bench_size(size: str, args) -> list[dict]:
    iters = args.iters or (5 if size == "tiny" else 1)
    rounds = args.rounds if size == "tiny" else max(2, args.rounds // 2)
    runners, steps, warm, batch = warmed_up(size, args)
    times, loads = interleaved_rounds(steps, rounds, iters, args.cpu_time, tag=f"{size} ")
    ref = statistics.median(times[OPEN_CLIP])
    rows = []
    for r in runners:
        med = statistics.median(times[r.name])
        paired = statistics.median(o / t for o, t in zip(times[OPEN_CLIP], times[r.name]))
        rows.append(dict(size=size, model=r.name, batch=batch, params_m=r.params_m(), sec_per_step=med,
                         samples_per_s=batch / med, speed_vs_open_clip=ref / med, speed_vs_open_clip_paired=paired,
                         warmup_s=warm[r.name], loadavg_1m=[min(loads), max(loads)], all_s=times[r.name]))
    return rows


def profile_steps(args) -> int:
    """torch.profiler table (top ``args.profile`` ops by self CPU time) of one training step per model."""
    for size in args.sizes.split(","):
        for name, step in warmed_up(size, args)[1].items():
            print_profile(f"{size} {name}: one training step, {torch.get_num_threads()} threads", step, args.profile)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,vit-b-16")
    add_timing_args(p, rounds=7, iters=0, iters_help="steps per round (default: 5 tiny, 1 ViT-B-16)")
    p.add_argument("--batch", type=int, default=0, help="override the batch of every size")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd diffmm models")
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
        write_json(args.json, {**env, "clock": "thread_cpu" if args.cpu_time else "wall", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
