"""The zero-shot hook of training: the same numbers as diffmm.eval's zero_shot with the model's preprocessing."""
from __future__ import annotations


from diffmm.eval.image_sources import open_image_source
from diffmm.eval.zeroshot import zero_shot
from diffmm.models.clip.preprocess import image_transform
from diffmm.models.clip.tokenizer import CLIPTokenizer
from diffmm.train.clip_module import ZeroShotHook
from train_helpers import TinyCLIP


def test_hook_matches_direct_evaluation(image_text_data):
    model = TinyCLIP().eval()
    names = ["red", "green", "blue"]
    hook = ZeroShotHook(image_text_data[1], names, ["a {} shape"], label_field="json:label", batch_size=8)
    got = hook.run(model, epoch=0)
    source = open_image_source(image_text_data[1], image_transform(16, train=False), classnames=names,
                               label_field="json:label", batch_size=8, num_workers=0)
    ref = zero_shot(model, CLIPTokenizer(16), source, names, ["a {} shape"], show_progress=False)
    assert ref.n == 16 and got == {"top1": ref.top1, "top5": ref.top5}
    assert hook.run(model, epoch=0, rank=1) == {}  # rank 0 only
