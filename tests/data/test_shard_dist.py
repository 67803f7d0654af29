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



def test_evaluation_with_more_workers_than_samples_reads_each_sample_once(tmp_path, dh):
    pattern, all_ids = dh.write_id_shards(str(tmp_path), [3])
    loader = _loader(pattern, 0, 1, num_workers=4, train=False, batch_size=2)
    ids, n_batches = dh.collect_ids(loader)         # a worker with an empty range reads nothing (not everything)
    assert sorted(ids) == all_ids and n_batches == len(loader)


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


# ----- exact epochs: every sample at most once over ranks x workers, < one global batch left out ----
def _epoch_ids(pattern, world, workers, batch, epoch=0, context=None, **kw):
    """Ids per rank for one epoch, and each rank's (batches yielded, len(loader))."""
    per_rank, counts = [], []
    for rank in range(world):
        loader = _loader(pattern, rank, world, num_workers=workers, batch_size=batch, train=True,
                         multiprocessing_context=context if workers else None, **kw)
        loader.set_epoch(epoch)
        ids, n = collect(loader)
        per_rank.append(ids)
        counts.append((n, len(loader)))
    return per_rank, counts


def collect(loader):
    ids, n = [], 0
    for _, tokens in loader:
        ids += tokens[:, 0].tolist()
        n += 1
    return ids, n


def _assert_exact(per_rank, counts, n_samples, world, batch):
    flat = [i for ids in per_rank for i in ids]
    assert len(flat) == len(set(flat)), f"{len(flat) - len(set(flat))} samples seen twice"
    assert n_samples - len(flat) < world * batch, f"{n_samples - len(flat)} samples left out"
    expected = n_samples // (world * batch)
    assert counts == [(expected, expected)] * world, counts   # equal batch counts: DDP cannot hang


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_issue_case_two_ranks_two_workers_batch_4_over_24_samples(tmp_path, dh, context):
    pattern, ids = dh.write_id_shards(str(tmp_path), [6, 6, 6, 6])
    per_rank, counts = _epoch_ids(pattern, 2, 2, 4, context=context)
    _assert_exact(per_rank, counts, len(ids), 2, 4)
    assert sorted(i for r in per_rank for i in r) == ids        # 24 = 3 global batches: nothing left out


@pytest.mark.parametrize("sizes,world,workers,batch", [
    ([5, 9, 3, 11, 6, 8], 2, 3, 3),      # uneven shards, 6 global workers
    ([1, 9, 3, 17, 2], 2, 2, 3),         # very uneven
    ([23], 2, 2, 4),                     # one shard shared by 4 workers
    ([7, 5], 3, 2, 2),                   # fewer shards than workers, odd world size
    ([3] * 10, 2, 2, 5),                 # many small shards, remainder left out
    ([13, 0, 4], 2, 1, 3),               # an empty shard in the middle
])
def test_exact_epochs_with_uneven_shard_and_worker_splits(tmp_path, dh, sizes, world, workers, batch):
    import tarfile

    pattern, ids = dh.write_id_shards(str(tmp_path), sizes)
    for k, n in enumerate(sizes):
        if n == 0:   # the writer makes no file for no samples: an empty tar, and no sizes.json entry (counted)
            tarfile.open(tmp_path / f"s{k:02d}-000000.tar", "w").close()
    seen_orders = []
    for epoch in (0, 1):
        per_rank, counts = _epoch_ids(pattern, world, workers, batch, epoch=epoch)
        _assert_exact(per_rank, counts, len(ids), world, batch)
        seen_orders.append(per_rank)
    assert seen_orders[0] != seen_orders[1]                    # a new order every epoch


@pytest.mark.slow  # 6 spawned workers import torch: ~20 s on a quiet 2-core machine
def test_exact_epochs_under_spawn_with_uneven_splits(tmp_path, dh):
    pattern, ids = dh.write_id_shards(str(tmp_path), [5, 9, 3, 11, 6, 8])
    per_rank, counts = _epoch_ids(pattern, 2, 3, 3, context="spawn")
    _assert_exact(per_rank, counts, len(ids), 2, 3)


