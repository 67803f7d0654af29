"""webdataset pipeline stages (``wds.map``, ``wds.select``, ``wds.decode``, handlers) inside diffmm's datasets."""
from __future__ import annotations

import pytest
import torch
import webdataset as wds
from PIL import Image

from diffmm.data.image_text import ImageLabelDataset, ImageTextDataset, image_text_loader
from diffmm.data.stats import SKIP_REASONS, DataStats
from diffmm.data.stages import run_stages
from diffmm.data.tar_reader import iter_tar_samples
from diffmm.data.text import TextDataset
from diffmm.data.writer import ShardWriter

pytestmark = pytest.mark.timeout(180)  # a broken batch quota hangs instead of failing


def ids_of(batch) -> list[int]:
    return batch[1][:, 0].tolist()


def caption_id(sample: dict) -> int:
    return int(sample["txt"])


# stages (and the tokenizer) at module level, so that spawned DataLoader workers can unpickle them
def id_tokenizer(texts: list[str]) -> torch.Tensor:
    """Captions are sample ids."""
    return torch.tensor([[int(t)] for t in texts], dtype=torch.long)


def plus_1000(sample: dict) -> dict:
    sample["txt"] = str(caption_id(sample) + 1000).encode()
    return sample


def is_odd(sample: dict) -> bool:
    return caption_id(sample) % 2 == 1


def fails_on_fives(sample: dict) -> dict:
    if caption_id(sample) % 5 == 0:
        raise ValueError(f"no fives: {sample['__key__']}")
    return sample


def assert_balanced(stats: DataStats) -> None:
    c = stats.snapshot()
    assert c["samples_in"] == c["samples_out"] + sum(c["skip_" + r] for r in SKIP_REASONS), c


def dataset(pattern, dh, cls=ImageTextDataset, **kw):
    if cls is ImageTextDataset:
        kw.setdefault("tokenizer", id_tokenizer)
    return cls(pattern, 64, image_size=8, shuffle=False, equalize=False, **kw)


def test_the_reader_yields_webdataset_samples(id_shards):
    """Same dict as ``wds.WebDataset`` gives for a shard written by diffmm's ShardWriter."""
    pattern, _ = id_shards
    url = pattern.replace("{00..07}", "00")
    ours = list(iter_tar_samples(url, DataStats()))
    theirs = list(wds.WebDataset(url, shardshuffle=False))
    assert ours == theirs and set(ours[0]) == {"__key__", "__url__", "__local_path__", "png", "txt"}


def test_map_and_select_change_and_drop_samples(id_shards, dh):
    pattern, all_ids = id_shards
    ds = dataset(pattern, dh, stages=[wds.select(is_odd), wds.map(plus_1000)])
    ids = [i for b in ds for i in ids_of(b)]
    assert sorted(ids) == [i + 1000 for i in all_ids if i % 2]
    assert ds.stats.snapshot()["skip_filtered"] == len(all_ids) // 2
    assert_balanced(ds.stats)


def test_decode_pil_before_diffmm_decoding(id_shards, dh):
    """``wds.decode("pil")`` turns png into a PIL image and txt into str; the dataset takes both."""
    pattern, all_ids = id_shards
    seen = []

    def record(sample):
        seen.append((type(sample["png"]), type(sample["txt"])))
        return sample

    images, tokens = next(iter(dataset(pattern, dh, stages=[wds.decode("pil"), wds.map(record)])))
    assert images.shape == (48, 3, 8, 8) and sorted(tokens[:, 0].tolist()) == all_ids
    assert set(seen) == {(Image.Image, str)}
    # the same images as without the stage
    plain, _ = next(iter(dataset(pattern, dh)))
    assert torch.equal(images, plain)


def test_decode_pil_keeps_the_pixel_cap(id_shards, dh):
    pattern, _ = id_shards
    ds = dataset(pattern, dh, stages=[wds.decode("pil")], max_image_pixels=8 * 8 - 1)
    assert list(ds) == [] and ds.stats.snapshot()["skip_image_too_large"] == 48


