"""Kill soak: ``diffmm fit`` SIGKILLed at random moments and resumed with ``--ckpt_path last`` must end bit-identical
(weights, optimizer state, the loss of every step) with the same run uninterrupted (docs/fault_tolerance.md).

    PYTHONPATH=. python scripts/kill_soak.py                        # 16 kills over 120 steps
    PYTHONPATH=. python scripts/kill_soak.py --kills 4 --steps 40 --devices 2 --workers 2 --seed 1

The run is configs/kill_soak_tiny.yaml on 24 generated images in 4 shards, a checkpoint every step (no last.ckpt),
so many kills land inside a save. Each kill strikes the whole process group (every DDP rank) a random fraction of a
step after a random number of new checkpoints. Exit status 0 when bit-identical, 1 otherwise.
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import random
import re
import signal
import subprocess
import sys
import time

import torch
from PIL import Image

from diffmm.data.writer import ShardWriter
from diffmm.train.checkpoint_io import candidate_checkpoints


def start(root: str, data: str, args, resume: bool, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "diffmm.cli", "fit", "--config", "configs/kill_soak_tiny.yaml",
           "--trainer.default_root_dir", root, "--trainer.logger.init_args.save_dir", root,
           "--data.init_args.train_shards", data, "--data.init_args.batch_size", str(4 // args.devices),
           "--data.init_args.num_workers", str(args.workers), "--trainer.devices", str(args.devices),
           "--trainer.max_steps", str(args.steps), "--model.init_args.total_steps", str(args.steps),
           "--checkpoint.save_last", "false"] + (["--trainer.strategy", "ddp"] if args.devices > 1 else [])
    return subprocess.Popen(cmd + (["--ckpt_path", "last"] if resume else []), stdout=log, stderr=log,
                            start_new_session=True)  # its own process group: a kill takes every rank


def step_of(root: str) -> int:
    """The step of the newest complete checkpoint (from its name)."""
    names = glob.glob(os.path.join(root, "checkpoints", "*step=*.ckpt"))
    return max((int(re.search(r"step=(\d+)", n).group(1)) for n in names), default=0)


def losses(root: str) -> dict[int, str]:
    """step -> train/loss over every CSV version (a resumed run's later rows replace the replayed steps)."""
    out: dict[int, str] = {}
    for path in sorted(glob.glob(os.path.join(root, "csv", "version_*", "metrics.csv")),
                       key=lambda p: int(re.search(r"version_(\d+)", p).group(1))):
        with open(path) as f:
            out.update({int(r["step"]): r["train/loss"] for r in csv.DictReader(f) if r.get("train/loss")})
    return out


def compare(a: str, b: str) -> tuple[int, int, float]:
    """(tensors compared, tensors differing, max |difference|) of the final weights and optimizer state."""
    x, y = (torch.load(candidate_checkpoints(os.path.join(r, "checkpoints"), r)[0], weights_only=True) for r in (a, b))
    pairs = [(x["state_dict"][k], y["state_dict"][k]) for k in x["state_dict"]]
    for sa, sb in zip(x["optimizer_states"], y["optimizer_states"]):
        pairs += [(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i]]
    diff = [float((p.double() - q.double()).abs().max()) for p, q in pairs if not torch.equal(p, q)]
    return len(pairs), len(diff), max(diff, default=0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=16, help="SIGKILLs")
    p.add_argument("--steps", type=int, default=120, help="training steps")
    p.add_argument("--devices", type=int, default=1, help="DDP ranks (CPU, gloo)")
    p.add_argument("--workers", type=int, default=0, help="loader workers")
    p.add_argument("--seed", type=int, default=0, help="of the kill moments")
    p.add_argument("--out", default="runs/kill-soak", help="folder of the data and both runs")
    args = p.parse_args()
    rng, t0 = random.Random(args.seed), time.time()
    with ShardWriter(os.path.join(args.out, "data"), "s", maxcount=6) as w:
        for i in range(24):
            buf = io.BytesIO()
            Image.new("RGB", (16, 16), ((97 * i) % 256, (57 * i) % 256, (31 * i) % 256)).save(buf, "PNG")
            w.write(f"{i:04d}", {"png": buf.getvalue(), "txt": f"colour {i % 3} shade {i % 4}"})
    data = os.path.join(args.out, "data", "s-{000000..000003}.tar")
    log = open(os.path.join(args.out, "soak.log"), "w")
    ref, root = os.path.join(args.out, "uninterrupted"), os.path.join(args.out, "killed")
    if start(ref, data, args, False, log).wait() != 0:
        sys.exit(f"kill_soak: the uninterrupted run failed; see {log.name}")
    kills = in_save = runs = 0
    while True:
        proc, runs = start(root, data, args, runs > 0, log), runs + 1
        target = step_of(root) + rng.randint(0, max(1, args.steps // max(1, args.kills)))  # 0: during start-up
        while kills < args.kills and proc.poll() is None and step_of(root) < target:
            time.sleep(0.02)
        if kills < args.kills and proc.poll() is None:
            saving = lambda: glob.glob(os.path.join(root, "checkpoints", ".*.tmp-*"))  # noqa: E731
            if rng.random() < 0.5:  # half the kills inside a save: as soon as its temporary file appears
                while not saving() and proc.poll() is None:
                    time.sleep(0.001)
            else:
                time.sleep(rng.uniform(0, 0.3))  # anywhere in a step
            in_save += bool(saving())
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
            continue
        if proc.wait() != 0:
            sys.exit(f"kill_soak: a resumed run failed (exit {proc.returncode}); see {log.name}")
        break
    a, b = losses(ref), losses(root)  # a kill between a save and the log's flush loses that step's row
    steps_differ = sum(a[s] != b[s] for s in a if s in b)
    n, differ, delta = compare(ref, root)
    left = len(glob.glob(os.path.join(root, "checkpoints", "*.ckpt")))
    print(f"kill_soak: {kills} SIGKILLs ({in_save} with a save in progress), {runs} starts, {left} checkpoint(s) "
          f"left (save_top_k 1), {args.steps} steps, {args.devices} rank(s), {args.workers} worker(s), "
          f"{time.time() - t0:.0f} s")
    print(f"kill_soak: steps with a different loss {steps_differ}/{len(set(a) & set(b))} compared (of {len(a)}); "
          f"tensors differing {differ}/{n} (max |diff| {delta:.3g}): "
          f"{'BIT-IDENTICAL' if differ == steps_differ == 0 else 'DIFFERENT'}")
    return 0 if differ == steps_differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
