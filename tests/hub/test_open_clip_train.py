"""Checkpoints of open_clip_train (``{'epoch', 'name', 'state_dict', 'optimizer'}``, DDP's ``module.`` keys) load
as the model that was trained: the architecture from the run (``params.txt``, or the run name open_clip_train
makes), else a one-line warning saying what was assumed; its timm-tower route (``visual.trunk.*``) too."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

import diffmm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# heads 16 wide: shapes alone would give 64-wide heads, another model
OC_NARROW = {"embed_dim": 32,
             "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 16},
             "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2}}
OC_TIMM = {"embed_dim": 128, "quick_gelu": True,
           "vision_cfg": {"timm_model_name": "diffmm_diffclip_tiny", "timm_pool": "token", "timm_proj": "linear",
                          "image_size": 64},
           "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 4}}


@pytest.fixture(scope="module")
def names(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oc_train_cfgs")
    out = {"narrow": "diffmm-octrain-narrow", "timm": "diffmm-octrain-timm"}
    for key, cfg in (("narrow", OC_NARROW), ("timm", OC_TIMM)):
        (folder / f"{out[key]}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(str(folder))
    return out


def train_checkpoint(tmp_path, model, run_name: str, params: str | None = None):
    """What open_clip_train.main saves: logs/RUN/checkpoints/epoch_1.pt (+ logs/RUN/params.txt)."""
    run = tmp_path / "logs" / "run"
    (run / "checkpoints").mkdir(parents=True)
    if params is not None:
        (run / "params.txt").write_text(params)
    sd = {"module." + k: v for k, v in model.state_dict().items()}
    torch.save({"epoch": 1, "name": run_name, "state_dict": sd, "optimizer": {"state": {}, "param_groups": []}},
               run / "checkpoints" / "epoch_1.pt")
    return run / "checkpoints" / "epoch_1.pt"


def ours(caplog) -> list:
    return [r for r in caplog.records if r.name == "diffmm.hub"]


def features(model, size: int, context: int):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, size, size, generator=g)
    text = open_clip.tokenizer.SimpleTokenizer(context_length=context)(["a cat", "two dogs"])
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(text)


def assert_features(model, ref, size: int, context: int):
    for a, b in zip(features(model.eval(), size, context), features(ref, size, context)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("where", ["run_name", "params.txt"])
def test_architecture_from_the_run(tmp_path, names, where, caplog):
    torch.manual_seed(0)
    ref = open_clip.create_model(names["narrow"]).eval()
    if where == "run_name":  # open_clip_train's default run name
        path = train_checkpoint(tmp_path, ref, f"2026_01_01-00_00_00-model_{names['narrow']}-lr_0.0005-b_8-j_1-p_fp32")
    else:
        path = train_checkpoint(tmp_path, ref, "my-run", params=f"lr: 0.0005\nmodel: {names['narrow']}\n")
    with caplog.at_level(logging.WARNING, logger="diffmm.hub"):
        model = diffmm.load_pretrained(path)
        same = diffmm.create_model(str(path))
    assert model.config.vision_cfg.head_width == 16 and model.config.text_cfg.heads == 4
    assert_features(model, ref, 32, 16)
    assert_features(same, ref, 32, 16)
    assert not ours(caplog)


def test_unnamed_architecture_says_what_was_assumed(tmp_path, names, caplog):
    torch.manual_seed(0)
    ref = open_clip.create_model(names["narrow"]).eval()
    path = train_checkpoint(tmp_path, ref, "my-run")
    with caplog.at_level(logging.WARNING, logger="diffmm.hub"):
        guessed = diffmm.load_pretrained(path)
    (record,) = ours(caplog)
    assert "assumed 64-wide attention heads" in record.message and "model_name=" in record.message
    assert guessed.config.vision_cfg.head_width == 64  # loads (shapes agree), but it is another model
    assert (features(guessed.eval(), 32, 16)[0] - features(ref, 32, 16)[0]).abs().max() > 1e-3
    other = train_checkpoint(tmp_path / "other", ref, "2026_01_01-00_00_00-model_NoSuchArch-lr_0.1-b_8-j_1-p_fp32")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffmm.hub"):
        diffmm.load_pretrained(other)
    assert ["which open_clip does not know here" in r.message for r in ours(caplog)] == [True, False]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffmm.hub"):
        for model in (diffmm.load_pretrained(path, model_name=names["narrow"]),
                      diffmm.load_pretrained(path, head_width=16, text_head_width=16)):
            assert_features(model, ref, 32, 16)
    assert not ours(caplog)


def test_timm_tower_route(tmp_path, names):
    """open_clip_train with diffmm's image tower by its timm name: ``visual.trunk.*`` loads into diffmm's DiffCLIP
    (DiffCLIP-dagger-Tiny's architecture), the same outputs."""
    torch.manual_seed(0)
    ref = open_clip.create_model(names["timm"]).eval()
    path = train_checkpoint(tmp_path, ref, f"2026_01_01-00_00_00-model_{names['timm']}-lr_0.0005-b_8-j_1-p_amp")
    model = diffmm.load_pretrained(path)
    assert model.config == diffmm.create_model("DiffCLIP-dagger-Tiny").config
    assert_features(model, ref, 64, 32)
    into = diffmm.create_model("DiffCLIP-dagger-Tiny", pretrained=str(path))
    assert_features(into, ref, 64, 32)


def test_training_diffmm_towers_with_open_clip_train(tmp_path):
    """The documented way (docs/models.md): open_clip_train.main run by a one-line wrapper that imports diffmm
    (which registers the diffmm_* timm towers), the architecture an open_clip folder (``local-dir:``); its
    checkpoint loads into diffmm's DiffCLIP with the trained model's outputs."""
    rng = np.random.default_rng(0)
    rows = ["filepath,title"]
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        rows.append(f"{tmp_path / f'{i}.png'},a photo number {i}")
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "open_clip_config.json").write_text(json.dumps({"model_cfg": OC_TIMM}))
    cmd = [sys.executable, "-c", "import sys, diffmm; from open_clip_train.main import main; main(sys.argv[1:])",
           "--model", f"local-dir:{tmp_path / 'arch'}", "--train-data", str(tmp_path / "train.csv"),
           "--dataset-type", "csv", "--csv-separator", ",", "--batch-size", "2", "--epochs", "1", "--workers", "0",
           "--lr", "1e-3", "--logs", str(tmp_path / "logs"), "--name", "run", "--device", "cpu", "--precision", "fp32"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    path = tmp_path / "logs" / "run" / "checkpoints" / "epoch_1.pt"
    model = diffmm.load_pretrained(path)  # the architecture from params.txt (model: local-dir:...)
    assert model.config == diffmm.create_model("DiffCLIP-dagger-Tiny").config
    ref = open_clip.create_model(f"local-dir:{tmp_path / 'arch'}")
    ref.load_state_dict({k.removeprefix("module."): v for k, v in torch.load(path)["state_dict"].items()})
    assert_features(model, ref.eval(), 64, 32)