def test_label_dataset_after_decode(tmp_path, dh):
    with ShardWriter(str(tmp_path), "l", maxcount=100) as w:
        for i in range(10):
            w.write(f"{i:04d}", {"png": dh.png_bytes(i), "cls": str(i % 3), "json": f'{{"group": {i % 4}}}'})
    for field, want in (("cls", [i % 3 for i in range(10)]), ("json:group", [i % 4 for i in range(10)])):
        ds = dataset(w.pattern, dh, cls=ImageLabelDataset, label_field=field, stages=[wds.decode("pil")])
        (_, labels), = list(ds)
        assert labels.tolist() == want   # cls decoded to int, json to dict by webdataset


def test_handler_decides_what_a_stage_error_does(id_shards, dh):
    pattern, all_ids = id_shards
    fives = [i for i in all_ids if i % 5 == 0]
    with pytest.raises(ValueError, match="no fives"):          # default: wds.reraise_exception
        list(dataset(pattern, dh, stages=[wds.map(fails_on_fives)]))
    ds = dataset(pattern, dh, stages=[wds.map(fails_on_fives)], handler=wds.ignore_and_continue)
    assert sorted(i for b in ds for i in ids_of(b)) == sorted(set(all_ids) - set(fives))
    assert ds.stats.snapshot()["skip_stage_error"] == len(fives)
    assert_balanced(ds.stats)
    with pytest.warns(UserWarning, match="no fives"):           # a handler that warns, used as it is
        ds = dataset(pattern.replace("{00..07}", "00"), dh, stages=[wds.map(fails_on_fives)],
                     handler=wds.warn_and_continue)
        assert sorted(i for b in ds for i in ids_of(b)) == [1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="handler said stop"):
        list(dataset(pattern, dh, stages=[wds.map(fails_on_fives)], handler=wds.ignore_and_stop))
    # a stage with its own handler drops the sample itself: counted as filtered
    ds = dataset(pattern, dh, stages=[wds.map(fails_on_fives, handler=wds.ignore_and_continue)])
    assert len([i for b in ds for i in ids_of(b)]) == len(all_ids) - len(fives)
    assert ds.stats.snapshot()["skip_filtered"] == len(fives)


def test_stages_must_keep_one_sample_dict(id_shards):
    sample = next(iter_tar_samples(id_shards[0].replace("{00..07}", "00"), DataStats()))
    with pytest.raises(ValueError, match="one sample dict; .* became tuple"):
        run_stages(sample, [wds.to_tuple("png", "txt")], wds.reraise_exception, DataStats())

    def twice(samples):
        for s in samples:
            yield s
            yield dict(s)

    with pytest.raises(ValueError, match="became several samples"):
        run_stages(sample, [twice], wds.reraise_exception, DataStats())


@pytest.mark.parametrize("context", [None, "spawn"])
def test_exact_epochs_with_a_filter_over_ranks_and_workers(tmp_path, dh, context):
    """2 ranks x 2 workers over uneven shards with half the samples filtered out: every rank yields the
    same number of batches (the workers re-read their ranges to fill their quotas) and the counters add up."""
    pattern, all_ids = dh.write_id_shards(str(tmp_path), [5, 11, 3, 9])
    per_rank, batches = [], []
    for rank in range(2):
        loader = image_text_loader(pattern, 3, num_workers=2, tokenizer=id_tokenizer, image_size=8, train=True,
                                   rank=rank, world_size=2, stages=[wds.select(is_odd)],
                                   multiprocessing_context=context)
        ids, n = dh.collect_ids(loader)
        per_rank.append(ids)
        batches.append(n)
        assert all(i % 2 for i in ids)
        assert_balanced(loader.dataset.stats)
        assert loader.dataset.stats.snapshot()["skip_filtered"] > 0
    assert batches[0] == batches[1] == len(all_ids) // (3 * 2)


def test_text_dataset_takes_stages(tmp_path):
    with ShardWriter(str(tmp_path), "t", maxcount=100) as w:
        for i in range(6):
            w.write(f"{i:04d}", {"txt": "Hello World " * (i + 1)})
    seen = []

    def lower(sample):
        seen.append(sample["txt"])
        sample["txt"] = sample["txt"].lower()
        return sample

    ds = TextDataset(w.pattern, 2, seq_len=8, tokenizer="clip", train=False,
                     stages=[wds.decode(), wds.select(lambda s: len(s["txt"]) > 12), wds.map(lower)])
    rows = torch.cat(list(ds))
    assert rows.shape[1] == 9 and seen and all(isinstance(t, str) for t in seen)
    assert ds.stats.snapshot()["skip_filtered"] == 1 and ds.stats.snapshot()["samples_out"] == 5
