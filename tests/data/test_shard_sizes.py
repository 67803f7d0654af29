"""Samples per shard without ``sizes.json``: counted like the reader reads, cached, img2dataset stats."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import tarfile

import pytest

from diffmm.data import sizes as sizes_mod
from diffmm.data.image_text import image_text_loader
from diffmm.data.sizes import CACHE_FILE, UnknownShardSize, inspect_shard, shard_counts
from diffmm.data.stats import DataStats
from diffmm.data.tar_reader import iter_tar_samples


def _shard(tmp_path, dh, n=10, prefix="s"):
    pattern, _ = dh.write_id_shards(str(tmp_path), [n], prefix=prefix)
    os.remove(tmp_path / "sizes.json")
    return str(tmp_path / f"{prefix}00-000000.tar")


def _read(url):
    return sum(1 for _ in iter_tar_samples(url, DataStats()))


def _offsets(path):
    with tarfile.open(path) as tf:
        return [(m.offset, m.offset_data, m.size) for m in tf.getmembers()]


@pytest.mark.parametrize("damage", ["none", "inside_member", "at_header", "no_end_block", "gzip", "empty",
                                    "garbage", "no_members"])
def test_count_agrees_with_the_reader(tmp_path, dh, damage):
    path = _shard(tmp_path, dh)
    offsets = _offsets(path)
    if damage == "inside_member":
        os.truncate(path, offsets[12][1] + 10)
    elif damage == "at_header":
        os.truncate(path, offsets[12][0])
    elif damage == "no_end_block":
        last_header, last_data, size = offsets[-1]
        os.truncate(path, last_data + -(-size // 512) * 512)
    elif damage == "gzip":
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            g.write(f.read())
        path += ".gz"
    elif damage == "empty":
        open(path, "wb").close()
    elif damage == "garbage":
        open(path, "wb").write(b"not a tar" * 100)
    elif damage == "no_members":
        tarfile.open(path, "w").close()
    assert inspect_shard(path) == _read(path)
    if damage == "none":
        assert inspect_shard(path) == 10


def test_counts_are_cached_beside_the_shards_and_refreshed_when_a_shard_changes(tmp_path, dh):
    path = _shard(tmp_path, dh, n=10)
    assert shard_counts([path])[path].samples == 10
    cache = json.load(open(tmp_path / CACHE_FILE))
    assert cache["s00-000000.tar"]["samples"] == 10
    cache["s00-000000.tar"]["samples"] = 99                    # the cache is used while the file is unchanged
    json.dump(cache, open(tmp_path / CACHE_FILE, "w"))
    assert shard_counts([path])[path] == sizes_mod.ShardCount(99, "counted")
    dh.write_id_shards(str(tmp_path), [7])                     # rewritten: new size and mtime
    os.remove(tmp_path / "sizes.json")
    assert shard_counts([path])[path].samples == 7


def test_read_only_folder_caches_under_xdg_cache_home(tmp_path, dh, monkeypatch):
    path = _shard(tmp_path / "ro", dh)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sizes_mod.os, "access", lambda p, mode: False)   # root ignores chmod; pretend
    assert shard_counts([path])[path].samples == 10
    assert not os.path.exists(tmp_path / "ro" / CACHE_FILE)
    [cached] = list((tmp_path / "cache" / "diffmm" / "shard-counts").glob("*.json"))
    assert json.load(open(cached))["s00-000000.tar"]["samples"] == 10


def test_img2dataset_stats_and_partial_sizes_json(tmp_path, dh):
    a = _shard(tmp_path, dh, prefix="a")
    b = _shard(tmp_path, dh, prefix="b")
    c = _shard(tmp_path, dh, prefix="c")
    (tmp_path / "a00-000000_stats.json").write_text(json.dumps({"count": 12, "successes": 10, "failed_to_download": 2}))
    (tmp_path / "sizes.json").write_text(json.dumps({"b00-000000.tar": 10}))
    counts = shard_counts([a, b, c])
    assert counts[a] == sizes_mod.ShardCount(10, str(tmp_path / "a00-000000_stats.json"))
    assert counts[b] == sizes_mod.ShardCount(10, str(tmp_path / "sizes.json"))
    assert counts[c] == sizes_mod.ShardCount(10, "counted")
    assert list(json.load(open(tmp_path / CACHE_FILE))) == ["c00-000000.tar"]   # only c had to be counted


def test_loader_length_without_sizes_json(tmp_path, dh):
    pattern, ids = dh.write_id_shards(str(tmp_path), [5, 9, 3])
    os.remove(tmp_path / "sizes.json")
    loader = image_text_loader(pattern, 4, num_workers=0, tokenizer=dh.id_tokenizer, image_size=8, train=True,
                               rank=0, world_size=1)
    assert len(loader) == 17 // 4
    assert len(dh.collect_ids(loader)[0]) == 16


def test_pipe_urls_need_an_explicit_epoch_size(tmp_path, dh):
    path = _shard(tmp_path, dh)
    with pytest.raises(UnknownShardSize):
        shard_counts([f"pipe:cat {path}"])
    loader = image_text_loader(f"pipe:cat {path}", 4, num_workers=0, tokenizer=dh.id_tokenizer, image_size=8,
                               train=True, rank=0, world_size=1)
    with pytest.raises(ValueError, match="samples_per_epoch"):
        len(loader)
    loader = image_text_loader(f"pipe:cat {path}", 4, num_workers=0, tokenizer=dh.id_tokenizer, image_size=8,
                               train=True, rank=0, world_size=1, samples_per_epoch=10)
    ids, n = dh.collect_ids(loader)
    assert n == 2 == len(loader) and len(set(ids)) == 8


def test_copied_demo_style_folder_trains_after_index(tmp_path, dh):
    pattern, _ = dh.write_id_shards(str(tmp_path / "src"), [6, 6])
    shutil.copytree(tmp_path / "src", tmp_path / "dst", ignore=shutil.ignore_patterns("sizes.json"))
    written = sizes_mod.write_sizes([str(tmp_path / "dst" / "s00-000000.tar"),
                                     str(tmp_path / "dst" / "s01-000000.tar")], progress=False)
    assert written == {str(tmp_path / "dst" / "sizes.json"): {"s00-000000.tar": 6, "s01-000000.tar": 6}}
