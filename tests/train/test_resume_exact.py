"""Exact resume: a run resumed from an epoch-end and a mid-epoch checkpoint, again and again, trains the same
batches to the same weights and optimizer state as the uninterrupted run, bit for bit.

6 batches an epoch, a checkpoint every 3 steps: step 6 ends epoch 0, step 9 is mid-epoch 1, step 12 ends epoch 1.
The chain resumes from the uninterrupted run's step 6, then from the step-9 checkpoint that resumed run wrote,
then from the step-12 checkpoint of the run resumed twice (the checkpoint the old code wrote an epoch behind).
The tiny model has dropout, so the RNG states must be restored too.
"""
from __future__ import annotations

import copy
import glob
import os
import subprocess
import sys

import pytest
import torch

from diffmm.train.cli import run_cli
from diffmm.train.resume import PROGRESS_KEY
from train_configs import clip_config, write_yaml

STEPS, EVERY, PER_EPOCH = 18, 3, 6


def _config(image_text_data, num_workers: int = 0, **trainer) -> dict:
    cfg = clip_config("", image_text_data, max_steps=STEPS, model_name=None, limit_val_batches=0, **trainer)
    cfg["model"]["init_args"]["model"]["init_args"]["dropout"] = 0.25
    cfg["model"]["init_args"]["total_steps"] = STEPS
    cfg["data"]["init_args"]["num_workers"] = num_workers
    cfg["checkpoint"] = {"every_n_train_steps": EVERY, "save_top_k": -1}
    return cfg


def fit(tmp_path, cfg: dict, name: str, ckpt: str | None = None) -> str:
    """Run ``diffmm fit`` into ``tmp_path/name`` (resuming from ``ckpt``); returns the folder."""
    cfg = copy.deepcopy(cfg)
    root = str(tmp_path / name)
    cfg["trainer"]["default_root_dir"] = root
    cfg["trainer"]["callbacks"] = [{"class_path": "train_helpers.BatchTrace", "init_args": {"out": root}}]
    args = ["fit", "--config", write_yaml(tmp_path / f"{name}.yaml", cfg)] + (["--ckpt_path", ckpt] if ckpt else [])
    if cfg["trainer"].get("devices", 1) == 1:
        run_cli(args)
        return root
    # DDP launches processes: run the CLI as one (test helpers importable)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "diffmm.cli", *args], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return root


def at_step(root: str, step: int) -> str:
    [path] = glob.glob(os.path.join(root, "checkpoints", f"*-step={step}.ckpt"))
    return path


def batches(root: str, rank: int = 0) -> dict[int, list[torch.Tensor]]:
    return torch.load(f"{root}.rank{rank}.pt", weights_only=True)


def assert_same_run(full: str, resumed: str, start: int, ranks: int = 1) -> None:
    """Same batches at steps ``start+1..STEPS``, same weights and optimizer state at the end, bitwise."""
    for rank in range(ranks):
        a, b = batches(full, rank), batches(resumed, rank)
        assert sorted(b) == list(range(start + 1, STEPS + 1)), sorted(b)
        for step in b:
            assert all(torch.equal(x, y) for x, y in zip(a[step], b[step], strict=True)), f"step {step}: batch"
    a, b = (torch.load(os.path.join(r, "checkpoints", "last.ckpt"), weights_only=True) for r in (full, resumed))
    assert a["global_step"] == b["global_step"] == STEPS and a["epoch"] == b["epoch"] == STEPS // PER_EPOCH
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    [sa], [sb] = a["optimizer_states"], b["optimizer_states"]
    assert sa["state"].keys() == sb["state"].keys() and sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)


def assert_positions(root: str) -> None:
    """Every checkpoint says the epoch and batch its step is at (6 batches an epoch)."""
    for path in glob.glob(os.path.join(root, "checkpoints", "*.ckpt")):
        ckpt = torch.load(path, weights_only=True)
        step, rec = ckpt["global_step"], ckpt[PROGRESS_KEY]
        assert (rec["epoch"], rec["batches"], ckpt["epoch"]) == (step // 6, step % 6, step // 6), path
        assert rec["total_batches"] == step and len(rec["rng"]) == rec["world_size"]
        fit = ckpt["loops"]["fit_loop"]
        assert fit["epoch_progress"]["current"]["completed"] == step // 6, path


def resume_chain(tmp_path, cfg: dict, ranks: int = 1) -> None:
    full = fit(tmp_path, cfg, "full")
    assert_positions(full)
    once = fit(tmp_path, cfg, "once", at_step(full, 6))              # epoch end
    assert_same_run(full, once, 6, ranks)
    twice = fit(tmp_path, cfg, "twice", at_step(once, 9))            # mid-epoch, written by a resumed run
    assert_same_run(full, twice, 9, ranks)
    thrice = fit(tmp_path, cfg, "thrice", at_step(twice, 12))        # epoch end, written by a run resumed twice
    assert_same_run(full, thrice, 12, ranks)
    for root in (once, twice, thrice):
        assert_positions(root)


def test_resume_from_epoch_end_and_mid_epoch_again_and_again(tmp_path, image_text_data):
    resume_chain(tmp_path, _config(image_text_data))


def test_checkpoint_without_progress_record_resumes_from_its_data_position(tmp_path, image_text_data):
    """A checkpoint of the code before the progress record, with the loop counters the old code wrote after a
    resume (epoch 2/2/2/2 where the data position says epoch 2 after 3 batches): same batches, epoch 2."""
    cfg = _config(image_text_data)
    cfg["model"]["init_args"]["model"]["init_args"]["dropout"] = 0.0  # old checkpoints have no RNG states
    full = fit(tmp_path, cfg, "full")
    old = torch.load(at_step(full, 15), weights_only=True)
    del old[PROGRESS_KEY]
    for part in ("total", "current"):
        old["loops"]["fit_loop"]["epoch_progress"][part] = dict(ready=2, started=2, processed=2, completed=2)
    old["epoch"] = 1
    torch.save(old, tmp_path / "old.ckpt")
    resumed = fit(tmp_path, cfg, "resumed", str(tmp_path / "old.ckpt"))
    assert_same_run(full, resumed, 15)


@pytest.mark.slow
def test_resume_exactly_with_two_workers(tmp_path, image_text_data):
    resume_chain(tmp_path, _config(image_text_data, num_workers=2))


@pytest.mark.slow
def test_resume_exactly_on_two_ddp_ranks(tmp_path, image_text_data):
    cfg = _config(image_text_data, devices=2, strategy="ddp")
    cfg["data"]["init_args"]["batch_size"] = 8  # 96 samples / (2 ranks x 8): 6 batches an epoch
    resume_chain(tmp_path, cfg, ranks=2)
