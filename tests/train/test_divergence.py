"""A diverging run stops (exit 3, one line naming the step and the last good checkpoint) or skips the bad
steps, and no checkpoint ever holds NaN/Inf weights (CLIPModule and LMModule, through the CLI)."""
from __future__ import annotations

import glob
import logging
import os

import pytest
import torch

from train_configs import clip_config, lm_config, read_metrics, series, write_yaml
from train_helpers import ParamTrace
from diffmm.train.checkpoint_io import AtomicCheckpointIO
from diffmm.train.cli import main, run_cli
from diffmm.train.errors import DIVERGED_EXIT_CODE, TrainingDiverged


def _cfg(kind: str, root: str, data, steps: int, callbacks=(), **model_kw) -> dict:
    cfg = (clip_config(root, data, max_steps=steps, model_name=None, limit_val_batches=0) if kind == "clip"
           else lm_config(root, data, max_steps=steps, limit_val_batches=0))
    cfg["model"]["init_args"].update(model_kw)
    cfg["checkpoint"] = {"every_n_train_steps": 1, "save_top_k": -1}  # a checkpoint after every step
    if callbacks:
        cfg["trainer"]["callbacks"] = list(callbacks)
    return cfg


def _checkpoints(root: str) -> dict[str, dict]:
    return {os.path.basename(p): torch.load(p, weights_only=True, map_location="cpu")
            for p in sorted(glob.glob(os.path.join(root, "checkpoints", "*.ckpt")))}


def _finite(ckpt: dict) -> bool:
    return all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


@pytest.fixture(params=["clip", "lm"])
def kind_data(request, image_text_data, text_data):
    return request.param, image_text_data if request.param == "clip" else text_data


def test_lr_1e6_exits_nonzero_and_every_checkpoint_stays_finite(tmp_path, capsys, kind_data):
    kind, data = kind_data
    root = str(tmp_path / "run")
    cfg = write_yaml(tmp_path / "c.yaml", _cfg(kind, root, data, 8))
    rc = main(["fit", "--config", cfg, "--model.init_args.lr", "1e6"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("diffmm fit: error")]
    assert rc == DIVERGED_EXIT_CODE, err
    assert len(err) == 1 and "non-finite loss (nan) at step" in err[0], err
    ckpts = _checkpoints(root)
    assert all(_finite(c) for c in ckpts.values()), {k: _finite(c) for k, c in ckpts.items()}
    # the line names the newest checkpoint written before the bad step (or says there is none)
    step = int(err[0].split("at step ")[1].split()[0])
    if ckpts:
        newest = max(ckpts.items(), key=lambda kv: kv[1]["global_step"])
        assert f"last good checkpoint: {os.path.join(root, 'checkpoints')}" in err[0]
        assert newest[1]["global_step"] <= step
    else:
        assert f"no checkpoint was written before step {step}" in err[0]


def test_nan_loss_stops_before_the_update_and_keeps_the_checkpoints(tmp_path, capsys, kind_data):
    kind, data = kind_data
    root = str(tmp_path / "run")
    cb = {"class_path": "train_helpers.NaNLossAt", "init_args": {"steps": [3]}}
    rc = main(["fit", "--config", write_yaml(tmp_path / "c.yaml", _cfg(kind, root, data, 6, [cb]))])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == DIVERGED_EXIT_CODE
    last = os.path.join(root, "checkpoints", "last.ckpt")
    assert ("non-finite loss (nan) at step 3 (epoch 0): training stopped before the update; "
            "last good checkpoint: ") in err
    assert "(step 3)" in err and "checkpoints" in err
    ckpts = _checkpoints(root)
    assert ckpts["last.ckpt"]["global_step"] == 3 and all(_finite(c) for c in ckpts.values())
    assert sorted(c["global_step"] for k, c in ckpts.items() if k != "last.ckpt") == [1, 2, 3]
    assert os.path.exists(last)


def test_skip_mode_drops_the_bad_updates_and_counts_them(tmp_path, kind_data):
    kind, data = kind_data
    root = str(tmp_path / "run")
    cfg = _cfg(kind, root, data, 6, [{"class_path": "train_helpers.NaNLossAt", "init_args": {"steps": [2, 3]}},
                                     {"class_path": "train_helpers.ParamTrace"}])
    cli = run_cli(["fit", "--config", write_yaml(tmp_path / "c.yaml", cfg), "--nonfinite.action", "skip"])
    trace = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ParamTrace))
    # steps 2 and 3 (global_step 3 and 4 after them) changed nothing; the others did
    for a, b in zip(trace.after[2], trace.after[4]):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(trace.after[4], trace.after[5]))
    assert all(torch.isfinite(p).all() for p in trace.after[6])
    skipped = series(read_metrics(root), "train/skipped_steps")  # the running count
    assert 1 not in skipped and skipped[2] == 1.0 and skipped[3] == 2.0 and max(skipped.values()) == 2.0
    assert _checkpoints(root)["last.ckpt"]["callbacks"]["NonFiniteGuard"] == {"skipped": 2}


