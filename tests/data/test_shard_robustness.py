"""Bad data is skipped, counted and reported: samples in = samples out + samples skipped."""
from __future__ import annotations

import os
import tarfile

import pytest
import torch

from diffmm.data.image_text import ImageTextDataset, image_text_loader
from diffmm.data.stats import SKIP_REASONS
from diffmm.data.stream import ShardLoader
from diffmm.data.writer import ShardWriter


def id_tokenizer(texts):
    return torch.tensor([[int(t)] for t in texts], dtype=torch.long)


def run(pattern, num_workers=0, **kw):
    """Read every sample once; return (ids out, counts, summary line)."""
    loader = image_text_loader(pattern, 4, num_workers=num_workers, tokenizer=id_tokenizer, image_size=8,
                               train=False, rank=0, world_size=1, **kw)
    ids = [i for _, tok in loader for i in tok[:, 0].tolist()]
    counts = loader.dataset.stats.snapshot()
    skipped = sum(counts["skip_" + r] for r in SKIP_REASONS)
    assert counts["samples_in"] == counts["samples_out"] + skipped, counts
    assert counts["samples_out"] == len(ids)
    return ids, counts, loader.dataset.stats.summary()


def good(i, dh):
    return {"png": dh.png_bytes(i), "txt": str(i)}


@pytest.mark.parametrize("fault,fields,reason", [
    ("corrupt image bytes", {"png": b"\x89PNG\r\n\x1a\n garbage", "txt": "3"}, "corrupt_image"),
    ("cut-off image", None, "corrupt_image"),
    ("no .txt", {"png": None}, "missing_text"),
    ("no image", {"txt": "3"}, "missing_image"),
    ("non-UTF-8 caption", {"png": None, "txt": b"\xff\xfe caf\xe9"}, "bad_utf8"),
    ("empty caption", {"png": None, "txt": " \n"}, "empty_text"),
])
def test_bad_sample_is_skipped_and_counted(tmp_path, dh, fault, fields, reason):
    with ShardWriter(str(tmp_path), "s") as w:
        for i in range(6):
            if i == 3:
                if fields is None:   # a PNG cut in half
                    fields = {"png": dh.png_bytes(3, size=64)[:60], "txt": "3"}
                w.write(f"{i:04d}", {k: (dh.png_bytes(3) if v is None else v) for k, v in fields.items()})
            else:
                w.write(f"{i:04d}", good(i, dh))
    ids, counts, summary = run(str(tmp_path / "s-000000.tar"))
    assert sorted(ids) == [0, 1, 2, 4, 5], fault
    assert counts["samples_in"] == 6 and counts["skip_" + reason] == 1
    assert f"skipped=1 ({reason}=1)" in summary


def _member_offsets(path):
    with tarfile.open(path) as tf:
        return [(m.name, m.offset, m.offset_data) for m in tf.getmembers()]


def _ten_sample_shard(tmp_path, dh):
    with ShardWriter(str(tmp_path), "s") as w:
        for i in range(10):
            w.write(f"{i:04d}", good(i, dh))
    return str(tmp_path / "s-000000.tar")


def test_truncated_inside_a_member(tmp_path, dh):
    path = _ten_sample_shard(tmp_path, dh)
    name, _, data_offset = _member_offsets(path)[12]          # 0006.png
    assert name == "0006.png"
    with open(path, "r+b") as f:
        f.truncate(data_offset + 10)
    ids, counts, summary = run(path)
    assert sorted(ids) == list(range(6))
    assert counts["shards_truncated"] == 1 and counts["skip_truncated"] == 1 and counts["samples_in"] == 7
    assert "truncated=1" in summary


def test_truncated_at_a_header_boundary(tmp_path, dh):
    path = _ten_sample_shard(tmp_path, dh)
    _, header_offset, _ = _member_offsets(path)[12]          # cut right before 0006.png
    with open(path, "r+b") as f:
        f.truncate(header_offset)
    ids, counts, _ = run(path)
    # sample 0005 may have lost fields after the cut, so it is not trusted
    assert sorted(ids) == list(range(5))
    assert counts["shards_truncated"] == 1 and counts["skip_truncated"] == 1


