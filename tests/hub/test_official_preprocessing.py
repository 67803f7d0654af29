"""Official DiffCLIP checkpoints load with the official preprocessing (that of github hammoudhasan/DiffCLIP, built
on SLIP: ImageNet mean/std, the SLIP tokenizer's truncation), recorded in the model's config so every path
(load_pretrained, create_model, eval / classify's load_clip, export, Lightning checkpoints) uses it."""
from __future__ import annotations

import argparse
import json

import torch
from PIL import Image
from safetensors.torch import save_file

import diffmm
from diffmm.eval.loading import load_clip
from diffmm.hub.factory import create_model
from diffmm.models.clip.config import IMAGENET_MEAN, IMAGENET_STD, OPENAI_MEAN, OPENAI_STD
from diffmm.models.clip.tokenizer import CLIPTokenizer
from test_clip_formats import TINY_OVERRIDES, official_state_dict

LONG = " ".join(["a very long caption about a cat sitting on a red mat"] * 12)  # > 77 tokens


def _slip_checkpoint(path):
    torch.save({"epoch": 39, "state_dict": official_state_dict(), "optimizer": {}, "scaler": {}, "best_acc1": 14.4,
                "args": argparse.Namespace(model="DiffCLIP_VITB16")}, path)
    return str(path)


def _normalised_pixel(preprocess, rgb=(128, 64, 32)) -> torch.Tensor:
    return preprocess(Image.new("RGB", (80, 80), rgb))[:, 10, 10]


def _expect(rgb, mean, std) -> torch.Tensor:
    return (torch.tensor(rgb) / 255.0 - torch.tensor(mean)) / torch.tensor(std)


def test_cut_truncation_matches_the_official_tokenizer():
    eot, cut = CLIPTokenizer(77, "eot"), CLIPTokenizer(77, "cut")
    ids = [cut.sot_token_id] + cut.encode(LONG) + [cut.eot_token_id]  # the official tokenizer's row, before cutting
    assert len(ids) > 77
    a, b = eot([LONG, "a cat"]), cut([LONG, "a cat"])
    assert b[0].tolist() == ids[:77]  # truncated, no EOT forced
    assert a[0, -1] == eot.eot_token_id and a[0, :76].tolist() == ids[:76]  # open_clip: EOT kept last
    assert int(b[0].argmax()) != 76 and cut.eot_token_id not in b[0].tolist()
    assert torch.equal(a[1], b[1])  # short captions are the same


def test_official_checkpoint_gets_official_preprocessing_on_every_path(tmp_path):
    path = _slip_checkpoint(tmp_path / "checkpoint_best.pt")
    model = diffmm.load_pretrained(path, trust_pickle=True)
    v, t = model.config.vision_cfg, model.config.text_cfg
    assert (v.mean, v.std, t.truncate) == (IMAGENET_MEAN, IMAGENET_STD, "cut")
    tok = diffmm.get_tokenizer(model)
    assert tok.truncate == "cut" and tok([LONG]).shape == (1, 32)
    # eval / classify resolve the same file as --model, and as --pretrained of a named config
    for name, pre in ((path, None), ("DiffCLIP-Tiny", path)):
        kwargs = TINY_OVERRIDES if pre else {}
        net, preprocess, tok = load_clip(name, pre, device="cpu", trust_pickle=True, **kwargs)
        torch.testing.assert_close(_normalised_pixel(preprocess), _expect((128, 64, 32), IMAGENET_MEAN, IMAGENET_STD),
                                   atol=1e-4, rtol=0)
        assert tok.truncate == "cut" and net.config.text_cfg.truncate == "cut"
    # export -> load keeps it; so does a Lightning checkpoint of a run started from the file
    model.save_pretrained(tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["config"]["text_cfg"]["truncate"] == "cut"
    back = diffmm.load_pretrained(tmp_path / "export")
    assert back.config.vision_cfg.mean == IMAGENET_MEAN
    from diffmm.train.clip_module import CLIPModule

    module = CLIPModule("DiffCLIP-Tiny", model_kwargs=TINY_OVERRIDES, pretrained=path, trust_pickle=True)
    ckpt = {"pytorch-lightning_version": "2.6.6", "hyper_parameters": dict(module.hparams),
            "state_dict": {f"model.{k}": v for k, v in module.model.state_dict().items()}}
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, tmp_path / "last.ckpt")
    from_ckpt = diffmm.load_pretrained(tmp_path / "last.ckpt")
    assert from_ckpt.config.vision_cfg.std == IMAGENET_STD and from_ckpt.config.text_cfg.truncate == "cut"


def test_bare_state_dicts_keep_diffmms_preprocessing(tmp_path):
    """diffmm's own DiffCLIP state dict has the official layout: without the official file's marks (SLIP entries,
    `module.` prefix) it keeps diffmm's defaults; preprocess='official' asks for the official one."""
    sd = {k[len("module."):]: v for k, v in official_state_dict().items()}
    save_file(sd, str(tmp_path / "w.safetensors"))
    plain = diffmm.load_pretrained(tmp_path / "w.safetensors")
    assert (plain.config.vision_cfg.mean, plain.config.vision_cfg.std) == (OPENAI_MEAN, OPENAI_STD)
    assert plain.config.text_cfg.truncate == "eot"
    forced = diffmm.load_pretrained(tmp_path / "w.safetensors", preprocess="official")
    assert forced.config.vision_cfg.mean == IMAGENET_MEAN and forced.config.text_cfg.truncate == "cut"
    # an explicit override wins over the file's preprocessing
    m = create_model("DiffCLIP-Tiny", pretrained=_slip_checkpoint(tmp_path / "best.pt"), trust_pickle=True,
                     vision_cfg={"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}, **TINY_OVERRIDES)
    assert m.config.vision_cfg.mean == (0.5, 0.5, 0.5) and m.config.text_cfg.truncate == "cut"
