"""The optional zero-shot hook: same numbers as diffmm.eval's zero_shot, and a no-op with a warning without it."""
from __future__ import annotations

import pytest
import torch

import diffmm.train.zeroshot_hook as zh
from diffmm.train.zeroshot_hook import ZeroShotHook
from train_helpers import TinyCLIP


def test_hook_matches_direct_evaluation(image_text_data):
    from diffmm.data.tokenizers import clip_tokenizer
    from diffmm.data.transforms import image_transform
    from diffmm.eval.image_sources import open_image_source
    from diffmm.eval.zeroshot import zero_shot

    model = TinyCLIP().eval()
    names = ["red", "green", "blue"]
    hook = ZeroShotHook(image_text_data[1], names, ["a {} shape"], label_field="json:label", batch_size=8)
    got = hook.run(model, epoch=0, device=torch.device("cpu"))
    source = open_image_source(image_text_data[1], image_transform(16, train=False), classnames=names,
                               label_field="json:label", batch_size=8, num_workers=0)
    ref = zero_shot(model, clip_tokenizer(16), source, names, ["a {} shape"], show_progress=False)
    assert ref.n == 16 and got == {"top1": ref.top1, "top5": ref.top5}
    assert hook.run(model, epoch=0, device=torch.device("cpu"), rank=1) == {}  # rank 0 only


def test_hook_without_eval_module_warns_once(monkeypatch):
    monkeypatch.setattr(zh, "zeroshot_available", lambda: False)
    hook = ZeroShotHook("unused", ["a", "b"])
    with pytest.warns(UserWarning, match="not available"):
        assert hook.run(TinyCLIP(), epoch=0, device=torch.device("cpu")) == {}
    assert hook.run(TinyCLIP(), epoch=1, device=torch.device("cpu")) == {}
