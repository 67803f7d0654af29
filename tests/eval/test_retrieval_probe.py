"""Retrieval recall@K against a brute-force count, several captions per image; linear probe with a known answer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from eval_helpers import TableCLIP, cap_tokenizer, to_tensor_rgb, write_caption_shard

from diffmm.eval.common import EvalError
from diffmm.eval.linear_probe import extract_features, linear_probe
from diffmm.eval.retrieval import recall_at_k, retrieval_on_shards


def brute_force(img, txt, owner, k):
    sims = txt @ img.T
    t2i = np.mean([owner[t] in np.argsort(-sims[t])[:k] for t in range(len(txt))])
    i2t = np.mean([any(owner[j] == i for j in np.argsort(-sims[:, i])[:k]) for i in range(len(img))])
    return i2t, t2i


@pytest.mark.parametrize("as_json", [False, True])
def test_retrieval_recall_matches_brute_force(tmp_path, as_json):
    g = torch.Generator().manual_seed(0)
    n_img, D = 40, 6
    captions, owner, j = [], [], 0
    for i in range(n_img):
        n = 1 + i % 3  # 1-3 captions per image
        captions.append(list(range(j, j + n)))
        owner += [i] * n
        j += n
    img = F.normalize(torch.randn(n_img, D, generator=g), dim=-1)
    txt = F.normalize(img[torch.tensor(owner)] + 0.9 * torch.randn(j, D, generator=g), dim=-1)  # noisy: recall < 1
    write_caption_shard(str(tmp_path / "a.tar"), captions[:25], 0, extra_bad=True, as_json=as_json)
    write_caption_shard(str(tmp_path / "b.tar"), captions[25:], 25, as_json=as_json)
    res = retrieval_on_shards(TableCLIP(img, txt), cap_tokenizer, str(tmp_path / "{a,b}.tar"), to_tensor_rgb,
                              caption_field="json:captions" if as_json else "txt", batch_size=8, num_workers=0,
                              show_progress=False)
    assert res["images"] == n_img and res["texts"] == j
    assert res["skipped"] == ({"corrupt_image": 1, "missing_text": 1} if not as_json else
                              {"missing_text": 2})  # bad1 has no json; bad2 no caption at all
    for k in (1, 5, 10):
        i2t, t2i = brute_force(img.numpy(), txt.numpy(), owner, k)
        assert res[f"image_to_text_R@{k}"] == pytest.approx(i2t) and res[f"text_to_image_R@{k}"] == pytest.approx(t2i)
    assert 0 < res["text_to_image_R@1"] < res["text_to_image_R@10"] <= 1


def test_recall_structured_exact():
    # odd captions sit closer to the next image: text->image R@1 = 0.5, R@2 = 1; every image still has its
    # own caption as the best one (the odd images' only caption with a component on them)
    n = 10
    img = torch.eye(n)
    owner = torch.arange(n)
    txt = torch.stack([img[i] if i % 2 == 0 else F.normalize(img[(i + 1) % n] + 0.5 * img[i], dim=0)
                       for i in range(n)])
    r = recall_at_k(img, txt, owner, ks=(1, 2), chunk=3)
    assert r["text_to_image_R@1"] == 0.5 and r["text_to_image_R@2"] == 1.0
    assert r["image_to_text_R@1"] == 1.0


def test_linear_probe_known_accuracy():
    rng = np.random.default_rng(0)
    n = 200
    y = np.arange(n) % 2
    x = np.where(y[:, None] == 1, 1.0, -1.0) + 0.1 * rng.standard_normal((n, 3))
    ty = np.arange(100) % 2
    tx = np.where(ty[:, None] == 1, 1.0, -1.0) + 0.1 * rng.standard_normal((100, 3))
    ty_noisy = ty.copy()
    ty_noisy[:10] = 1 - ty_noisy[:10]  # 10 test labels flipped: a sane probe scores exactly 0.90
    res = linear_probe(x, y, tx, ty_noisy, refine=3)
    assert res["top1"] == 0.90 and res["train"] == n and res["test"] == 100
    assert res["val_accuracy"] == 1.0 and 13 < len(res["sweep"]) <= 13 + 3  # coarse + refined grid (shared points once)
    with pytest.raises(EvalError, match="at least two classes"):
        linear_probe(x, np.zeros(n, int), tx, ty)


def test_extract_features_streams(tmp_path):
    class Src:
        num_samples = 6

        def __iter__(self):
            for s in range(0, 6, 2):
                yield torch.rand(2, 3, 4, 4), torch.tensor([s % 3, (s + 1) % 3])

    X, y = extract_features(TableCLIP(torch.randn(256, 5), torch.randn(2, 5)), Src(), show_progress=False)
    assert X.shape == (6, 5) and y.tolist() == [0, 1, 2, 0, 1, 2]
    np.testing.assert_allclose(np.linalg.norm(X, axis=1), 1.0, rtol=1e-6)


def test_the_retrieval_progress_bar_ends_where_max_batches_stops(tmp_path, monkeypatch):
    import diffmm.eval.retrieval as retrieval
    from diffmm.data import index_shards

    bars = []

    class Bar:
        def __init__(self, total=None, **kwargs):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            pass

    monkeypatch.setattr(retrieval, "tqdm", Bar)
    write_caption_shard(str(tmp_path / "a.tar"), [[i] for i in range(20)])
    index_shards([str(tmp_path / "a.tar")])  # sizes.json: the bar knows the shards' 20 images
    img = F.normalize(torch.randn(20, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    for max_batches, total in ((None, 20), (2, 16)):
        res = retrieval_on_shards(TableCLIP(img, img), cap_tokenizer, str(tmp_path / "a.tar"), to_tensor_rgb,
                                  batch_size=8, num_workers=0, max_batches=max_batches)
        assert (bars[-1].total, bars[-1].n, res["images"]) == (total, total, total)
