"""Distributed correctness: disjoint shards per rank x worker, equal batch counts, rank detection."""
from __future__ import annotations

import pytest
import torch

from diffmm.data.dist import assign_shards, batch_quota, detect_rank_world
from diffmm.data.image_text import ImageTextDataset, image_text_loader

pytestmark = pytest.mark.timeout(120)  # a broken batch quota hangs instead of failing


def id_tokenizer(texts):
    """Captions are sample ids."""
    return torch.tensor([[int(t)] for t in texts], dtype=torch.long)


def _loader(pattern, rank, world, num_workers=2, **kw):
    kw.setdefault("batch_size", 4)
    return image_text_loader(pattern, num_workers=num_workers, tokenizer=id_tokenizer, image_size=8,
                             rank=rank, world_size=world, **kw)


@pytest.mark.parametrize("n_shards", [1, 3, 4, 5, 8, 13])
def test_assign_shards_is_a_partition_of_samples(n_shards):
    urls = [f"s{i}" for i in range(n_shards)]
    samples_per_shard = 6
    owners: dict[tuple[str, int], int] = {}
    for rank in range(2):
        for worker in range(2):
            for sl in assign_shards(urls, rank, 2, worker, 2):
                for i in range(sl.offset, samples_per_shard, sl.stride):
                    assert (sl.url, i) not in owners, f"{(sl.url, i)} read twice"
                    owners[(sl.url, i)] = rank * 2 + worker
    assert len(owners) == n_shards * samples_per_shard


def test_two_ranks_two_workers_read_disjoint_shards_covering_the_set(id_shards, dh):
    pattern, all_ids = id_shards
    per_rank = []
    for rank in range(2):
        ids, n_batches = dh.collect_ids(_loader(pattern, rank, 2, train=True))  # equalized training mode
        assert len(ids) == len(set(ids)), "a rank saw a sample twice"
        per_rank.append(set(ids))
        assert n_batches == 48 // (4 * 2)
    assert not per_rank[0] & per_rank[1]
    assert per_rank[0] | per_rank[1] == set(all_ids)


def test_fewer_shards_than_workers_does_not_raise_and_stays_disjoint(tmp_path, dh):
    pattern, all_ids = dh.write_id_shards(str(tmp_path), [7, 5])
    per_rank = []
    for rank in range(2):
        ids, _ = dh.collect_ids(_loader(pattern, rank, 2, train=False, batch_size=3))   # read once, no quota
        per_rank.append(ids)
    assert sorted(per_rank[0] + per_rank[1]) == all_ids


def test_resampled_every_rank_yields_the_same_number_of_batches(tmp_path, dh):
    pattern, _ = dh.write_id_shards(str(tmp_path), [1, 9, 3, 17, 2])  # very uneven shards
    counts = []
    for rank in range(2):
        loader = _loader(pattern, rank, 2, resampled=True, samples_per_epoch=40, batch_size=3)
        ids, n = dh.collect_ids(loader)
        counts.append(n)
        assert n == len(loader) == 40 // (3 * 2)
    assert counts[0] == counts[1]


def test_equalized_uneven_shards_give_equal_batch_counts(tmp_path, dh):
    pattern, _ = dh.write_id_shards(str(tmp_path), [1, 9, 3, 17, 2])
    counts = [dh.collect_ids(_loader(pattern, rank, 2, train=True, batch_size=3))[1] for rank in range(2)]
    assert counts == [32 // 6, 32 // 6]


def test_batch_quota_sums_to_the_rank_total():
    for n in (0, 5, 47, 48, 1000):
        per_rank = batch_quota(n, 4, 2, 3, 0)[0]
        assert sum(batch_quota(n, 4, 2, 3, w)[1] for w in range(3)) == per_rank == n // 8


def test_epoch_changes_order_and_is_deterministic(id_shards, dh):
    pattern, _ = id_shards

    def order(epoch):
        loader = _loader(pattern, 0, 1, num_workers=0, train=True, shuffle_buffer=16)
        loader.set_epoch(epoch)
        return dh.collect_ids(loader)[0]

    assert order(0) == order(0)
    assert order(0) != order(1)


def test_rank_detection_handles_lightning_env_without_rank(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="rank is unknown"):
        detect_rank_world()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "0")
    assert detect_rank_world() == (1, 2)
    monkeypatch.setenv("RANK", "0")
    assert detect_rank_world() == (0, 2)


def test_pickled_dataset_keeps_the_main_process_rank(id_shards, monkeypatch):
    pattern, _ = id_shards
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "0")
    ds = ImageTextDataset(pattern, 4, tokenizer=id_tokenizer, image_size=8)
    state = ds.__getstate__()                    # what is pickled for a spawned DataLoader worker
    monkeypatch.delenv("LOCAL_RANK")             # a spawned worker: no torch.distributed, no rank env
    worker_copy = ImageTextDataset.__new__(ImageTextDataset)
    worker_copy.__dict__.update(state)
    assert worker_copy.rank_world() == (1, 2)
    with pytest.raises(RuntimeError, match="rank is unknown"):
        ds.rank_world()                          # without the snapshot the rank would be lost
