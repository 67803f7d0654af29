"""A ``diffmm fit`` process killed with SIGKILL mid-epoch resumes from its last checkpoint and finishes
with the losses of an uninterrupted run (subprocesses; slow)."""
from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from train_configs import lm_config, read_metrics, series, write_yaml
from diffmm.train.cli import run_cli

STEPS, CKPT_EVERY, KILL_AFTER = 24, 4, 12


def _step_of(path: str) -> int:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])
    except Exception:  # not there yet
        return -1


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume(tmp_path, text_data):
    cfg = lm_config("", text_data, max_steps=STEPS, limit_val_batches=0)
    cfg["model"]["init_args"]["total_steps"] = STEPS
    cfg["checkpoint"] = {"every_n_train_steps": CKPT_EVERY}
    full = copy.deepcopy(cfg)
    full["trainer"]["default_root_dir"] = str(tmp_path / "full")
    run_cli(["fit", "--config", write_yaml(tmp_path / "full.yaml", full)])

    root = str(tmp_path / "killed")
    killed = copy.deepcopy(cfg)
    killed["trainer"]["default_root_dir"] = root
    slow = copy.deepcopy(killed)
    slow["trainer"]["callbacks"] = [{"class_path": "train_helpers.SleepEachStep", "init_args": {"seconds": 0.3}}]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "diffmm.cli", "fit", "--config", write_yaml(tmp_path / "slow.yaml", slow)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = os.path.join(root, "checkpoints", "last.ckpt")
    deadline = time.time() + 240
    try:
        while _step_of(last) < KILL_AFTER:
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.time() < deadline, "no checkpoint in time"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = _step_of(last)
    assert KILL_AFTER <= killed_at < STEPS and killed_at % CKPT_EVERY == 0

    rc = subprocess.run([sys.executable, "-m", "diffmm.cli", "fit", "--config",
                         write_yaml(tmp_path / "resume.yaml", killed), "--ckpt_path", "last"],
                        env=env, capture_output=True, text=True, timeout=600)
    assert rc.returncode == 0, rc.stderr[-3000:]
    assert _step_of(last) == STEPS
    ref = series(read_metrics(str(tmp_path / "full")), "train/loss")
    got = series(read_metrics(root), "train/loss")
    resumed = [s for s in sorted(got) if s >= killed_at]
    assert resumed == list(range(killed_at, STEPS))
    diff = max(abs(ref[s] - got[s]) for s in resumed)
    print(f"SIGKILL at step >= {killed_at}; resumed steps {resumed[0]}..{resumed[-1]}: max |loss diff| = {diff:.3g}")
    assert diff == 0.0
