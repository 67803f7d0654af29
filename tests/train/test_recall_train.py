"""Recall training through the ordinary LMModule: the configs run and their checkpoints load, the loss is on the answers
only, resume is exact, the three configs are parameter-matched."""
from __future__ import annotations

import copy
import glob
import os

import pytest
import torch
import torch.nn.functional as F
import yaml

import diffmm
from train_configs import read_metrics, series, trainer_cfg, write_yaml
from diffmm.data.recall import RecallTask, make_recall_batch
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.train.cli import main, run_cli
from diffmm.train.datamodules import RecallDataModule
from diffmm.train.errors import ConfigError
from diffmm.train.lm_module import LMModule

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RECALL_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "recall_*.yaml")))


def recall_config(root: str, max_steps: int = 12, attention: str = "standard", **trainer_kw) -> dict:
    return {
        "seed_everything": 0,
        "trainer": trainer_cfg(root, max_steps, **trainer_kw),
        "model": {"class_path": "diffmm.train.LMModule", "init_args": {
            "model_name": "transformer-tiny", "tokenizer": None, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2,
            "model_kwargs": {"vocab_size": 32, "n_layer": 1, "n_embd": 32, "n_head": 4, "block_size": 64,
                             "attention": attention}}},
        "data": {"class_path": "diffmm.train.RecallDataModule", "init_args": {
            "seq_lens": [32, 64], "num_pairs": [2, 4], "batch_size": 4, "val_examples": 8}},
    }


@pytest.mark.parametrize("path", RECALL_CONFIGS, ids=os.path.basename)
def test_recall_configs_run_two_steps_and_load(path, tmp_path):
    with open(path) as f:
        cfg = yaml.safe_load(f)
    assert cfg["model"]["class_path"] == "diffmm.train.LMModule" and cfg["trainer"]["accelerator"] == "cpu"
    cfg["trainer"].update(max_steps=2, default_root_dir=str(tmp_path), val_check_interval=2, limit_val_batches=1,
                          enable_progress_bar=False)
    cfg["data"]["init_args"]["val_examples"] = 2
    rc = main(["fit", "--config", write_yaml(tmp_path / "c.yaml", cfg)])
    assert rc == 0
    rows = read_metrics(str(tmp_path))
    assert series(rows, "val/accuracy") and series(rows, "val/loss")
    ckpt = str(tmp_path / "checkpoints" / "last.ckpt")
    model = diffmm.load_pretrained(ckpt)
    kwargs = cfg["model"]["init_args"]["model_kwargs"]
    assert isinstance(model, DiffLM) and model.config.vocab_size == kwargs["vocab_size"] == 64
    assert model.config.attn_type == kwargs["attn_type"]
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert all(torch.equal(v, state[f"model.{k}"]) for k, v in model.state_dict().items())


def test_recall_configs_cover_the_three_attentions_at_equal_parameters():
    counts = {}
    for path in RECALL_CONFIGS:
        with open(path) as f:
            m = yaml.safe_load(f)["model"]["init_args"]
        with torch.device("meta"):
            model = DiffLM(LMConfig.from_name(m["model_name"], **m["model_kwargs"]))
        counts[model.config.attention] = model.param_report()["total"]
    assert counts == {"standard": 110_912, "diff": 111_104, "diff_v2": 110_784}  # as the configs' comments say
    assert max(counts.values()) / min(counts.values()) < 1.01, counts


def test_loss_and_accuracy_are_on_the_answer_positions_only():
    torch.manual_seed(0)
    module = LMModule(tokenizer=None, model_kwargs={"vocab_size": 32, "n_layer": 1, "n_embd": 32, "n_head": 4,
                                                     "block_size": 64})
    b = make_recall_batch(RecallTask(vocab_size=32, seq_len=48, num_pairs=4), 3, seed=0)
    loss, correct, n = module.scored((b.inputs, b.targets))
    logits = module.model(b.inputs)  # (B, T, V)
    ref = F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, ref)
    answers = logits[b.targets != -100].argmax(-1) == b.targets[b.targets != -100]
    assert int(n) == 3 * 4 and int(correct) == int(answers.sum())
    torch.testing.assert_close(module.training_step((b.inputs, b.targets), 0), ref)
    pred = module.predict_step((b.inputs, b.targets), 0)
    torch.testing.assert_close(pred["next_token_accuracy"], answers.float().reshape(3, 4).mean(1))
    with pytest.raises(ValueError, match="set the vocabulary in model_kwargs.vocab_size"):
        LMModule(tokenizer=None)


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
    with pytest.raises(ConfigError, match="exceed the model's context_length 32"):
        RecallDataModule(vocab_size=32, seq_lens=[64], num_pairs=[2], context_length=32)
    with pytest.raises(ConfigError, match="no setting"):
        RecallDataModule(vocab_size=32, seq_lens=[8], num_pairs=[4])
    cfg = recall_config(str(tmp_path), max_steps=1)
    cfg["data"]["init_args"]["vocab_size"] = 64  # the model has 32
    rc = main(["fit", "--config", write_yaml(tmp_path / "bad.yaml", cfg)])
    assert rc == 2


def test_data_module_zoology_sampler(tmp_path):
    dm = RecallDataModule(vocab_size=64, seq_lens=[16, 32], num_pairs=[2, 4], sampler="zoology", noise=0.25,
                          batch_size=4, val_examples=6, val_batch_size=3, seed=5)
    assert {t.sampler for t in dm.train_tasks + dm.val_tasks} == {"zoology"}
    stream = dm.train_dataloader().dataset
    x, y = next(iter(dm.train_dataloader()))
    ref = make_recall_batch(stream.task_of(0), 4, seed=5, index=0)  # the stream serves the Zoology batches
    assert torch.equal(x, ref.inputs) and torch.equal(y, ref.targets)
    (vx, vy), *_ = list(dm.val_dataloader())
    vref = make_recall_batch(dm.val_tasks[0], 3, seed=5, index=0, split="eval")
    assert torch.equal(vx, vref.inputs) and torch.equal(vy, vref.targets)
    assert dm.val_tasks[0].sampler == "zoology" and int((vy != -100).sum()) == 3 * dm.val_tasks[0].num_pairs
    with pytest.raises(ConfigError, match="data.sampler must be one of"):
        RecallDataModule(vocab_size=64, sampler="uniform")
    with pytest.raises(ConfigError, match="queries every pair"):
        RecallDataModule(vocab_size=64, seq_lens=[16], num_pairs=[4], num_queries=2, sampler="zoology")
    cfg = recall_config(str(tmp_path), max_steps=2, limit_val_batches=1, val_check_interval=2)
    cfg["data"]["init_args"].update(sampler="zoology", val_examples=2)
    assert main(["fit", "--config", write_yaml(tmp_path / "z.yaml", cfg)]) == 0
    assert series(read_metrics(str(tmp_path)), "val/accuracy")
