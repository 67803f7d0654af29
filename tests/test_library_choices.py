"""Where diffmm keeps its own code next to a well-kept library (docs/architecture.md, section 5): each test shows
that the own code equals the library where they overlap, or the library behaviour that made diffmm keep its own.

If a library changes so that one of the "why not" tests fails, revisit the choice in docs/architecture.md.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from PIL import Image


# ---------------------------------------------------------------- tar reading: diffmm.data.tar_reader vs webdataset
def _shard(tmp_path) -> tuple[str, bytes]:
    from diffmm.data.writer import ShardWriter

    with ShardWriter(str(tmp_path), "s", maxcount=100) as w:
        for i in range(4):  # members per sample, in order: json (1 block), txt (4 blocks)
            w.write(f"k{i}", {"txt": (f"caption {i} " * 200)[:2000].encode(), "json": b"{}"})
    with open(tmp_path / "s-000000.tar", "rb") as f:
        return str(tmp_path / "s-000000.tar"), f.read()


def test_truncated_shard_webdataset_yields_an_incomplete_sample_diffmm_counts_it(tmp_path):
    import webdataset as wds
    from webdataset import tariterators

    from diffmm.data.stats import DataStats
    from diffmm.data.tar_reader import iter_tar_samples

    _, data = _shard(tmp_path)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[:2 * 3584 + 1024 + 200])  # inside the header of k2's txt member (its json is complete)

    stats = DataStats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = list(iter_tar_samples(str(cut), stats))
    assert [s["__key__"] for s in ours] == ["k0", "k1"]
    counts = stats.snapshot()
    assert counts["skip_truncated"] == 1 and counts["shards_truncated"] == 1

    # webdataset 1.0.2, even with reraise_exception: the cut header ends the tar quietly, k2 comes out without its
    # `txt`, and nothing counts it
    with open(cut, "rb") as stream, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        members = tariterators.tar_file_expander([{"url": str(cut), "stream": stream}], handler=wds.reraise_exception)
        theirs = list(tariterators.group_by_keys(members, handler=wds.reraise_exception))
    assert [s["__key__"] for s in theirs] == ["k0", "k1", "k2"]
    assert "txt" in theirs[1] and "txt" not in theirs[2]


# ------------------------------------------------------------------------- RMSNorm vs torch.nn.RMSNorm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_torch_rmsnorm(dtype):
    from diffmm.nn import RMSNorm

    torch.manual_seed(0)
    x = (torch.randn(4, 7, 64) * 30).to(dtype)
    ours, lib = RMSNorm(64, eps=1e-5), torch.nn.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_()
        lib.weight.copy_(ours.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Mismatch dtype between input and weight" for bf16 inputs
        torch.testing.assert_close(ours(x), lib(x), rtol=0, atol=0 if dtype == torch.float32 else 1e-2)


# ------------------------------------------------------------- warmup + cosine vs torch's composed schedulers
def test_warmup_cosine_equals_torch_sequential_lr_until_the_end_then_holds_the_floor():
    from diffmm.train.optim import WarmupCosineLR

    warmup, total, lr, min_lr = 10, 100, 1.0, 0.1
    o1 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    ours = WarmupCosineLR(o1, warmup, total, lr, min_lr)
    o2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    lib = torch.optim.lr_scheduler.SequentialLR(o2, [
        torch.optim.lr_scheduler.LinearLR(o2, start_factor=1 / warmup, total_iters=warmup - 1),
        torch.optim.lr_scheduler.CosineAnnealingLR(o2, T_max=total - warmup, eta_min=min_lr)], milestones=[warmup])
    a, b = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(total + 30):
            a.append(o1.param_groups[0]["lr"])
            b.append(o2.param_groups[0]["lr"])
            ours.step()
            lib.step()
    np.testing.assert_allclose(a[:total + 1], b[:total + 1], rtol=1e-9, atol=1e-12)
    assert a[total:] == [min_lr] * 30  # a run longer than planned (resumed, extended) stays at the floor ...
    assert max(b[total:]) > 2 * min_lr  # ... while CosineAnnealingLR climbs back up its next period


# ------------------------------------------------------------ zero-shot classifier vs open_clip's builder
def test_zero_shot_classifier_equals_open_clip():
    import open_clip.zero_shot_classifier as ocz

    import diffmm
    from diffmm.eval import build_zero_shot_classifier

    torch.manual_seed(0)
    model = diffmm.create_model("CLIP-Tiny").eval()
    tok = diffmm.get_tokenizer("CLIP-Tiny")
    names = ["cat", "dog", "emoji of a red apple"]
    templates = ["a photo of a {}.", "an emoji of {}."]
    ours = build_zero_shot_classifier(model, tok, names, templates, classes_per_batch=2)
    lib = ocz.build_zero_shot_classifier(model, tok, names, templates, num_classes_per_batch=2)
    torch.testing.assert_close(ours, lib, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------- recall@K vs torchmetrics' hit rate
def test_recall_at_k_equals_torchmetrics_hit_rate():
    from torchmetrics.retrieval import RetrievalHitRate

    from diffmm.eval.retrieval import recall_at_k

    torch.manual_seed(0)
    n_img, per = 40, 3  # 3 captions per image
    img = torch.nn.functional.normalize(torch.randn(n_img, 16), dim=-1)
    txt = torch.nn.functional.normalize(img.repeat_interleave(per, 0) + 0.8 * torch.randn(n_img * per, 16), dim=-1)
    t2i = torch.arange(n_img).repeat_interleave(per)
    ours = recall_at_k(img, txt, t2i, ks=(1, 5, 10), chunk=7)
    sims = img @ txt.T  # (n_img, n_txt)
    for k in (1, 5, 10):
        i2t = RetrievalHitRate(top_k=k)(sims.flatten(), (t2i[None, :] == torch.arange(n_img)[:, None]).flatten(),
                                        indexes=torch.arange(n_img).repeat_interleave(n_img * per))
        t2i_rate = RetrievalHitRate(top_k=k)(sims.T.flatten(), (t2i[:, None] == torch.arange(n_img)[None, :]).flatten(),
                                             indexes=torch.arange(n_img * per).repeat_interleave(n_img))
        assert ours[f"image_to_text_R@{k}"] == pytest.approx(float(i2t), abs=1e-6)
        assert ours[f"text_to_image_R@{k}"] == pytest.approx(float(t2i_rate), abs=1e-6)


# ---------------------------------------------------------------------- IDX files vs torchvision's reader
def test_idx_reader_equals_torchvision(tmp_path):
    from torchvision.datasets.mnist import read_image_file, read_label_file

    from diffmm.eval.idx import IdxArray
    from idx_helpers import write_idx

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 255, (12, 28, 28), dtype=np.uint8), rng.integers(0, 10, 12).astype(np.uint8)
    pi = write_idx(str(tmp_path / "imgs-idx3-ubyte"), images)
    pl = write_idx(str(tmp_path / "labels-idx1-ubyte"), labels)
    ours_i, ours_l = IdxArray(pi), IdxArray(pl)
    np.testing.assert_array_equal(np.stack([ours_i[i] for i in range(len(ours_i))]), read_image_file(pi).numpy())
    np.testing.assert_array_equal(np.array([ours_l[i] for i in range(len(ours_l))]).reshape(-1),
                                  read_label_file(pl).numpy())


# ------------------------------------------------------------------ image transforms vs open_clip's
@pytest.mark.parametrize("train", [False, True])
def test_image_transform_equals_open_clip(train):
    from open_clip.transform import AugmentationCfg
    from open_clip.transform import image_transform as oc_transform

    from diffmm.models.clip.config import OPENAI_MEAN, OPENAI_STD
    from diffmm.models.clip.preprocess import image_transform

    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 70), dtype=np.uint8))  # grey, not square
    ours = image_transform(32, train)
    lib = oc_transform(32, train, mean=OPENAI_MEAN, std=OPENAI_STD, aug_cfg=AugmentationCfg(scale=(0.5, 1.0)))
    torch.manual_seed(3)
    a = ours(img)
    torch.manual_seed(3)
    b = lib(img)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------- autograd all-gather vs torch.distributed.nn.functional
def _all_gather_worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from diffmm.train.losses import AllGatherWithGrad

        torch.manual_seed(rank)
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.arange(24.0).view(6, 4)
        (AllGatherWithGrad.apply(x) * w).sum().backward()
        ours, x.grad = x.grad.clone(), None
        import torch.distributed.nn.functional as dnf

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (torch.cat(dnf.all_gather(x)) * w).sum().backward()
        out[rank] = (torch.equal(ours, x.grad), any(issubclass(c.category, FutureWarning) for c in caught))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_gather_with_grad_equals_torch_functional_which_is_deprecated():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.get_context("spawn").Manager() as manager:
        out = manager.dict()
        mp.start_processes(_all_gather_worker, args=(port, out), nprocs=2, start_method="spawn", join=True)
        res = dict(out)
    assert res == {0: (True, True), 1: (True, True)}  # same gradients; torch warns the function is deprecated
