"""A 2-process Lightning DDP fit on CPU (gloo) with the gathered contrastive loss (subprocesses; slow).

The exact gradient equivalence of the gathered loss is checked without Lightning in
``test_losses.py``; this runs the real stack: ``diffmm fit`` with ``devices=2, strategy=ddp``.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from train_configs import clip_config, read_metrics, series, write_yaml


@pytest.mark.slow
def test_two_process_ddp_fit(tmp_path, image_text_data):
    root = str(tmp_path / "run")
    cfg = clip_config(root, image_text_data, max_steps=4, limit_val_batches=1, val_check_interval=2,
                      devices=2, strategy="ddp")
    cfg["model"]["init_args"]["local_loss"] = True
    cfg["data"]["init_args"]["val_batch_size"] = 8  # 16 val samples: one equal batch per rank
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "diffmm.cli", "fit", "--config",
                          write_yaml(tmp_path / "ddp.yaml", cfg)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    log = out.stderr + out.stdout
    assert "distributed_backend=gloo" in log and "All distributed processes registered" in log
    state = torch.load(os.path.join(root, "checkpoints", "last.ckpt"), map_location="cpu", weights_only=False)
    [position] = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]  # the training loader's data position
    assert state["global_step"] == 4 and position["world_size"] == 2
    rows = read_metrics(root)
    assert len(series(rows, "train/loss")) == 4 and series(rows, "val/loss")
    # global throughput = 2 x per-device throughput
    for s, v in series(rows, "train/samples_per_s").items():
        assert v == pytest.approx(2 * series(rows, "train/samples_per_s_per_device")[s])


@pytest.mark.slow
def test_ddp_nan_loss_on_one_rank_stops_every_rank(tmp_path, image_text_data):
    """A NaN loss on rank 1 only: both ranks agree (one all-reduce), stop before the update and exit 3; no hang."""
    root = str(tmp_path / "run")
    cfg = clip_config(root, image_text_data, max_steps=6, model_name=None, limit_val_batches=0, devices=2,
                      strategy="ddp")
    cfg["checkpoint"] = {"every_n_train_steps": 1}
    cfg["trainer"]["callbacks"] = [{"class_path": "train_helpers.NaNLossAt", "init_args": {"steps": [3], "rank": 1}}]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "diffmm.cli", "fit", "--config",
                          write_yaml(tmp_path / "nan.yaml", cfg)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 3, out.stderr[-4000:]
    assert "diffmm fit: error: non-finite loss (nan) at step 3" in out.stderr
    state = torch.load(os.path.join(root, "checkpoints", "last.ckpt"), map_location="cpu", weights_only=True)
    assert state["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())