def test_plan_ranges_partitions_the_samples_by_quota():
    from diffmm.data.dist import plan_ranges

    sizes = [5, 9, 3, 11, 0, 6, 8]
    urls = [f"s{i}" for i in range(len(sizes))]
    for weights in ([2, 2, 1, 1], [1] * 6, [3, 0, 2], [1] * 13):
        plans = plan_ranges(urls, sizes, weights)
        owners = {}
        for g, plan in enumerate(plans):
            n = 0
            for sl in plan:
                for i in range(sl.start, sl.stop):
                    assert (sl.url, i) not in owners
                    owners[(sl.url, i)] = g
                n += sl.stop - sl.start
            assert n >= weights[g] * (sum(sizes) // sum(weights))   # enough for its batch quota
        assert len(owners) == sum(sizes)
        assert any(sl.url == "s4" for plan in plans for sl in plan)  # the empty shard is still checked


def test_overstated_sizes_json_is_reported_and_the_epoch_stays_valid(tmp_path, dh, caplog):
    import json
    import os

    pattern, ids = dh.write_id_shards(str(tmp_path), [6, 6, 6, 6])
    sizes = json.load(open(os.path.join(tmp_path, "sizes.json")))
    sizes["s01-000000.tar"] = 9                                      # really 6: 27 stated, 24 real
    json.dump(sizes, open(os.path.join(tmp_path, "sizes.json"), "w"))
    per_rank, counts = [], []
    stats = []
    for rank in range(2):
        loader = _loader(pattern, rank, 2, num_workers=0, batch_size=4, train=True)   # in-process: caplog sees logs
        got, n = collect(loader)
        per_rank.append(got)
        counts.append(n)
        stats.append(loader.dataset.stats.snapshot())
    assert counts == [3, 3]                                          # 27 // 8, equal: no hang
    assert sum(s["shards_miscounted"] for s in stats) >= 1           # once per read of the short end
    warnings = [r.getMessage() for r in caplog.records if "miscounted" in r.getMessage()]
    assert warnings and all("s01-000000.tar: 6 samples, but" in w and "says 9" in w for w in warnings)
    flat = [i for r in per_rank for i in r]
    assert set(flat) <= set(ids) and len(flat) == 24
    assert sum(s["samples_reread"] for s in stats) >= len(flat) - len(set(flat))


def test_understated_sizes_json_is_reported(tmp_path, dh, caplog):
    import json
    import os

    pattern, ids = dh.write_id_shards(str(tmp_path), [6, 6])
    sizes = json.load(open(os.path.join(tmp_path, "sizes.json")))
    sizes["s00-000000.tar"] = 4
    json.dump(sizes, open(os.path.join(tmp_path, "sizes.json"), "w"))
    loader = _loader(pattern, 0, 1, num_workers=0, batch_size=2, train=True)
    got, n = collect(loader)
    assert n == 5 and len(set(got)) == 10
    assert loader.dataset.stats.snapshot()["shards_miscounted"] == 1
    assert any("more samples than the 4" in r.getMessage() for r in caplog.records)


def test_skipped_samples_are_topped_up_without_breaking_equal_counts(tmp_path, dh):
    from diffmm.data.writer import ShardWriter

    i = 0
    for s in range(4):
        with ShardWriter(str(tmp_path), f"s{s:02d}") as w:
            for k in range(6):
                w.write(f"{i:06d}", {"png": b"broken" if k == 0 else dh.png_bytes(i), "txt": str(i)})
                i += 1
    pattern = str(tmp_path / "s{00..03}-000000.tar")
    counts = []
    for rank in range(2):
        loader = _loader(pattern, rank, 2, num_workers=2, batch_size=4, train=True)
        _, n = collect(loader)
        counts.append(n)
        snap = loader.dataset.stats.snapshot()
        assert snap["skip_corrupt_image"] >= 2 and snap["samples_reread"] > 0
    assert counts == [3, 3]
