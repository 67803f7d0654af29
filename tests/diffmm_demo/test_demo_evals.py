"""The demo's evaluations: the held-out zero-shot that encodes the images once per model gives the numbers of
``diffmm eval zeroshot``'s path for both label levels; the stamp set's numbers come with chance and the majority."""
from __future__ import annotations

import json
import os

import pytest
import torch

import diffmm
from diffmm.eval.zeroshot import encode_images

import diffmm_demo.evals as demo_evals
from diffmm_demo.evals import EMOJI_TEMPLATE, _zero_shot, held_out_zero_shot, stamps_zero_shot
from diffmm_demo.imageset import STAMPS

TINY = dict(embed_dim=16, vision_cfg=dict(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
            text_cfg=dict(context_length=16, width=32, heads=2, layers=1))


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return [diffmm.create_model(name, **TINY).eval() for name in ("CLIP-Tiny", "DiffCLIP-Tiny")]


@pytest.mark.parametrize("n", [None, 40])
def test_held_out_zero_shot_equals_the_zero_shot_path(demo_data, models, n, monkeypatch):
    """Same top-1 as the zero_shot path for both levels and both models (with 3 and 4 classes top-5 is always 1);
    the images go through each model once for both levels."""
    held = os.path.join(demo_data, "emoji", "twitter", "*.tar")
    evals = held_out_zero_shot(demo_data, held, n)
    with open(os.path.join(demo_data, "emoji", "classes.json")) as f:
        classes = json.load(f)
    encoded = []
    monkeypatch.setattr(demo_evals, "encode_images", lambda m, x, **k: encoded.append(m) or encode_images(m, x, **k))
    for model in models:  # a second model is encoded anew, not served the first one's features
        for level in ("group", "subgroup"):
            got = evals[f"zs_{level}"](model, 0)
            names = [c.replace("-", " ").lower() for c in classes[f"{level}s"]]
            want = _zero_shot(model, held, f"json:{level}_id", names, [EMOJI_TEMPLATE], n)
            assert got["images"] == want["images"] == 24  # the held-out style has 24 images
            for key in ("top1", "top5", "classes", "chance_top1", "chance_top5"):
                assert got[key] == pytest.approx(want[key]), (level, key)
    assert encoded == models  # one batch of 24 images per model, shared by its two levels


def test_stamps_zero_shot_reports_chance_and_majority(demo_data, models):
    r = stamps_zero_shot(demo_data)(models[0], 0)
    with open(os.path.join(demo_data, STAMPS, "classes.json")) as f:
        meta = json.load(f)
    assert r["images"] == 7 and r["classes"] == 2 and r["chance_top1"] == 0.5
    assert r["majority"] == meta["majority_share"] and 0.0 <= r["mean_per_class"] <= 1.0
