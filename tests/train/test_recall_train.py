"""Recall training: the configs run, the loss is on the answers only, resume is exact, models are parameter-matched."""
from __future__ import annotations

import copy
import glob
import os

import pytest
import torch
import torch.nn.functional as F
import yaml

from train_configs import read_metrics, series, trainer_cfg, write_yaml
from diffmm.data.recall import RecallTask, make_recall_batch
from diffmm.train.cli import main, run_cli
from diffmm.train.errors import ConfigError

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RECALL_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "recall_*.yaml")))


def recall_config(root: str, max_steps: int = 12, attention: str = "standard", **trainer_kw) -> dict:
    return {
        "seed_everything": 0,
        "trainer": trainer_cfg(root, max_steps, **trainer_kw),
        "model": {"class_path": "diffmm.train.recall_module.RecallLMModule", "init_args": {
            "model_name": "transformer-tiny", "vocab_size": 32, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2,
            "model_kwargs": {"n_layer": 1, "n_embd": 32, "n_head": 4, "block_size": 64, "attention": attention}}},
        "data": {"class_path": "diffmm.train.recall_data.RecallDataModule", "init_args": {
            "seq_lens": [32, 64], "num_pairs": [2, 4], "batch_size": 4, "val_examples": 8}},
    }


@pytest.mark.parametrize("path", RECALL_CONFIGS, ids=os.path.basename)
def test_recall_configs_run_two_steps(path, tmp_path):
    with open(path) as f:
        cfg = yaml.safe_load(f)
    assert cfg["model"]["class_path"].endswith("RecallLMModule") and cfg["trainer"]["accelerator"] == "cpu"
    cfg["trainer"].update(max_steps=2, default_root_dir=str(tmp_path), val_check_interval=2, limit_val_batches=1,
                          enable_progress_bar=False)
    cfg["data"]["init_args"]["val_examples"] = 2
    rc = main(["fit", "--config", write_yaml(tmp_path / "c.yaml", cfg)])
    assert rc == 0
    rows = read_metrics(str(tmp_path))
    assert series(rows, "val/recall_acc") and os.path.exists(tmp_path / "checkpoints" / "last.ckpt")


def test_recall_configs_cover_the_three_attentions_at_equal_parameters():
    from diffmm.train.recall_run import param_counts

    counts = {}
    for path in RECALL_CONFIGS:
        with open(path) as f:
            m = yaml.safe_load(f)["model"]["init_args"]
        from diffmm.models.lm_configs import LM_CONFIGS

        kw = {**LM_CONFIGS[m["model_name"]], **m["model_kwargs"], "vocab_size": m["vocab_size"]}
        counts[kw["attention"]] = param_counts(kw)["total"]
    assert set(counts) == {"standard", "diff", "diff_v2"}
    assert max(counts.values()) / min(counts.values()) < 1.01, counts


def test_loss_is_on_the_answer_positions_only():
    from diffmm.train.recall_module import RecallLMModule

    torch.manual_seed(0)
    module = RecallLMModule(model_kwargs={"n_layer": 1, "n_embd": 32, "n_head": 4, "block_size": 64}, vocab_size=32)
    b = make_recall_batch(RecallTask(vocab_size=32, seq_len=48, num_pairs=4), 3, seed=0)
    loss = module.training_step(b.as_training(), 0)
    logits = module.model(b.inputs)  # (B, T, V)
    ref = F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, ref)
    answers = logits[b.targets != -100].argmax(-1) == b.targets[b.targets != -100]
    assert float(module.last_train_accuracy) == pytest.approx(float(answers.float().mean()))
    with pytest.raises(ValueError, match="vocab_size 64 != vocab_size 32"):
        RecallLMModule(model_kwargs={"vocab_size": 64}, vocab_size=32)
    with pytest.raises(TypeError, match="expects batches"):
        module.training_step(b.inputs, 0)


def test_resume_matches_uninterrupted(tmp_path):
    cfg = recall_config("", max_steps=10, limit_val_batches=0)
    cfg["model"]["init_args"]["total_steps"] = 10
    cfg["checkpoint"] = {"every_n_train_steps": 4}
    full = copy.deepcopy(cfg)
    full["trainer"]["default_root_dir"] = str(tmp_path / "full")
    run_cli(["fit", "--config", write_yaml(tmp_path / "full.yaml", full)])
    crash = copy.deepcopy(cfg)
    crash["trainer"]["default_root_dir"] = root = str(tmp_path / "crash")
    crash["trainer"]["callbacks"] = [{"class_path": "train_helpers.CrashAt", "init_args": {"step": 6}}]
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_cli(["fit", "--config", write_yaml(tmp_path / "crash.yaml", crash)])
    del crash["trainer"]["callbacks"]
    run_cli(["fit", "--config", write_yaml(tmp_path / "resume.yaml", crash), "--ckpt_path", "last"])
    a, b = series(read_metrics(str(tmp_path / "full")), "train/loss"), series(read_metrics(root), "train/loss")
    assert sorted(b) == [4, 5, 6, 7, 8, 9]
    assert max(abs(a[s] - b[s]) for s in b) == 0.0


def test_data_module_checks_the_model(tmp_path):
    from diffmm.train.recall_data import RecallDataModule

    with pytest.raises(ConfigError, match="exceed the model's context_length 32"):
        RecallDataModule(vocab_size=32, seq_lens=[64], num_pairs=[2], context_length=32)
    with pytest.raises(ConfigError, match="no setting"):
        RecallDataModule(vocab_size=32, seq_lens=[8], num_pairs=[4])
    with pytest.raises(ConfigError, match=r"data.tasks\[0\]: unknown field"):
        RecallDataModule(vocab_size=32, tasks=[{"pairs": 2}])
    cfg = recall_config(str(tmp_path), max_steps=1)
    cfg["data"]["init_args"]["vocab_size"] = 64  # the model has 32
    rc = main(["fit", "--config", write_yaml(tmp_path / "bad.yaml", cfg)])
    assert rc == 2


@pytest.mark.parametrize("attention", ["diff", "diff_v2"])
def test_matched_parameters(attention):
    from diffmm.train.recall_run import matched_lm_kwargs, param_counts

    for width, heads in ((64, 4), (128, 4)):
        ref = param_counts(matched_lm_kwargs("standard", width, heads, 2, 64, 128))["total"]
        kw = matched_lm_kwargs(attention, width, heads, 2, 64, 128)
        n = param_counts(kw)["total"]
        assert abs(n - ref) <= 3 * width * 2 / 2, (attention, width, n, ref)  # within half a SwiGLU unit per layer
        assert ("intermediate_size" in kw) == (attention == "diff_v2")


def test_train_recall_runs_and_records(tmp_path):
    from diffmm.train.recall_run import RecallTrainConfig, matched_lm_kwargs, train_recall

    kw = matched_lm_kwargs("diff", 32, 4, 1, 32, 64)
    cfg = RecallTrainConfig([RecallTask(vocab_size=32, seq_len=32, num_pairs=2)], steps=4, batch_size=4,
                            warmup=1, log_every=2)
    run = train_recall(kw, cfg, seed=0, print_progress=False)
    assert run.steps == 4 and [s for s, _ in run.losses] == [2, 4] and set(run.lambdas) == {"blocks.0.attn"}
    assert run.summary()["final_train_loss"] == pytest.approx(run.losses[-1][1])
