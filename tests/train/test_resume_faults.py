"""Resuming around faults: a damaged ``last.ckpt`` falls back to the newest intact checkpoint, extending a
finished run continues its schedule and epoch, and ``trainer.logger: false`` runs."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from train_configs import clip_config, read_metrics, series, write_yaml
from diffmm.train.checkpoint_io import checkpoint_damage, resume_checkpoint
from diffmm.train.cli import main, run_cli
from diffmm.train.errors import ConfigError

DAMAGE = {"truncated": lambda b: b[: len(b) // 2], "garbage": lambda b: b"\x00garbage " * 300, "empty": lambda b: b""}


def _damage(path, how: str) -> None:
    path.write_bytes(DAMAGE[how](path.read_bytes()))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, image_text_data):
    """A 5-step CLIP run with a periodic checkpoint at step 4 and last.ckpt at step 5 (6 batches per epoch)."""
    tmp = tmp_path_factory.mktemp("finished")
    cfg = clip_config(str(tmp / "run"), image_text_data, max_steps=5, model_name=None, limit_val_batches=0)
    cfg["checkpoint"] = {"every_n_train_steps": 2}
    run_cli(["fit", "--config", write_yaml(tmp / "c.yaml", cfg)])
    return tmp / "run", cfg


# ---------------------------------------------------------------------------------- damaged checkpoints
@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_checkpoint_damage_is_named(tmp_path, how):
    torch.save({"state_dict": {"w": torch.ones(4)}, "global_step": 1}, tmp_path / "ok.ckpt")
    assert checkpoint_damage(str(tmp_path / "ok.ckpt")) is None
    shutil.copy(tmp_path / "ok.ckpt", tmp_path / "bad.ckpt")
    _damage(tmp_path / "bad.ckpt", how)
    why = checkpoint_damage(str(tmp_path / "bad.ckpt"))
    assert why and ("truncated" in why or "empty" in why or "corrupt" in why), why
    # a zip without a state_dict is not a Lightning checkpoint
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.ckpt")
    assert checkpoint_damage(str(tmp_path / "plain.ckpt")) == "not a Lightning checkpoint (no 'state_dict')"


def test_every_checkpoint_damaged_is_one_error_naming_them(tmp_path):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    (ck / "last.ckpt").write_bytes(b"")
    (ck / "epoch=0-step=4.ckpt").write_bytes(b"junk")
    with pytest.raises(ConfigError) as e:
        resume_checkpoint(str(ck), str(tmp_path), move_damaged=True)
    msg = str(e.value)
    assert "no intact checkpoint to resume from" in msg and "\n" not in msg
    assert f"{ck / 'last.ckpt'}: empty file" in msg and str(ck / "epoch=0-step=4.ckpt") in msg
    assert sorted(os.listdir(ck)) == ["epoch=0-step=4.ckpt", "last.ckpt"]  # nothing moved when nothing resumes
    assert resume_checkpoint(str(tmp_path / "none"), str(tmp_path / "none")) is None
    # no last.ckpt at all: the newest intact periodic checkpoint
    (ck / "last.ckpt").unlink()
    torch.save({"state_dict": {}, "global_step": 2}, ck / "epoch=0-step=2.ckpt")
    assert resume_checkpoint(str(ck), str(tmp_path)) == str(ck / "epoch=0-step=2.ckpt")


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_last_resumes_from_the_periodic_checkpoint(tmp_path, caplog, finished_run, how):
    run, cfg = finished_run
    root = tmp_path / "run"
    shutil.copytree(run, root)
    cfg = {**cfg, "trainer": {**cfg["trainer"], "default_root_dir": str(root)}}
    ck = root / "checkpoints"
    _damage(ck / "last.ckpt", how)
    (ck / ".last.ckpt.tmp-4242").write_bytes(b"half a save")  # what a killed save leaves
    with caplog.at_level(logging.INFO, logger="diffmm.train"):
        run_cli(["fit", "--config", write_yaml(tmp_path / "c.yaml", cfg), "--ckpt_path", "last",
                 "--trainer.max_steps", "6"])
    periodic = ck / "epoch=0-step=4.ckpt"
    assert f"resume: {ck / 'last.ckpt'} is damaged" in caplog.text
    assert f"moved to {ck / 'last.ckpt.damaged'}; resuming from {periodic} instead, the newest intact" in caplog.text
    assert (ck / "last.ckpt.damaged").exists()  # kept for inspection, not deleted
    assert sorted(series(read_metrics(str(root)), "train/loss")) == [4, 5]  # steps 4 and 5 trained again
    assert torch.load(ck / "last.ckpt", weights_only=True)["global_step"] == 6  # written where it was
    assert not (ck / ".last.ckpt.tmp-4242").exists() and "removed 1 temporary file(s)" in caplog.text


def test_named_damaged_checkpoint_is_one_line(tmp_path, capsys, finished_run):
    run, cfg = finished_run
    bad = tmp_path / "bad.ckpt"
    shutil.copy(run / "checkpoints" / "last.ckpt", bad)
    _damage(bad, "truncated")
    for cmd in ("fit", "validate"):
        assert main([cmd, "--config", write_yaml(tmp_path / "c.yaml", cfg), "--ckpt_path", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"diffmm {cmd}: error: ckpt_path: {bad} is damaged (truncated"), err


# ------------------------------------------------------------------------------------- extending a run
@pytest.fixture(scope="module")
def six_step_losses(tmp_path_factory, image_text_data) -> dict[int, float]:
    """train/loss of an uninterrupted 6-step run (the reference of the extension test)."""
    root = tmp_path_factory.mktemp("six") / "run"
    cfg = clip_config(str(root), image_text_data, max_steps=6, model_name=None, limit_val_batches=0)
    run_cli(["fit", "--config", write_yaml(root.parent / "c.yaml", cfg)])
    return series(read_metrics(str(root)), "train/loss")


def test_extending_a_finished_run_continues_schedule_epoch_and_data(tmp_path, caplog, image_text_data,
                                                                     six_step_losses):
    """3 steps, then ``--ckpt_path last --trainer.max_steps 6``: the lr follows the cosine over 6 steps (well above
    min_lr at steps 3-4), the epoch stays 0 as the data continues epoch 0, and with warmup covering the first
    run (so both runs share its lr) the extended run equals an uninterrupted 6-step run exactly."""
    cfg = clip_config(str(tmp_path / "ext"), image_text_data, max_steps=3, model_name=None, limit_val_batches=0,
                      enable_progress_bar=True)
    lr, min_lr = cfg["model"]["init_args"]["lr"], cfg["model"]["init_args"]["min_lr"]
    path = write_yaml(tmp_path / "ext.yaml", cfg)
    run_cli(["fit", "--config", path])
    with caplog.at_level(logging.INFO, logger="diffmm.train"):
        cli = run_cli(["fit", "--config", path, "--ckpt_path", "last", "--trainer.max_steps", "6"])
    rows = read_metrics(str(tmp_path / "ext"))
    lrs, epochs = series(rows, "lr-AdamW/decay"), series(rows, "epoch")
    assert sorted(lrs) == [3, 4, 5] and lrs[3] > 10 * min_lr and lrs[4] > 10 * min_lr, lrs
    assert lrs[3] == pytest.approx(lr) and lrs[4] < lrs[3] and lrs[5] < lrs[4]
    assert all(epochs[s] == 0 for s in (3, 4, 5)), epochs
    assert "lr schedule recomputed from the current settings (total_steps 3 -> 6" in caplog.text
    assert "resumed data at epoch 0 after 3 batches" in caplog.text
    ext_loss = series(rows, "train/loss")
    assert [ext_loss[s] for s in (3, 4, 5)] == [six_step_losses[s] for s in (3, 4, 5)]
    # the progress bar counts the epoch's 6 batches from batch 3, and the global step against max_steps
    pbar = cli.trainer.progress_bar_callback
    assert type(pbar).__name__ == "StepProgressBar" and pbar.total_train_batches == 6
    assert pbar.get_metrics(cli.trainer, cli.model)["step"] == "6/6"
    bar = pbar.train_progress_bar
    assert (bar.n, bar.total, bar.desc.rstrip(": ")) == (6, 6, "Epoch 0")  # no "/max_epochs-1" when step-limited
    # the last checkpoint of the extension is again "epoch 0, 6 of 6 batches": the next epoch starts cleanly
    ckpt = torch.load(tmp_path / "ext" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"] == 1


# ------------------------------------------------------------------------------------------- no logger
def test_logger_false_runs_without_the_lr_monitor(tmp_path, caplog, image_text_data):
    cfg = clip_config(str(tmp_path / "run"), image_text_data, max_steps=2, model_name=None, limit_val_batches=0)
    with caplog.at_level(logging.INFO, logger="diffmm.train"):
        cli = run_cli(["fit", "--config", write_yaml(tmp_path / "c.yaml", cfg), "--trainer.logger", "false"])
    assert cli.trainer.global_step == 2 and not cli.trainer.loggers
    assert caplog.text.count("trainer.logger is false: skipping LearningRateMonitor (needs a logger)") == 1
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()


# ------------------------------------------------------------------------------------ top-k after a kill
def test_keep_one_removes_the_checkpoint_a_killed_save_left(tmp_path, image_text_data):
    """A kill between writing ``step=4`` and removing ``step=2`` leaves both; the resumed run keeps one."""
    cfg = clip_config(str(tmp_path / "run"), image_text_data, max_steps=4, model_name=None, limit_val_batches=0)
    cfg["checkpoint"] = {"every_n_train_steps": 2}
    path = write_yaml(tmp_path / "c.yaml", cfg)
    run_cli(["fit", "--config", path])
    ck = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(ck)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    shutil.copy(ck / "epoch=0-step=4.ckpt", ck / "epoch=0-step=2.ckpt")
    os.utime(ck / "epoch=0-step=2.ckpt", (1000, 1000))  # older than the one Lightning remembers
    run_cli(["fit", "--config", path, "--ckpt_path", "last", "--trainer.max_steps", "6"])
    assert sorted(os.listdir(ck)) == ["epoch=0-step=6.ckpt", "last.ckpt"]
