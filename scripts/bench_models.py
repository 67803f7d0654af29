"""Forward+backward samples/s of DiffCLIP against open_clip's CLIP of equal size (and diffmm's own CLIP twin).

One contrastive training step (both towers, symmetric InfoNCE, AdamW-free: forward + backward only) on random
images and captions. Models are measured in interleaved rounds and the median per model is reported, so
machine noise hits all of them alike.

    python scripts/bench_models.py                      # tiny (batch 64) and ViT-B-16 (batch 2)
    python scripts/bench_models.py --sizes tiny --rounds 7 --json results/bench_models.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import open_clip
import torch
import torch.nn.functional as F
from open_clip.model import CLIP

import diffmm

SIZES = {
    # name: (diffmm configs, open_clip config of equal size, batch)
    "tiny": (("DiffCLIP-Tiny", "CLIP-Tiny"),
             dict(embed_dim=128, vision_cfg=dict(image_size=64, patch_size=8, width=128, layers=4, head_width=32),
                  text_cfg=dict(context_length=32, vocab_size=49408, width=128, heads=4, layers=4)), 64),
    "vit-b-16": (("DiffCLIP-ViT-B-16", "CLIP-ViT-B-16"), "ViT-B-16", 2),
}


def step(model, img, txt) -> None:
    i, t = model.encode_image(img, normalize=True), model.encode_text(txt, normalize=True)
    logits = 14.3 * i @ t.T
    labels = torch.arange(len(i))
    ((F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2).backward()
    model.zero_grad(set_to_none=True)


def bench_size(size: str, rounds: int, iters: int, batch: int | None) -> list[dict]:
    (diff_name, twin_name), oc_cfg, default_batch = SIZES[size]
    batch = batch or default_batch
    torch.manual_seed(0)
    models = {
        diff_name: diffmm.create_model(diff_name),
        f"{twin_name} (diffmm)": diffmm.create_model(twin_name),
        "open_clip CLIP": (open_clip.create_model(oc_cfg) if isinstance(oc_cfg, str) else CLIP(**oc_cfg)),
    }
    cfg = models[diff_name].config
    img = torch.randn(batch, 3, cfg.vision_cfg.image_size, cfg.vision_cfg.image_size)
    txt = torch.randint(1, 49000, (batch, cfg.text_cfg.context_length))
    txt[:, -1] = 49407  # EOT
    for m in models.values():
        m.train()
        step(m, img, txt)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(rounds):
        for name, m in models.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                step(m, img, txt)
            times[name].append((time.perf_counter() - t0) / iters)
    ref = statistics.median(times["open_clip CLIP"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append(dict(size=size, model=name, batch=batch, params_m=sum(p.numel() for p in models[name].parameters())
                         / 1e6, sec_per_step=med, samples_per_s=batch / med, slowdown_vs_open_clip=med / ref))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,vit-b-16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=0, help="steps per round (default: 5 tiny, 1 ViT-B-16)")
    p.add_argument("--batch", type=int, default=0, help="override the batch of every size")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for size in args.sizes.split(","):
        iters = args.iters or (5 if size == "tiny" else 1)
        rounds = args.rounds if size == "tiny" else max(2, args.rounds // 2)
        rows += bench_size(size, rounds, iters, args.batch or None)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, fp32, forward+backward")
    print(f"| {'size':<8} | {'model':<26} | batch | params (M) | s/step | samples/s | time vs open_clip |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']:<8} | {r['model']:<26} | {r['batch']:5d} | {r['params_m']:10.1f} "
              f"| {r['sec_per_step']:6.3f} "
              f"| {r['samples_per_s']:9.1f} | {r['slowdown_vs_open_clip']:.2f}x |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
