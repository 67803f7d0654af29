"""DINOv2 upcycled so that it can become differential: the pretrained ViT-S/14 with its last ``--blocks`` blocks
trainable, standard (the twin) or upcycled to differential attention with the lambdas and norm gates at their own lr.

    PYTHONPATH=. python studies/mechanism/dinov2.py --data data --seeds 0 1 2

One JSON per run, ``results/mechanism/dinov2/<arm>-s<seed>.json``: zero-shot at the end; per upcycled block lambda,
the norm gate beta (per head) and ||A1 - A2|| of the CLS row (per head, held-out images) at step 0 and at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vit import cpu_model, losses  # noqa: E402

CONFIGS = {"standard": "configs/lit_clip_dinov2_emoji.yaml", "diff": "configs/lit_diffclip_dinov2_emoji.yaml"}
LAYERS = 12


def attn_types(arm: str, blocks: int) -> list[str]:
    return ["standard"] * (LAYERS - blocks) + [arm] * blocks


def fit_argv(arm: str, seed: int, args, run_dir: str) -> list[str]:
    """``diffmm fit`` of one arm and seed: the last ``blocks`` blocks and the final norm train at image_lr; for the
    differential arm the lambdas and norm gates at ``--gate-lr``."""
    train = "::".join(os.path.join(args.data, "emoji", s, "*.tar") for s in ("noto", "openmoji"))
    logger = {"class_path": "pytorch_lightning.loggers.CSVLogger",
              "init_args": {"save_dir": run_dir, "name": "csv", "version": ""}}
    unlocked = [f"visual.blocks.{i}." for i in range(LAYERS - args.blocks, LAYERS)] + ["visual.norm."]
    argv = [os.path.join(os.path.dirname(sys.executable), "diffmm"), "fit", "--config", CONFIGS[arm],
            f"--seed_everything={seed}", f"--data.init_args.seed={seed}", f"--data.init_args.train_shards={train}",
            "--data.init_args.val_shards=null", "--data.init_args.num_workers=1", "--model.init_args.zeroshot=null",
            f"--model.init_args.lock_image_unlocked={json.dumps(unlocked)}",
            f"--model.init_args.model_kwargs={json.dumps({'vision_cfg': {'attn_type': attn_types(arm, args.blocks)}})}",
            f"--model.init_args.image_lr={args.image_lr}", f"--trainer.max_steps={args.steps}",
            "--trainer.log_every_n_steps=10", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={run_dir}",
            f"--trainer.logger={json.dumps(logger)}", f"--checkpoint.every_n_train_steps={args.steps}",
            "--checkpoint.save_top_k=-1", "--checkpoint.save_last=false", "--checkpoint.filename={step:04d}",
            "--checkpoint.save_weights_only=true"]
    if arm == "diff":
        lrs = {"*.lambda_*": args.gate_lr, "*.norm_gate": args.gate_lr}
        argv.append(f"--model.init_args.param_lr={json.dumps(lrs)}")
    return argv


def block_state(model, sets, n: int, blocks: int) -> dict:
    """lambda, beta and ||A1 - A2|| (CLS row) of the last ``blocks`` attention layers of the image tower."""
    from probes import attention_mass
    layers = [m for m in model.visual.modules() if hasattr(m, "norm_gate")]
    att = attention_mass(model, sets, n=n, layers=list(range(-blocks, 0)))
    return {"lambda": [float(m.lambda_full()) for m in layers],
            "beta": [m.norm_gate.detach().tolist() for m in layers],
            "attention": att}


def evaluate(run_dir: str, arm: str, args) -> dict:
    import glob

    import torch

    from diffmm import create_model, load_pretrained
    from probes import EmojiSets, encode, zero_shot
    t0 = time.perf_counter()
    sets = EmojiSets(args.data)
    torch.manual_seed(args.seed)
    name = "LiT-DiffCLIP-DINOv2-MiniLM" if arm == "diff" else "LiT-CLIP-DINOv2-MiniLM"
    start = create_model(name, vision_cfg={"attn_type": attn_types(arm, args.blocks)}).eval()  # step 0
    out = {"start": block_state(start, sets, args.attn_images, args.blocks)}
    del start
    path = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step=*.ckpt")))[-1]
    model = load_pretrained(path).eval()
    out["end"] = block_state(model, sets, args.attn_images, args.blocks)
    out["zero_shot"] = zero_shot(model, sets, encode(model, [s["image"] for s in sets.held]))
    out["eval_seconds"] = time.perf_counter() - t0
    return out


def run_one(arm: str, seed: int, args) -> str:
    out = os.path.join(args.out, f"{arm}-s{seed}.json")
    if os.path.exists(out):
        return f"{arm} seed {seed}: done before"
    run_dir = os.path.join(args.runs, f"{arm}-s{seed}")
    argv = fit_argv(arm, seed, args, run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    with open(os.path.join(args.runs, f"{arm}-s{seed}.log"), "w") as log:
        subprocess.run(argv, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    train_s = time.perf_counter() - t0
    ev = subprocess.run([sys.executable, __file__, "--evaluate", run_dir, "--arm", arm, "--seed", str(seed),
                         *sys.argv[1:]], check=True, env=env, capture_output=True, text=True)
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    result.update(arm=arm, seed=seed, steps=args.steps, blocks=args.blocks, gate_lr=args.gate_lr,
                  image_lr=args.image_lr, command=shlex.join(["diffmm", *argv[1:]]), train_seconds=train_s,
                  train_loss=losses(os.path.join(run_dir, "csv", "metrics.csv")), threads=args.threads,
                  cpu=cpu_model(), load_end=os.getloadavg())
    os.makedirs(args.out, exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(out + ".tmp", out)
    return (f"{arm} seed {seed}: groups {100 * result['zero_shot']['group']['top1']:.1f} %, "
            f"lambda {[round(v, 3) for v in result['end']['lambda']]}, train {train_s:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data")
    p.add_argument("--arms", nargs="+", default=["standard", "diff"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--blocks", type=int, default=4, help="last blocks trainable (upcycled in the diff arm)")
    p.add_argument("--image-lr", type=float, default=3e-5)
    p.add_argument("--gate-lr", type=float, default=1e-2, help="peak lr of the lambdas and norm gates")
    p.add_argument("--attn-images", type=int, default=128)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/mechanism/dinov2")
    p.add_argument("--runs", default="runs/mechanism/dinov2")
    p.add_argument("--evaluate", help=argparse.SUPPRESS)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.evaluate:
        print(json.dumps(evaluate(args.evaluate, args.arm, args)))
        return
    os.makedirs(args.runs, exist_ok=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda j: run_one(*j, args), [(a, s) for s in args.seeds for a in args.arms]):
            print(f"[{time.perf_counter() - t0:6.0f} s] {line}", flush=True)


if __name__ == "__main__":
    main()
