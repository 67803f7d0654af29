"""The ablation arms on the tiny LiT ViT: train each arm and seed with ``diffmm fit`` (the LiT configs, the arm's
attention type as a config override), then measure every 100-step checkpoint (:mod:`probes`).

    PYTHONPATH=. python studies/mechanism/vit.py all --data data --seeds 0 1 2 3 4 5 --jobs 2

Arms (docs/results.md, "The mechanism, isolated"):
    A  standard attention                         configs/lit_clip_tiny_emoji.yaml
    B  differential attention (the paper's)       configs/lit_diffclip_tiny_emoji.yaml
    C  B with lambda fixed at 0                   B + vision_cfg.attn_type=diff_nosub
    D  A with B's epilogue (head norm, 0.2 scale) A + vision_cfg.attn_type=standard_epilogue

One JSON per run, ``results/mechanism/vit/<arm>-s<seed>.json``; a finished run is not redone.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ARMS = {
    "A": ("configs/lit_clip_tiny_emoji.yaml", None),
    "B": ("configs/lit_diffclip_tiny_emoji.yaml", None),
    "C": ("configs/lit_diffclip_tiny_emoji.yaml", "diff_nosub"),
    "D": ("configs/lit_clip_tiny_emoji.yaml", "standard_epilogue"),
}


def fit_argv(arm: str, seed: int, steps: int, data: str, run_dir: str, every: int) -> list[str]:
    """The ``diffmm fit`` command line of one arm and seed."""
    config, attn = ARMS[arm]
    train = "::".join(os.path.join(data, "emoji", s, "*.tar") for s in ("noto", "openmoji"))
    logger = {"class_path": "pytorch_lightning.loggers.CSVLogger",
              "init_args": {"save_dir": run_dir, "name": "csv", "version": ""}}
    argv = [os.path.join(os.path.dirname(sys.executable), "diffmm"), "fit", "--config", config,
            f"--seed_everything={seed}", f"--data.init_args.seed={seed}",
            f"--data.init_args.train_shards={train}", "--data.init_args.val_shards=null",
            "--data.init_args.num_workers=1", "--model.init_args.zeroshot=null", f"--trainer.max_steps={steps}",
            "--trainer.log_every_n_steps=10", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={run_dir}",
            f"--trainer.logger={json.dumps(logger)}", f"--checkpoint.every_n_train_steps={every}",
            "--checkpoint.save_top_k=-1", "--checkpoint.save_last=false", "--checkpoint.filename={step:04d}",
            "--checkpoint.save_weights_only=true"]
    if attn:
        argv.append(f"--model.init_args.model_kwargs={json.dumps({'vision_cfg': {'attn_type': attn}})}")
    return argv


def losses(csv: str) -> dict:
    """Train loss per logged step from a CSV log."""
    import csv as csvmod
    out = {}
    with open(csv) as f:
        for row in csvmod.DictReader(f):
            if row.get("train/loss"):
                out[int(row["step"])] = float(row["train/loss"])
    return out


def evaluate(run_dir: str, data: str) -> dict:
    """Every checkpoint of a run: zero-shot; the last one also attention mass, robustness and probes."""
    import torch

    from diffmm import load_pretrained
    from probes import EmojiSets, attention_mass, encode, probes, robustness, zero_shot
    t0 = time.perf_counter()
    sets = EmojiSets(data)
    ckpts = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step=*.ckpt")))
    by_step, final = {}, {}
    for i, path in enumerate(ckpts):
        step = int(re.search(r"step=(\d+)", path).group(1))
        model = load_pretrained(path).eval()
        feats = encode(model, [s["image"] for s in sets.held])
        by_step[step] = zero_shot(model, sets, feats)
        if i == len(ckpts) - 1:
            final = {"step": step, "attention": attention_mass(model, sets), "robustness": robustness(model, sets),
                     **probes(model, sets, feats)}
            lam = [float(m.lambda_full()) for m in model.visual.modules() if hasattr(m, "lambda_full")]
            final["lambda"] = lam
    return {"zero_shot": by_step, "final": final, "eval_seconds": time.perf_counter() - t0,
            "torch_threads": torch.get_num_threads()}


def reattend(path: str, run_dir: str, data: str) -> None:
    """Recompute the final checkpoint's attention record of a finished run (JSON ``path``) with the current
    :func:`probes.attention_mass` (its positive / negative parts were added after the first results)."""
    from diffmm import load_pretrained
    from probes import EmojiSets, attention_mass
    with open(path) as f:
        result = json.load(f)
    last = os.path.join(run_dir, "checkpoints", f"step={result['final']['step']:04d}.ckpt")
    result["final"]["attention"] = attention_mass(load_pretrained(last).eval(), EmojiSets(data, scenes=False))
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def run_one(arm: str, seed: int, args) -> str:
    """Train and measure one arm and seed (skipped when its JSON exists); returns a line for the console."""
    out = os.path.join(args.out, f"{arm}-s{seed}.json")
    if os.path.exists(out):
        return f"{arm} seed {seed}: done before"
    run_dir = os.path.join(args.runs, f"{arm}-s{seed}")
    argv = fit_argv(arm, seed, args.steps, args.data, run_dir, args.every)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    with open(os.path.join(args.runs, f"{arm}-s{seed}.log"), "w") as log:
        subprocess.run(argv, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    train_s = time.perf_counter() - t0
    ev = subprocess.run([sys.executable, __file__, "evaluate", run_dir, "--data", args.data], check=True, env=env,
                        capture_output=True, text=True)
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    result.update(arm=arm, seed=seed, steps=args.steps, command=shlex.join(["diffmm", *argv[1:]]),
                  train_seconds=train_s,
                  train_loss=losses(os.path.join(run_dir, "csv", "metrics.csv")), threads=args.threads,
                  cpu=cpu_model(), load_end=os.getloadavg())
    os.makedirs(args.out, exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, out)
    g = result["zero_shot"][str(max(map(int, result["zero_shot"])))]["group"]["top1"]
    return f"{arm} seed {seed}: groups {100 * g:.1f} %, train {train_s:.0f} s, eval {result['eval_seconds']:.0f} s"


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all", help="train and measure arms x seeds")
    a.add_argument("--data", default="data")
    a.add_argument("--arms", nargs="+", default=list(ARMS))
    a.add_argument("--seeds", nargs="+", type=int, default=list(range(6)))
    a.add_argument("--steps", type=int, default=400)
    a.add_argument("--every", type=int, default=100)
    a.add_argument("--jobs", type=int, default=2, help="runs at a time")
    a.add_argument("--threads", type=int, default=1, help="torch threads per run")
    a.add_argument("--out", default="results/mechanism/vit")
    a.add_argument("--runs", default="runs/mechanism/vit")
    e = sub.add_parser("evaluate", help="measure one run's checkpoints (prints JSON)")
    e.add_argument("run_dir")
    e.add_argument("--data", default="data")
    r = sub.add_parser("reattend", help="recompute the attention record of finished runs")
    r.add_argument("--data", default="data")
    r.add_argument("--out", default="results/mechanism/vit")
    r.add_argument("--runs", default="runs/mechanism/vit")
    args = p.parse_args()
    if args.cmd == "reattend":
        for path in sorted(glob.glob(os.path.join(args.out, "*-s*.json"))):
            reattend(path, os.path.join(args.runs, os.path.basename(path)[:-5]), args.data)
            print(f"updated {path}", flush=True)
        return
    if args.cmd == "evaluate":
        print(json.dumps(evaluate(args.run_dir, args.data)))
        return
    os.makedirs(args.runs, exist_ok=True)
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]  # seed-major: every arm has seed 0 first
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda j: run_one(*j, args), jobs):
            print(f"[{time.perf_counter() - t0:6.0f} s] {line}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
