"""Kill soak: a tiny ``diffmm fit`` SIGKILLed at random moments and resumed with ``--ckpt_path last`` must end
bit-identical (weights, optimizer state, the loss of every step) with the same run uninterrupted.

    PYTHONPATH=. python scripts/kill_soak.py                       # 16 kills over 120 steps, ~5 min on 2 cores
    PYTHONPATH=. python scripts/kill_soak.py --kills 4 --steps 40 --devices 2 --seed 1

Data: 24 images in 4 shards, batch 4 (6 batches an epoch, 20 epochs in 120 steps), a checkpoint every step, so
many kills land inside a save. Exit status 0 when bit-identical, 1 otherwise. See docs/fault_tolerance.md.
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import random
import signal
import subprocess
import sys
import time

import torch
import yaml
from PIL import Image

from diffmm.data.writer import ShardWriter
from diffmm.train.checkpoint_io import candidate_checkpoints


def shards(folder: str) -> str:
    with ShardWriter(folder, "s", maxcount=6) as w:
        for i in range(24):
            buf = io.BytesIO()
            Image.new("RGB", (16, 16), ((97 * i) % 256, (57 * i) % 256, (31 * i) % 256)).save(buf, "PNG")
            w.write(f"{i:04d}", {"png": buf.getvalue(), "txt": f"colour {i % 3} shade {i % 4}"})
    return os.path.join(folder, "s-{000000..000003}.tar")


def config(root: str, data: str, args) -> str:
    shrink = {"embed_dim": 16, "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 1,
                                              "head_width": 8},
              "text_cfg": {"context_length": 16, "width": 32, "heads": 4, "layers": 1}}
    cfg = {"seed_everything": 0,
           "trainer": {"accelerator": "cpu", "devices": args.devices, "max_steps": args.steps, "log_every_n_steps": 1,
                       "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": root,
                       "limit_val_batches": 0, "num_sanity_val_steps": 0,
                       "logger": {"class_path": "pytorch_lightning.loggers.CSVLogger",
                                  "init_args": {"save_dir": root, "name": "csv", "flush_logs_every_n_steps": 1}},
                       **({"strategy": "ddp"} if args.devices > 1 else {})},
           "model": {"class_path": "diffmm.train.CLIPModule", "init_args": {
               "model_name": "DiffCLIP-Tiny", "model_kwargs": shrink, "lr": 5e-3, "warmup_steps": 3,
               "total_steps": args.steps}},
           "data": {"class_path": "diffmm.train.ImageTextDataModule", "init_args": {
               "train_shards": data, "batch_size": 4 // args.devices, "num_workers": args.workers}},
           "checkpoint": {"every_n_train_steps": 1, "save_last": False}}  # keep-one: a kill can leave two
    path = root + ".yaml"
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def start(cfg: str, resume: bool, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "diffmm.cli", "fit", "--config", cfg] + (["--ckpt_path", "last"] if resume else [])
    return subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)  # its own group: DDP ranks too


def losses(root: str) -> dict[int, str]:
    """step -> train/loss over every CSV version (a resumed run's later rows replace the replayed steps)."""
    out: dict[int, str] = {}
    for path in sorted(glob.glob(os.path.join(root, "csv", "version_*", "metrics.csv")),
                       key=lambda p: int(p.split("version_")[1].split(os.sep)[0])):
        with open(path) as f:
            out.update({int(r["step"]): r["train/loss"] for r in csv.DictReader(f) if r.get("train/loss")})
    return out


def newest(root: str) -> str:
    return candidate_checkpoints(os.path.join(root, "checkpoints"), root)[0]


def compare(a: str, b: str) -> tuple[int, int, float]:
    """(tensors compared, tensors differing, max |difference|) of weights and optimizer state."""
    x, y = (torch.load(newest(r), weights_only=True) for r in (a, b))
    pairs = [(x["state_dict"][k], y["state_dict"][k]) for k in x["state_dict"]]
    for sa, sb in zip(x["optimizer_states"], y["optimizer_states"]):
        pairs += [(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i]]
    diff = [float((p.double() - q.double()).abs().max()) for p, q in pairs if not torch.equal(p, q)]
    return len(pairs), len(diff), max(diff, default=0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=16)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="of the kill moments")
    p.add_argument("--out", default="soak-out")
    args = p.parse_args()
    rng, t0 = random.Random(args.seed), time.time()
    os.makedirs(args.out, exist_ok=True)
    data = shards(os.path.join(args.out, "data"))
    log = open(os.path.join(args.out, "soak.log"), "w")
    ref_root, root = (os.path.join(args.out, n) for n in ("uninterrupted", "killed"))
    tic = time.time()
    if start(config(ref_root, data, args), False, log).wait() != 0:
        sys.exit(f"kill_soak: the uninterrupted run failed; see {log.name}")
    span = time.time() - tic  # one whole run: kills land anywhere from start-up to the end
    cfg, kills, in_save, runs = config(root, data, args), 0, 0, 0
    while True:
        proc, runs = start(cfg, runs > 0, log), runs + 1
        if kills < args.kills:
            try:
                proc.wait(timeout=rng.uniform(0.2, 0.6) * span)
            except subprocess.TimeoutExpired:
                in_save += bool(glob.glob(os.path.join(root, "checkpoints", ".*.tmp-*")))
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                kills += 1
                continue
        if proc.wait() == 0:
            break
        sys.exit(f"kill_soak: a resumed run failed (exit {proc.returncode}); see {log.name}")
    ref, got = losses(ref_root), losses(root)  # a kill between a save and the log's flush loses that step's row
    steps_differ = sum(ref[s] != got[s] for s in ref if s in got)
    n, differ, delta = compare(ref_root, root)
    left = len(glob.glob(os.path.join(root, "checkpoints", "*.ckpt")))
    print(f"kill_soak: {kills} SIGKILLs ({in_save} while a checkpoint was being written), {runs} starts, "
          f"{left} checkpoint(s) left (save_top_k 1), "
          f"{args.steps} steps, {args.devices} rank(s), {args.workers} worker(s), {time.time() - t0:.0f} s")
    print(f"kill_soak: steps with a different loss {steps_differ}/{len(set(ref) & set(got))} compared (of "
          f"{len(ref)}); tensors differing {differ}/{n} "
          f"(max |diff| {delta:.3g}): {'BIT-IDENTICAL' if differ == steps_differ == 0 else 'DIFFERENT'}")
    return 0 if differ == steps_differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
