"""open_clip 3.3.0's ``tests/test_inference.py`` feature checks, run on diffmm models loaded through
``diffmm.create_model_and_transforms("open_clip:NAME", pretrained=FILE)``: the attributes that test reads
(``model.visual.image_size``, the tokenizer of the name, ``preprocess_val``) and its text, image and forward checks
against open_clip's own model with the same weights (made here: no download)."""
from __future__ import annotations

import json

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

import diffmm

TINY = {"embed_dim": 32, "quick_gelu": True,
        "vision_cfg": {"image_size": 48, "patch_size": 16, "width": 64, "layers": 2, "head_width": 32},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}}


@pytest.fixture(scope="module")
def tiny_name(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oc_inference_cfgs")
    (folder / "diffmm-inference-tiny.json").write_text(json.dumps(TINY))
    open_clip.add_model_config(str(folder))
    return "diffmm-inference-tiny"


def random_image_batch(batch_size: int, size: tuple[int, int]) -> list[Image.Image]:  # open_clip's util_test
    data = np.random.randint(255, size=(batch_size, size[0], size[1], 3), dtype=np.uint8)
    return [Image.fromarray(d) for d in data]


def inference(model, model_name, preprocess_val, images, texts):
    """open_clip's util_test.inference_text / inference_image / forward_model on one batch."""
    tokenizer = open_clip.get_tokenizer(model_name)
    x_im, x_txt = torch.stack([preprocess_val(im) for im in images]), tokenizer(texts)
    with torch.no_grad():
        return model.encode_text(x_txt), model.encode_image(x_im), model(x_im, x_txt)


@pytest.mark.parametrize("name", ["tiny", pytest.param("ViT-B-32", marks=pytest.mark.slow)])
def test_open_clip_inference_checks(tmp_path, tiny_name, name):
    model_name = tiny_name if name == "tiny" else name
    torch.manual_seed(0)
    ref, _, ref_val = open_clip.create_model_and_transforms(model_name)
    torch.save(ref.state_dict(), tmp_path / "weights.pt")
    model, _, preprocess_val = diffmm.create_model_and_transforms(f"open_clip:{model_name}",
                                                                   pretrained=str(tmp_path / "weights.pt"))
    model.eval(), ref.eval()
    image_size = model.visual.image_size  # what the test reads before its image checks
    assert image_size == tuple(ref.visual.image_size) and model.visual.patch_size == tuple(ref.visual.patch_size)
    assert model.visual.grid_size == tuple(ref.visual.grid_size)
    assert open_clip.get_model_preprocess_cfg(model) == open_clip.get_model_preprocess_cfg(ref)
    np.random.seed(0)
    images = random_image_batch(2, image_size)
    texts = ["a photo of a cat", "two dogs playing in the snow"]
    got, want = inference(model, model_name, preprocess_val, images, texts), inference(ref, model_name, ref_val,
                                                                                       images, texts)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)  # text features
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)  # image features
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    model.output_dict = True  # the test's dict check of open_clip's CLIP: the same values under their names
    out = inference(model, model_name, preprocess_val, images, texts)[2]
    for key, value in zip(("image_features", "text_features", "logit_scale"), got[2]):
        torch.testing.assert_close(out[key], value, atol=0, rtol=0)
