"""Data position: a resumed stream yields exactly the batches (augmentations included) of an uninterrupted one."""
from __future__ import annotations

import pytest
import torch

from diffmm.data.image_text import ImageTextDataset
from diffmm.data.stream import ShardLoader
from diffmm.models.clip.preprocess import image_transform
from diffmm.train.resume import ResumableLoader
from train_helpers import write_image_text_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_image_text_shards(str(tmp_path_factory.mktemp("it")), n=48, per_shard=12, size=16)


def _loader(spec: str, num_workers: int) -> ResumableLoader:
    # RandomResizedCrop makes every batch depend on the augmentation RNG
    ds = ImageTextDataset(spec, 4, transform=image_transform(12, train=True), context_length=8, train=True,
                          shuffle_buffer=8, seed=3, rank=0, world_size=1)
    return ResumableLoader(ShardLoader(ds, num_workers=num_workers), seed=3)


def _epoch(loader: ResumableLoader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(im.clone(), tok.clone()) for im, tok in loader]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_replays_exactly(shards, num_workers):
    full = _loader(shards, num_workers)
    e0, e1 = _epoch(full), _epoch(full)
    assert len(e0) == len(full) == 12 and full.epoch == 1
    assert not _same(e0, e1)  # each epoch reshuffles and re-augments
    resumed = _loader(shards, num_workers)
    torch.rand(5)  # the global RNG state of the resumed process differs: must not matter
    resumed.load_state_dict({"epoch": 1, "batches": 5})
    assert _same(_epoch(resumed), e1[5:])
    assert _same(_epoch(resumed), _epoch(_loader_at(shards, num_workers, 2)))  # then epoch 2 as usual


def _loader_at(spec: str, num_workers: int, epoch: int) -> ResumableLoader:
    loader = _loader(spec, num_workers)
    loader.load_state_dict({"epoch": epoch, "batches": 0})
    return loader


def test_position_comes_from_the_training_progress(shards):
    """With ``progress`` (TrainingProgress.position) the loader starts where training stands, whatever state
    Lightning hands it."""
    loader = _loader(shards, 0)
    loader.progress = lambda: {"epoch": 7, "batches": 4}
    loader.load_state_dict({"epoch": 2, "batches": 1})  # an older position: the progress record wins
    a = _epoch(loader)
    assert loader.epoch == 7 and _same(a, _epoch(_loader_at(shards, 0, 7))[4:])
    assert loader.state_dict() == {"epoch": 7, "batches": 4}


def _keyed(spec: str, rank: int, world: int, num_workers: int) -> ResumableLoader:
    ds = ImageTextDataset(spec, 4, transform=image_transform(12, train=True), context_length=8, train=True,
                          shuffle_buffer=8, seed=3, rank=rank, world_size=world)
    ds.with_keys = True
    return ResumableLoader(ShardLoader(ds, num_workers=num_workers), seed=3, rank=rank)


@pytest.mark.parametrize("world,now,done,workers", [(2, 1, 2, 0), (1, 2, 5, 0), (2, 3, 1, 0), (1, 1, 3, 2)])
def test_resume_on_another_world_size_trains_each_sample_once(shards, world, now, done, workers):
    """An epoch interrupted after ``done`` batches per rank on ``world`` ranks (no workers) and finished on ``now``
    ranks (``workers`` workers): every sample of the epoch once, fewer than one global batch left out."""
    first = []
    for rank in range(world):
        loader = _keyed(shards, rank, world, 0)
        loader.progress = lambda: {"epoch": 1, "batches": 0}
        it = iter(loader)
        for _ in range(done):
            next(it)
        first += loader.keys
    per_epoch = len(_keyed(shards, 0, world, 0))
    saved = {"world_size": world, "batches": done, "epoch_batches": per_epoch, "num_workers": 0}
    rest = []
    for rank in range(now):
        loader = _keyed(shards, rank, now, workers)
        loader.progress = lambda: {"epoch": 1, "batches": 0, "reshard": saved}
        n = sum(1 for _ in loader)
        assert n == (per_epoch - done) * world // now  # the same count on every rank
        rest += loader.keys
    seen = first + rest
    print(f"{world} -> {now} ranks after {done} batches: {len(seen)} of 48 samples, {len(seen) - len(set(seen))} "
          f"repeated, {48 - len(set(seen))} left out")
    assert len(seen) == len(set(seen)) and 48 - len(seen) < 4 * max(world, now)
