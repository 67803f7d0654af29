"""The one preprocessing path (``diffmm.models.clip.preprocess``): transforms and tokenizer read from the model."""
from __future__ import annotations

import numpy as np
import open_clip
import pytest
import torch
from open_clip.transform import AugmentationCfg
from open_clip.transform import image_transform as oc_transform
from PIL import Image

import diffmm
from diffmm.models.clip.config import IMAGENET_MEAN, IMAGENET_STD, OPENAI_MEAN, OPENAI_STD
from diffmm.models.clip.preprocess import (DEFAULT_TRAIN_SCALE, image_transform, normalization_of, tokenizer_for,
                                           transforms_for, truncate_of)

LONG = " ".join(["word"] * 40)


@pytest.mark.parametrize("train", [False, True])
def test_image_transform_equals_open_clips(train):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 70), dtype=np.uint8))  # grey, not square
    lib = oc_transform(32, train, mean=OPENAI_MEAN, std=OPENAI_STD, aug_cfg=AugmentationCfg(scale=DEFAULT_TRAIN_SCALE))
    torch.manual_seed(3)
    a = image_transform(32, train)(img)
    torch.manual_seed(3)
    torch.testing.assert_close(a, lib(img), rtol=0, atol=0)


def test_transforms_and_tokenizer_follow_the_models_config():
    model = diffmm.create_model("DiffCLIP-Tiny", vision_cfg={"image_size": 32, "image_mean": list(IMAGENET_MEAN),
                                                             "image_std": list(IMAGENET_STD)},
                                text_cfg={"context_length": 16, "truncate": "cut"})
    assert normalization_of(model) == (IMAGENET_MEAN, IMAGENET_STD) and truncate_of(model) == "cut"
    train, val = transforms_for(model)
    pixel = val(Image.new("RGB", (40, 50), (128, 64, 32)))
    assert pixel.shape == (3, 32, 32) == train(Image.new("RGB", (40, 50))).shape
    want = (torch.tensor([128, 64, 32]) / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    torch.testing.assert_close(pixel[:, 5, 5], want.float(), atol=1e-4, rtol=0)
    tok = tokenizer_for(model)
    ids = tok([LONG])
    assert ids.shape == (1, 16) and int(ids[0, -1]) != tok.eot_token_id  # 'cut': no end-of-text forced last
    assert torch.equal(diffmm.get_tokenizer(model)([LONG]), ids)
    plain = diffmm.create_model("CLIP-Tiny")
    assert normalization_of(plain) == (OPENAI_MEAN, OPENAI_STD)
    assert int(tokenizer_for(plain)([LONG])[0, -1]) == tok.eot_token_id  # 'eot': open_clip's rule


def test_open_clip_models_keep_open_clips_preprocessing():
    model = open_clip.create_model("ViT-B-32", force_preprocess_cfg={"mean": (0.5, 0.5, 0.5), "std": (0.25,) * 3})
    model.diffmm_open_clip_name = "ViT-B-32"
    assert normalization_of(model) == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    _, val = transforms_for(model)
    assert val(Image.new("RGB", (300, 240))).shape == (3, 224, 224)
    assert tokenizer_for(model)(["a cat"]).shape == (1, 77)