def test_skip_mode_stops_past_the_limit(tmp_path, image_text_data):
    root = str(tmp_path / "run")
    cfg = _cfg("clip", root, image_text_data, 6,
               [{"class_path": "train_helpers.NaNLossAt", "init_args": {"steps": [1, 2, 3]}}])
    args = ["fit", "--config", write_yaml(tmp_path / "c.yaml", cfg), "--nonfinite.action", "skip",
            "--nonfinite.max_skips", "2"]
    with pytest.raises(TrainingDiverged, match=r"at step 3, after 2 skipped step\(s\) \(nonfinite.max_skips=2\)"):
        run_cli(args)


def test_nan_weights_are_never_written(tmp_path, capsys, caplog, image_text_data):
    """Weights turn NaN after a finite loss: no checkpoint is written from then on (last.ckpt keeps step 2),
    and the guard stops at the next step naming that checkpoint."""
    root = str(tmp_path / "run")
    cfg = _cfg("clip", root, image_text_data, 6,
               [{"class_path": "train_helpers.NaNWeightsAt", "init_args": {"step": 3}}])
    with caplog.at_level(logging.WARNING, logger="diffmm.train"):
        rc = main(["fit", "--config", write_yaml(tmp_path / "c.yaml", cfg)])
    assert rc == DIVERGED_EXIT_CODE
    ckpts = _checkpoints(root)
    assert ckpts["last.ckpt"]["global_step"] == 2 and all(_finite(c) for c in ckpts.values())
    assert max(c["global_step"] for c in ckpts.values()) == 2
    assert caplog.text.count("step 3: not saving checkpoints, the weights are non-finite") == 1
    assert f"last good checkpoint: {os.path.join(root, 'checkpoints')}" in capsys.readouterr().err


def test_checkpoint_io_never_writes_non_finite_state_nor_removes_meanwhile(tmp_path, caplog):
    path, old = tmp_path / "last.ckpt", tmp_path / "epoch=0-step=1.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(3)}}, path)
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(3)}}, old)
    adam = [{"state": {0: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.tensor([0.0, float("nan"), 0.0])}}}]
    with caplog.at_level(logging.WARNING, logger="diffmm.train"):
        io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.tensor([1.0, float("inf"), 0.0])}}, path)
        io.remove_checkpoint(old)  # what ModelCheckpoint does to make room: refused while the state is non-finite
        io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.ones(3)}, "optimizer_states": adam}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 1 and old.exists() and io.last_saved == (str(old), 1)
    assert "step 2: not saving checkpoints, the weights are non-finite (w)" in caplog.text
    assert "step 3: not saving checkpoints, the optimizer state is non-finite (optimizer 0 exp_avg_sq)" in caplog.text
    io.save_checkpoint({"global_step": 4, "state_dict": {"w": torch.ones(3)}}, tmp_path / "new.ckpt")
    io.remove_checkpoint(old)
    assert (tmp_path / "new.ckpt").exists() and not old.exists() and io.last_saved == (str(tmp_path / "new.ckpt"), 4)


def test_guard_options_are_checked():
    from diffmm.train.callbacks import NonFiniteGuard

    with pytest.raises(ValueError, match="nonfinite.action must be 'stop' or 'skip'"):
        NonFiniteGuard(action="ignore")
    with pytest.raises(ValueError, match="nonfinite.max_skips must be >= 0"):
        NonFiniteGuard(max_skips=-1)


def test_python_trainer_is_guarded_by_default(tmp_path, image_text_data):
    """Without the CLI: TrainModule adds a NonFiniteGuard (stop) unless the trainer has one."""
    import pytorch_lightning as pl

    from train_helpers import NaNLossAt, TinyCLIP
    from diffmm.train import CLIPModule, ImageTextDataModule
    from diffmm.train.callbacks import NonFiniteGuard

    train, val = image_text_data
    module = CLIPModule(model=TinyCLIP(), lr=5e-3, min_lr=1e-4, warmup_steps=1)
    data = ImageTextDataModule(train, val, batch_size=16, num_workers=0, image_size=16, context_length=16)
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=str(tmp_path), callbacks=[NaNLossAt([2])])
    with pytest.raises(TrainingDiverged, match="non-finite loss \\(nan\\) at step 2 .* no checkpoint was written"):
        trainer.fit(module, data)
    assert sum(isinstance(cb, NonFiniteGuard) for cb in trainer.callbacks) == 1
