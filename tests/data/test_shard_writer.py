"""ShardWriter: reproducible bytes, maxcount/maxsize, sizes.json, key checks; url expansion."""
from __future__ import annotations

import hashlib
import json

import pytest

from diffmm.data.sizes import shard_counts
from diffmm.data.urls import expand_sources
from diffmm.data.writer import ShardWriter, sanitize_key


def write(directory, n=10, **kw):
    with ShardWriter(str(directory), "x", **kw) as w:
        for i in range(n):
            w.write(f"{i:04d}", {"txt": f"caption {i}", "json": json.dumps({"i": i}), "bin": bytes(range(i))})
    return w


def digest(paths):
    return [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths]


def test_same_samples_give_identical_shards(tmp_path):
    a, b = write(tmp_path / "a", maxcount=4), write(tmp_path / "b", maxcount=4)
    assert digest(a.shards) == digest(b.shards)


def test_maxcount_maxsize_and_sizes_json(tmp_path):
    w = write(tmp_path, maxcount=4)
    assert [w.sizes[f"x-{i:06d}.tar"] for i in range(3)] == [4, 4, 2]
    assert json.load(open(tmp_path / "sizes.json")) == w.sizes
    counts = shard_counts([str(tmp_path / "x-{:06d}.tar".format(i)) for i in range(3)])
    assert sum(c.samples for c in counts.values()) == 10
    w2 = write(tmp_path / "small", maxsize=2500)      # ~1 KiB of overhead per field: 1 sample per shard
    assert len(w2.shards) == 10 and set(w2.sizes.values()) == {1}


def test_rerun_replaces_old_shards(tmp_path):
    write(tmp_path, maxcount=2)                       # 5 shards
    w = write(tmp_path, n=3, maxcount=10)             # 1 shard
    assert sorted(p.name for p in tmp_path.glob("x-*.tar")) == ["x-000000.tar"]
    assert json.load(open(tmp_path / "sizes.json")) == {"x-000000.tar": 3} == w.sizes


def test_bad_keys_are_rejected(tmp_path):
    with ShardWriter(str(tmp_path), "x") as w:
        with pytest.raises(ValueError, match="no dots"):
            w.write("a.b", {"txt": "x"})
        w.write("ok", {"txt": "x"})
        with pytest.raises(ValueError, match="duplicate sample key 'ok'"):
            w.write("ok", {"txt": "y"})
    assert sanitize_key("dir/file name.rst.txt") == "dir_file_name_rst_txt"


def test_expand_sources_braces_and_weights():
    src = expand_sources("a/{0..2}.tar::b/{00..01}.tar", weights=[3, 1])
    assert [s.urls for s in src] == [("a/0.tar", "a/1.tar", "a/2.tar"), ("b/00.tar", "b/01.tar")]
    assert [s.weight for s in src] == [3.0, 1.0]
    with pytest.raises(ValueError, match="2 source weights for 1 sources"):
        expand_sources("a/{0..2}.tar", weights=[1, 2])


def test_weighted_sources_are_sampled_in_proportion(tmp_path, dh):
    pa, _ = dh.write_id_shards(str(tmp_path / "a"), [10, 10], start=0)
    pb, _ = dh.write_id_shards(str(tmp_path / "b"), [10, 10], start=1000)
    from diffmm.data.image_text import image_text_loader

    loader = image_text_loader([pa, pb], 10, num_workers=0, tokenizer=dh.id_tokenizer, image_size=8, weights=[3, 1],
                               resampled=True, samples_per_epoch=800, rank=0, world_size=1)
    ids, n = dh.collect_ids(loader)
    frac_a = sum(i < 1000 for i in ids) / len(ids)
    assert n == 80 and 0.6 < frac_a < 0.9
    with pytest.raises(ValueError, match="resampled"):
        image_text_loader([pa, pb], 10, tokenizer=dh.id_tokenizer, weights=[3, 1])
