"""Hostile shards: compression bombs, decompression-bomb images and silent ``pipe:`` commands are
skipped and counted within configurable caps, never exhausting memory or hanging."""
from __future__ import annotations

import io
import os
import tarfile
import time
import tracemalloc

import pytest
from PIL import Image

from diffmm.data.image_text import MAX_IMAGE_PIXELS, image_text_loader
from diffmm.data.stats import DataStats
from diffmm.data.tar_reader import ReadLimits, iter_tar_samples

pytestmark = pytest.mark.timeout(120)


def _add(tf, name, data, size=None):
    info = tarfile.TarInfo(name)
    info.size = len(data) if size is None else size
    tf.addfile(info, io.BytesIO(data) if size is None else data)


class Zeros(io.RawIOBase):
    """A stream of zero bytes (writes a huge member without holding it in memory)."""

    def readinto(self, b):
        b[:] = bytes(len(b))
        return len(b)


def _run(url, **kw):
    loader = image_text_loader(url, 2, num_workers=0,
                               tokenizer=lambda t: __import__("torch").tensor([[int(x)] for x in t]),
                               image_size=8, train=False, rank=0, world_size=1, **kw)
    ids = [i for _, tok in loader for i in tok[:, 0].tolist()]
    return ids, loader.dataset.stats.snapshot()


def test_gzip_bomb_member_is_skipped_without_being_read(tmp_path, dh):
    path = str(tmp_path / "bomb.tar.gz")
    with tarfile.open(path, "w:gz", compresslevel=1) as tf:
        _add(tf, "0000.png", dh.png_bytes(0))
        _add(tf, "0000.txt", b"0")
        _add(tf, "0001.png", Zeros(), size=64 << 20)    # 64 MiB of zeros: ~300 KB compressed
        _add(tf, "0001.txt", b"1")
        _add(tf, "0002.png", dh.png_bytes(2))
        _add(tf, "0002.txt", b"2")
    assert os.path.getsize(path) < 400_000
    tracemalloc.start()
    ids, counts = _run(path, max_member_bytes=1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert sorted(ids) == [0, 2]
    assert counts["skip_oversized"] == 1 and counts["samples_in"] == 3
    # skipping still inflates the stream (in bounded bursts: gzip's ~1000:1 times tarfile's 10 KiB reads)
    assert peak < 48 << 20, f"peak {peak / 2**20:.1f} MiB: the oversized member was read into memory"
    small = str(tmp_path / "small.tar")
    with tarfile.open(small, "w") as tf:
        _add(tf, "0000.png", bytes(3 << 20))
        _add(tf, "0000.txt", b"0")
    assert _run(small)[1]["skip_corrupt_image"] == 1                      # under the 64 MiB default: read
    assert _run(small, max_member_bytes=2 << 20)[1]["skip_oversized"] == 1  # configurable
    assert _run(small, max_member_bytes=None)[1]["skip_corrupt_image"] == 1  # and can be lifted


def _png(size, mode="1"):
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, "PNG")
    return buf.getvalue()


def test_decompression_bomb_images_are_skipped_before_decoding(tmp_path, dh):
    from diffmm.data.writer import ShardWriter

    big = _png((10_000, 10_000))                      # 1e8 pixels > Pillow's 89.5 M: 300 MB as RGB; ~12 KB as PNG
    with ShardWriter(str(tmp_path), "s") as w:
        w.write("0000", {"png": dh.png_bytes(0), "txt": "0"})
        w.write("0001", {"png": big, "txt": "1"})
        w.write("0002", {"png": _png((300, 300), "RGB"), "txt": "2"})
    url = str(tmp_path / "s-000000.tar")
    tracemalloc.start()
    ids, counts = _run(url)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert sorted(ids) == [0, 2] and counts["skip_image_too_large"] == 1
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB: the bomb was decoded"
    assert MAX_IMAGE_PIXELS == Image.MAX_IMAGE_PIXELS
    ids, counts = _run(url, max_image_pixels=200 * 200)   # a lower cap also skips the 300x300 image
    assert ids == [0] and counts["skip_image_too_large"] == 2


def test_silent_pipe_command_times_out(tmp_path, dh):
    t0 = time.monotonic()
    stats = DataStats()
    samples = list(iter_tar_samples("pipe:sleep 100", stats, limits=ReadLimits(pipe_timeout=1.0)))
    assert samples == [] and time.monotonic() - t0 < 10
    snap = stats.snapshot()
    assert snap["shards_failed"] == 1


def test_pipe_that_stalls_mid_shard_keeps_what_came_before(tmp_path, dh):
    pattern, _ = dh.write_id_shards(str(tmp_path), [6])
    path = str(tmp_path / "s00-000000.tar")
    half = os.path.getsize(path) // 2
    url = f"pipe:head -c {half} {path}; sleep 100"
    t0 = time.monotonic()
    ids, counts = _run(url, pipe_timeout=1.0, samples_per_epoch=6)
    assert time.monotonic() - t0 < 20
    assert ids and set(ids) < set(range(6))
    assert counts["shards_truncated"] + counts["shards_failed"] == 1


def test_pipe_timeout_is_a_data_module_and_check_option():
    import inspect

    from diffmm.cli import parse
    from diffmm.train.datamodules import ImageTextDataModule, TextDataModule

    for cls in (ImageTextDataModule, TextDataModule):
        params = inspect.signature(cls).parameters
        assert {"max_member_bytes", "pipe_timeout"} <= set(params)
    assert "max_image_pixels" in inspect.signature(ImageTextDataModule).parameters
    _, _, args = parse(["shards", "check", "x.tar", "--max_member_bytes", "2MB", "--max_image_pixels", "null",
                        "--pipe_timeout", "5"])
    assert (args["max_member_bytes"], args["max_image_pixels"], args["pipe_timeout"]) == ("2MB", None, 5.0)
