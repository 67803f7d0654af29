"""Lightning checkpoints of `diffmm fit` load everywhere (load_pretrained, create_model, eval, export) with
torch.load(weights_only=True), rebuilt from the model record the training module saves, or (checkpoints without
one) from the module's hyper-parameters."""
from __future__ import annotations

import argparse
import logging
import pathlib

import pytest
import torch
from open_clip.model import CLIP

import diffmm
from diffmm.cli import main as diffmm_main
from diffmm.hub.factory import create_model
from diffmm.hub.formats import MODEL_KEY, is_lightning
from diffmm.models.hub_mixin import model_record

SMALL = {"embed_dim": 32, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 16},
         "text_cfg": {"context_length": 16, "width": 64, "heads": 4, "layers": 2}}


def _ckpt(path, model, hparams, config: bool = True, **extra):
    ckpt = {"epoch": 0, "global_step": 3, "pytorch-lightning_version": "2.6.6", "hyper_parameters": hparams,
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, **extra}
    if config:
        ckpt[MODEL_KEY] = model_record(model)
    torch.save(ckpt, path)
    return str(path)


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture()
def open_clip_file(tmp_path):
    torch.manual_seed(0)
    oc = CLIP(embed_dim=32, vision_cfg=SMALL["vision_cfg"], text_cfg={**SMALL["text_cfg"], "vocab_size": 49408})
    torch.save(oc.state_dict(), tmp_path / "oc.pt")
    return str(tmp_path / "oc.pt")


def test_checkpoint_with_model_config_and_with_hyperparameters_only(tmp_path, open_clip_file):
    swap = {"init": "upcycle", "seed": 3}
    up = create_model("OpenCLIP-Tiny", open_clip_file, swap=swap, **SMALL)
    with torch.no_grad():  # "training" moved the weights away from the pretrained ones
        for p in up.parameters():
            p.add_(0.01 * torch.randn_like(p))
    hp = {"model_name": "OpenCLIP-Tiny", "model_kwargs": SMALL, "pretrained": open_clip_file, "swap": swap,
          "lr": 1e-4, "betas": (0.9, 0.98), "out": pathlib.Path("runs/x")}  # a Path: allowed, plain data
    a = _ckpt(tmp_path / "a.ckpt", up, hp)
    b = _ckpt(tmp_path / "b.ckpt", up, hp, config=False)  # rebuilt from model_name + model_kwargs + swap
    assert is_lightning(pathlib.Path(a)) and not is_lightning(pathlib.Path(open_clip_file))
    pathlib.Path(open_clip_file).unlink()  # the pretrained file is not needed to load a checkpoint
    for path in (a, b):
        for m in (diffmm.load_pretrained(path), create_model(path)):
            assert m.config.vision_cfg.attn_type == "diff_upcycled" and _same(m, up) and not m.training
    # as pretrained= of a standard config (the swap applies after loading): one line saying what to do
    with pytest.raises(ValueError, match="holds differential-attention weights.*pass the file itself as the model"):
        create_model("OpenCLIP-Tiny", pretrained=a, swap=swap, **SMALL)


def test_weights_only_reading(tmp_path):
    torch.manual_seed(0)
    m = create_model("CLIP-Tiny", **SMALL)
    path = _ckpt(tmp_path / "ns.ckpt", m, {"model_name": "CLIP-Tiny", "model_kwargs": SMALL,
                                           "args": argparse.Namespace(lr=1)})
    with pytest.raises(PermissionError, match="trust_pickle=True"):
        diffmm.load_pretrained(path)
    assert _same(diffmm.load_pretrained(path, trust_pickle=True), m)
    torch.save({"pytorch-lightning_version": "2.6.6", "state_dict": {"x.y": torch.zeros(1)}}, tmp_path / "e.ckpt")
    with pytest.raises(KeyError, match="no weights under the prefix 'model.'"):
        diffmm.load_pretrained(tmp_path / "e.ckpt")
    no_name = _ckpt(tmp_path / "n.ckpt", m, {}, config=False)
    with pytest.raises(ValueError, match="saves no model record and no model_name"):
        diffmm.load_pretrained(no_name)


def test_eval_and_export_take_a_checkpoint(tmp_path, caplog, capsys):
    from diffmm.eval.loading import load_clip

    torch.manual_seed(0)
    m = create_model("DiffCLIP-Tiny", **SMALL).eval()
    path = _ckpt(tmp_path / "last.ckpt", m, {"model_name": "DiffCLIP-Tiny", "model_kwargs": SMALL})
    with caplog.at_level(logging.WARNING, logger="diffmm.eval"):
        net, preprocess, tok = load_clip(path, device="cpu")
    assert not [r for r in caplog.records if "random weights" in r.message] and _same(net, m)
    assert tok(["x"]).shape == (1, 16)
    assert diffmm_main(["export", path, str(tmp_path / "out")]) == 0
    assert _same(diffmm.load_pretrained(tmp_path / "out"), m)
    # a config name exports with a warning about its random weights; --model on a non-Lightning file is an error
    with caplog.at_level(logging.WARNING, logger="diffmm.hub"):
        assert diffmm_main(["export", "CLIP-Tiny", str(tmp_path / "rand")]) == 0
    assert any("random weights" in r.message for r in caplog.records)
    assert diffmm_main(["export", str(tmp_path / "out"), str(tmp_path / "o2"), "--model", "CLIP-Tiny"]) == 2
    assert "--model / --model_config choose the architecture of a Lightning checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["clip", "lm"])
def test_training_modules_write_the_model_record(tmp_path, kind):
    """What the modules save rebuilds the model with no hyper-parameters at all (nothing replayed or guessed)."""
    from diffmm.train.clip_module import CLIPModule
    from diffmm.train.lm_module import LMModule

    torch.manual_seed(0)
    if kind == "clip":
        module = CLIPModule("OpenCLIP-Tiny", model_kwargs=SMALL, swap={"init": "upcycle", "layers": [1]})
    else:
        module = LMModule("diff-tiny", model_kwargs={"n_layer": 1, "vocab_size": 100}, tokenizer=None)
    ckpt = {"pytorch-lightning_version": "2.6.6", "hyper_parameters": {}, "state_dict": module.state_dict()}
    module.on_save_checkpoint(ckpt)
    assert ckpt[MODEL_KEY] == model_record(module.model)
    torch.save(ckpt, tmp_path / "m.ckpt")
    model = diffmm.load_pretrained(tmp_path / "m.ckpt")
    assert model.config == module.model.config and _same(model, module.model)
