"""The model's preprocessing reaches training: the data module follows the image mean/std and the caption truncation
of the model it feeds (an official DiffCLIP checkpoint: ImageNet's and ``cut``, as the DiffCLIP code, arXiv
2503.06626, preprocesses) in every stage, and the zero-shot hook evaluates with the model's own transform and
tokenizer."""
from __future__ import annotations

import copy
import io
import os
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import diffmm
from diffmm.data.writer import ShardWriter
from diffmm.models.clip.config import IMAGENET_MEAN, IMAGENET_STD, OPENAI_MEAN, OPENAI_STD
from diffmm.models.clip.tokenizer import CLIPTokenizer
from diffmm.train.cli import main, run_cli
from diffmm.train.clip_module import CLIPModule
from diffmm.train.datamodules import ImageTextDataModule
from diffmm.train.errors import ConfigError
from diffmm.train.clip_module import ZeroShotHook
from train_configs import SHRINK, clip_config, write_yaml

LONG = " ".join(["a very long caption about a red circle on a grey ground"] * 3)  # > 16 tokens
BACKGROUND = (30, 30, 30)  # the corner pixel of every image of write_image_text_shards


def _official_file(path) -> str:
    """A DiffCLIP-Tiny (SHRINK) state dict as the official code writes it (DDP's ``module.`` prefix)."""
    model = diffmm.create_model("DiffCLIP-Tiny", **SHRINK)
    save_file({"module." + k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


def _long_caption_shard(directory) -> str:
    os.makedirs(directory, exist_ok=True)
    with ShardWriter(str(directory), "long", maxcount=8) as w:
        for i in range(4):
            buf = io.BytesIO()
            Image.new("RGB", (16, 16), BACKGROUND).save(buf, "PNG")
            w.write(f"{i:05d}", {"png": buf.getvalue(), "txt": LONG})
    return os.path.join(str(directory), "long-000000.tar")


def _expect(rgb, mean, std) -> torch.Tensor:
    return (torch.tensor(rgb) / 255.0 - torch.tensor(mean)) / torch.tensor(std)


@pytest.fixture
def config(tmp_path, image_text_data):
    cfg = clip_config(str(tmp_path / "run"), image_text_data, max_steps=1)
    long = _long_caption_shard(tmp_path / "long")
    cfg["data"]["init_args"].update(test_shards=long, predict_shards=long, val_batch_size=4)
    return cfg


@pytest.mark.parametrize("official", [True, False], ids=["official-checkpoint", "default-model"])
def test_fit_follows_the_models_preprocessing_in_every_stage(tmp_path, config, official):
    if official:
        config["model"]["init_args"]["pretrained"] = _official_file(tmp_path / "checkpoint_best.safetensors")
    mean, std, truncate = (IMAGENET_MEAN, IMAGENET_STD, "cut") if official else (OPENAI_MEAN, OPENAI_STD, "eot")
    cli = run_cli(["fit", "--config", write_yaml(tmp_path / "fit.yaml", config)])
    dm = cli.datamodule
    assert (dm.image_mean, dm.image_std, dm.truncate, dm.image_size, dm.context_length) == (mean, std, truncate, 16, 16)
    uniform = Image.new("RGB", (40, 40), (128, 64, 32))
    want_tokens = CLIPTokenizer(16, truncate)([LONG])[0]
    for stage in ("train", "val", "test", "predict"):
        loader = getattr(dm, f"{stage}_dataloader")()
        pixel = loader.dataset.transform(uniform)[:, 5, 5]
        torch.testing.assert_close(pixel, _expect((128, 64, 32), mean, std), atol=1e-4, rtol=0, msg=stage)
        if stage == "train":
            continue
        images, tokens = next(iter(loader))[:2]  # real shards: the corner pixel is the background
        torch.testing.assert_close(images[:, :, 0, 0], _expect(BACKGROUND, mean, std).expand(len(images), 3),
                                   atol=1e-4, rtol=0, msg=stage)
        if stage in ("test", "predict"):  # the long-caption shard
            assert tokens.shape == (4, 16) and torch.equal(tokens[0], want_tokens), stage
            eot = CLIPTokenizer(16).eot_token_id
            assert (int(tokens[0, -1]) == eot) == (truncate == "eot"), stage  # 'cut': no end-of-text forced last


def test_data_value_that_contradicts_the_model_is_an_error(tmp_path, capsys, config):
    config["model"]["init_args"]["pretrained"] = _official_file(tmp_path / "checkpoint_best.safetensors")
    same = copy.deepcopy(config)
    same["data"]["init_args"].update(image_mean=list(IMAGENET_MEAN), truncate="cut")  # the model's: accepted
    assert run_cli(["fit", "--config", write_yaml(tmp_path / "same.yaml", same)]).datamodule.truncate == "cut"
    # each value that differs from the model's is one line naming both
    for key, value in (("image_mean", [0.5, 0.5, 0.5]), ("truncate", "eot"), ("image_size", 224)):
        bad = copy.deepcopy(config)
        bad["data"]["init_args"][key] = value
        rc = main(["fit", "--config", write_yaml(tmp_path / "bad.yaml", bad)])
        err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
        assert rc == 2 and len(err) == 1, err
        assert f"data.{key} is {value!r} but the model's {key} is" in err[0] and "linked from the model" in err[0]


def test_data_module_without_the_cli_defaults_to_openai_and_checks_its_values(image_text_data):
    dm = ImageTextDataModule(*image_text_data, batch_size=4, num_workers=0, image_size=16, context_length=16)
    assert (dm.image_mean, dm.image_std, dm.truncate) == (OPENAI_MEAN, OPENAI_STD, "eot")
    for kwargs, key in (({"image_mean": (0.5, 0.5)}, "data.image_mean"),
                        ({"image_std": (0.5, 0.0, 0.5)}, "data.image_std"),
                        ({"truncate": "middle"}, "data.truncate")):
        with pytest.raises(ConfigError, match=key):
            ImageTextDataModule(*image_text_data, num_workers=0, **kwargs)


def test_open_clip_models_preprocess_cfg_is_followed(image_text_data):
    """An open_clip model built by open_clip keeps its own mean/std (``visual.preprocess_cfg``)."""
    from dataclasses import asdict

    from open_clip.model import CLIP
    from open_clip.transform import PreprocessCfg

    oc = CLIP(embed_dim=16, vision_cfg=dict(image_size=16, patch_size=8, width=32, layers=1, head_width=8),
              text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=4, layers=1))
    oc.visual.preprocess_cfg = asdict(PreprocessCfg(size=16, mean=IMAGENET_MEAN, std=(0.5, 0.5, 0.5)))
    dm = ImageTextDataModule(*image_text_data, num_workers=0)
    dm.trainer = SimpleNamespace(lightning_module=CLIPModule(model=oc))  # what the trainer gives the data module
    dm.setup("fit")
    assert (dm.image_mean, dm.image_std, dm.truncate, dm.image_size) == (IMAGENET_MEAN, (0.5, 0.5, 0.5), "eot", 16)
    dm.trainer.lightning_module = CLIPModule(model=oc)
    dm.given["image_std"] = (0.2, 0.2, 0.2)
    with pytest.raises(ConfigError, match=r"data.image_std is \[0.2, 0.2, 0.2\] but the model's image_std is"):
        dm.setup("fit")


def test_zeroshot_hook_uses_the_models_preprocessing(monkeypatch, image_text_data):
    import diffmm.train.clip_module as hook_module

    seen = {}
    real_source, real_zero_shot = hook_module.open_image_source, hook_module.zero_shot

    def source(spec, transform, **kw):
        seen["transform"] = transform
        return real_source(spec, transform, **kw)

    def zero_shot(model, tokenizer, *args, **kw):
        seen["tokenizer"] = tokenizer
        return real_zero_shot(model, tokenizer, *args, **kw)

    monkeypatch.setattr(hook_module, "open_image_source", source)
    monkeypatch.setattr(hook_module, "zero_shot", zero_shot)
    shrink = copy.deepcopy(SHRINK)
    shrink["vision_cfg"].update(image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    shrink["text_cfg"]["truncate"] = "cut"
    model = diffmm.create_model("DiffCLIP-Tiny", **shrink)
    hook = ZeroShotHook(image_text_data[1], ["red", "green", "blue"], ["a {} shape"], label_field="json:label",
                        batch_size=8)
    got = hook.run(model, epoch=0)
    assert set(got) == {"top1", "top5"}
    pixel = seen["transform"](Image.new("RGB", (40, 40), (128, 64, 32)))
    assert pixel.shape == (3, 16, 16)
    torch.testing.assert_close(pixel[:, 5, 5], _expect((128, 64, 32), IMAGENET_MEAN, IMAGENET_STD), atol=1e-4, rtol=0)
    tok = seen["tokenizer"]
    assert torch.equal(tok([LONG]), CLIPTokenizer(16, "cut")([LONG]))
