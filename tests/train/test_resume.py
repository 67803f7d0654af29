"""Resume: a run that crashes and restarts with ``--ckpt_path last`` reaches the uninterrupted run's losses.

The crash lands between two periodic checkpoints and across an epoch boundary, so the resumed
run has to restore model, optimizer, scheduler, step and the data position (epoch + batches
consumed, augmentations included) to replay the same batches.
"""
from __future__ import annotations

import copy

import pytest

from train_configs import clip_config, lm_config, read_metrics, series, write_yaml
from diffmm.train.cli import run_cli

STEPS, CKPT_EVERY, CRASH_AT = 12, 4, 10


def _run_pair(tmp_path, cfg: dict) -> tuple[dict[int, float], dict[int, float]]:
    cfg["model"]["init_args"]["total_steps"] = STEPS  # same schedule whatever max_steps a run has
    cfg["checkpoint"] = {"every_n_train_steps": CKPT_EVERY}
    full = copy.deepcopy(cfg)
    full["trainer"]["default_root_dir"] = str(tmp_path / "full")
    run_cli(["fit", "--config", write_yaml(tmp_path / "full.yaml", full)])

    crash = copy.deepcopy(cfg)
    root = str(tmp_path / "crash")
    crash["trainer"]["default_root_dir"] = root
    crash["trainer"]["callbacks"] = [{"class_path": "train_helpers.CrashAt", "init_args": {"step": CRASH_AT}}]
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_cli(["fit", "--config", write_yaml(tmp_path / "crash.yaml", crash)])
    del crash["trainer"]["callbacks"]
    run_cli(["fit", "--config", write_yaml(tmp_path / "resume.yaml", crash), "--ckpt_path", "last"])
    return (series(read_metrics(str(tmp_path / "full")), "train/loss"), series(read_metrics(root), "train/loss"))


def _check(full: dict[int, float], resumed: dict[int, float]) -> float:
    resumed_steps = sorted(resumed)
    # the last checkpoint before the crash was at step 8: the resumed run logs steps 8..11 (0-based)
    assert resumed_steps == list(range(CRASH_AT - CRASH_AT % CKPT_EVERY, STEPS)), resumed_steps
    diff = max(abs(full[s] - resumed[s]) for s in resumed_steps)
    print(f"resume: max |loss difference| over steps {resumed_steps[0]}..{resumed_steps[-1]} = {diff:.3g}")
    return diff


def test_clip_resume_matches_uninterrupted(tmp_path, image_text_data):
    # 96 samples / batch 16 = 6 batches per epoch: the resumed run restarts in epoch 1 at batch 2
    full, resumed = _run_pair(tmp_path, clip_config("", image_text_data, max_steps=STEPS, limit_val_batches=0))
    assert _check(full, resumed) == 0.0


def test_lm_resume_matches_uninterrupted(tmp_path, text_data):
    full, resumed = _run_pair(tmp_path, lm_config("", text_data, max_steps=STEPS, limit_val_batches=0))
    assert _check(full, resumed) == 0.0