def test_empty_shards_and_unreadable_files_are_counted(tmp_path, dh):
    with ShardWriter(str(tmp_path), "a") as w:
        for i in range(3):
            w.write(f"{i:04d}", good(i, dh))
    open(tmp_path / "b-000000.tar", "wb").close()                          # zero bytes
    tarfile.open(tmp_path / "c-000000.tar", "w").close()                    # a tar without members
    (tmp_path / "d-000000.tar").write_bytes(b"this is not a tar file" * 40)  # garbage
    ids, counts, summary = run(str(tmp_path / "{a,b,c,d}-000000.tar"))
    assert sorted(ids) == [0, 1, 2]
    assert counts["shards_empty"] == 2 and counts["shards_failed"] == 1 and counts["shards_opened"] == 4
    assert "empty=2" in summary and "failed=1" in summary


def test_counts_are_merged_across_dataloader_workers(tmp_path, dh):
    for s in range(4):
        with ShardWriter(str(tmp_path), f"s{s}") as w:
            for i in range(5):
                k = s * 5 + i
                w.write(f"{k:04d}", {"png": b"bad" if i == 0 else dh.png_bytes(k), "txt": str(k)})
    ids, counts, _ = run(str(tmp_path / "s{0..3}-000000.tar"), num_workers=2)
    assert len(ids) == 16
    assert counts["skip_corrupt_image"] == 4 and counts["samples_in"] == 20 and counts["shards_opened"] == 4


def test_pipe_urls_stream_and_failing_commands_are_counted(tmp_path, dh):
    path = _ten_sample_shard(tmp_path, dh)
    ids, counts, _ = run(f"pipe:cat {path}::pipe:cat {tmp_path}/does-not-exist.tar")
    assert sorted(ids) == list(range(10))
    assert counts["shards_failed"] == 1


def test_missing_shards_at_start_give_one_line_error(tmp_path, dh):
    _ten_sample_shard(tmp_path, dh)
    with pytest.raises(FileNotFoundError) as e:
        ImageTextDataset(str(tmp_path / "s-{000000..000002}.tar"), 4, tokenizer=id_tokenizer)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("2 shard(s) not found")
    assert "s-000001.tar" in msg and "s-000002.tar" in msg


def test_loader_reports_last_epoch_counts(tmp_path, dh):
    path = _ten_sample_shard(tmp_path, dh)
    loader = image_text_loader(path, 4, num_workers=0, tokenizer=id_tokenizer, image_size=8, train=False)
    list(loader)
    list(loader)
    assert loader.last_epoch_stats["samples_out"] == 10          # per epoch, not cumulative
    assert os.path.exists(path)


def test_truncated_sample_counted_once_when_the_epoch_rereads(tmp_path, dh):
    """Training epochs re-read a worker's range to fill the batch quota: the shard is cut off again, but its
    problem and its cut-off sample were counted on the first read."""
    with ShardWriter(str(tmp_path), "s", maxcount=6) as w:
        for i in range(12):
            w.write(f"{i:04d}", good(i, dh))
    path = str(tmp_path / "s-000001.tar")
    name, header, data = _member_offsets(path)[-1]
    ds = ImageTextDataset(str(tmp_path / "s-{000000..000001}.tar"), 4, tokenizer=id_tokenizer, image_size=8,
                          train=True, rank=0, world_size=1)
    ds.shard_counts()  # counted whole: the epoch asks for 12 samples
    with open(path, "r+b") as f:
        f.truncate(data + 10)
    for num_workers in (0, 2):
        assert sum(1 for _ in ShardLoader(ds, num_workers=num_workers)) == 3
        counts = ds.stats.snapshot()
        assert counts["skip_truncated"] == 1 and counts["shards_truncated"] == 1 and counts["samples_reread"], counts
