"""CLIP_benchmark's own code on a diffmm DiffCLIP equals `diffmm eval zeroshot|retrieval --format clip_benchmark`.

The data are drawn here (coloured shapes on noise, captions naming them) and written by CLIP_benchmark's own
converter (``clip_benchmark.webdataset_builder``) in its ``wds/`` layout; the model is a seeded DiffCLIP-Tiny saved as
a diffmm export folder. Both sides run in fp32 (CLIP_benchmark: ``--no_amp``; diffmm: ``--precision fp32``).
"""
from __future__ import annotations

import json
import math
from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import diffmm
from diffmm.cli import main
from diffmm.eval.clip_benchmark import _accuracy_numpy2, clip_benchmark, read_wds_folder, register
from diffmm.eval.loading import load_clip
from diffmm.hub.formats import MODEL_KEY
from diffmm.models.hub_mixin import model_record

cb_builder = pytest.importorskip("clip_benchmark.webdataset_builder")  # CLIP_benchmark: the 'eval' extra

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230), "yellow": (240, 220, 40)}
SHAPES = ("circle", "square")


def shape_image(colour: str, shape: str, rng: np.random.Generator, size: int = 48) -> Image.Image:
    """A coloured shape at a random place and size on a noisy grey background."""
    img = Image.fromarray(rng.integers(60, 140, (size, size, 3), dtype=np.uint8))
    r = int(rng.integers(8, 16))
    x, y = (int(v) for v in rng.integers(r, size - r, 2))
    box = (x - r, y - r, x + r, y + r)
    draw = ImageDraw.Draw(img)
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
    return img


class Images(list):
    """(image, label or captions) items, with the class names and templates CLIP_benchmark's converter saves."""

    classes: ClassVar[list[str]] = []
    templates: ClassVar[list[str]] = []


SMALL = {"embed_dim": 64, "vision_cfg": {"image_size": 32, "width": 64, "layers": 2},
         "text_cfg": {"width": 64, "heads": 2, "layers": 2}}


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return diffmm.create_model("DiffCLIP-Tiny", **SMALL).eval()


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, small_model):
    folder = tmp_path_factory.mktemp("model") / "diffclip-tiny"
    small_model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def ckpt_path(tmp_path_factory, small_model):
    """The same weights as a Lightning checkpoint of diffmm fit (model config saved in it)."""
    path = tmp_path_factory.mktemp("run") / "last.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.6", "hyper_parameters": {"model_name": "DiffCLIP-Tiny"},
                "state_dict": {f"model.{k}": v for k, v in small_model.state_dict().items()},
                MODEL_KEY: model_record(small_model)}, path)
    return str(path)


@pytest.fixture(scope="module")
def cls_root(tmp_path_factory):
    """wds/shapes: 8 classes of 2 to 9 images (unequal, so mean per-class recall differs from acc1), 3 shards."""
    rng = np.random.default_rng(0)
    names = [f"{c} {s}" for c in COLOURS for s in SHAPES]
    ds = Images((shape_image(*name.split(), rng), label) for label, name in enumerate(names)
                for _ in range(2 + label))
    ds.classes, ds.templates = names, ["a photo of a {c}.", "a drawing of a {c}."]
    root = tmp_path_factory.mktemp("wds") / "shapes"
    cb_builder.convert_dataset(ds, "test", str(root), transform=cb_builder.PIL_to_bytes("png"), image_format="png",
                               max_count=20, verbose=False)
    return str(root)


@pytest.fixture(scope="module")
def ret_root(tmp_path_factory):
    """wds/shape_captions: 24 images with 1 to 3 captions each (retrieval), 2 shards. Every caption is unique:
    equal captions of two images tie, and the two tools may break a tie differently."""
    rng = np.random.default_rng(1)
    items = Images()
    for i in range(24):
        colour, shape = list(COLOURS)[i % 4], SHAPES[(i // 4) % 2]
        caps = [f"a {colour} {shape}, number {i}", f"a {shape} in {colour}, picture {i}", f"picture {i}: {colour}"]
        items.append((shape_image(colour, shape, rng), caps[:1 + i % 3]))
    root = tmp_path_factory.mktemp("wds") / "shape_captions"
    cb_builder.convert_retrieval_dataset(items, "test", str(root), transform=cb_builder.PIL_to_bytes("png"),
                                         image_format="png", max_count=15, verbose=False)
    return str(root)


def run_cli(argv: list[str]) -> None:
    assert main(argv) == 0, argv


def test_zeroshot_equals_clip_benchmark(cls_root, export_dir, tmp_path):
    theirs, ours = tmp_path / "theirs.json", tmp_path / "ours.json"
    run_cli(["eval", "clip-benchmark", "--model", export_dir, "--dataset", "wds/shapes", "--dataset_root", cls_root,
             "--task", "zeroshot_classification", "--no_amp", "true", "--batch_size", "8", "--num_workers", "0",
             "--output", str(theirs), "--quiet", "true"])
    run_cli(["eval", "zeroshot", "--model", export_dir, "--data", cls_root, "--precision", "fp32", "--batch_size",
             "8", "--workers", "0", "--format", "clip_benchmark", "--out", str(ours), "--progress", "false"])
    ref, got = json.loads(theirs.read_text()), json.loads(ours.read_text())
    assert set(ref["metrics"]) == {"acc1", "acc5", "mean_per_class_recall"}
    torch.testing.assert_close(got["metrics"], ref["metrics"], rtol=0, atol=1e-12)
    assert {k: v for k, v in got.items() if k != "metrics"} == {k: v for k, v in ref.items() if k != "metrics"}
    assert ref["dataset"] == "wds/shapes" and ref["pretrained"] == "none"
    m = ref["metrics"]
    assert 0 < m["acc1"] < m["acc5"] < 1 and m["acc1"] != m["mean_per_class_recall"]  # a result that can differ


def test_retrieval_equals_clip_benchmark(ret_root, export_dir, tmp_path):
    theirs, ours = tmp_path / "theirs.json", tmp_path / "ours.json"
    run_cli(["eval", "clip-benchmark", "--model", export_dir, "--dataset", "wds/shape_captions", "--dataset_root",
             ret_root, "--task", "zeroshot_retrieval", "--recall_k", "[1,5,10]", "--no_amp", "true", "--batch_size",
             "8", "--num_workers", "0", "--output", str(theirs), "--quiet", "true"])
    run_cli(["eval", "retrieval", "--model", export_dir, "--data", ret_root, "--recall_k", "[1,5,10]", "--precision",
             "fp32", "--batch_size", "8", "--workers", "0", "--format", "clip_benchmark", "--out", str(ours),
             "--progress", "false"])
    ref, got = json.loads(theirs.read_text()), json.loads(ours.read_text())
    assert set(ref["metrics"]) == {f"{d}_retrieval_recall@{k}" for d in ("image", "text") for k in (1, 5, 10)}
    torch.testing.assert_close(got["metrics"], ref["metrics"], rtol=0, atol=1e-6)  # theirs: float32 means
    assert {k: v for k, v in got.items() if k != "metrics"} == {k: v for k, v in ref.items() if k != "metrics"}
    m = ref["metrics"]
    assert m["image_retrieval_recall@1"] < m["image_retrieval_recall@10"] < 1 and 0 < m["text_retrieval_recall@10"] < 1


def test_accuracy_shim_equals_sklearn():
    """CLIP_benchmark's accuracy as it runs after register() (the shim where NumPy refuses its float of a (1,) array)
    against scikit-learn's top-k accuracy."""
    from clip_benchmark.metrics import zeroshot_classification
    from sklearn.metrics import top_k_accuracy_score

    register()
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(50, 7, generator=g), torch.randint(0, 7, (50,), generator=g)
    want = [top_k_accuracy_score(target.numpy(), logits.numpy(), k=k, labels=range(7)) for k in (1, 3, 5)]
    for fn in (zeroshot_classification.accuracy, _accuracy_numpy2):
        torch.testing.assert_close(fn(logits, target, topk=(1, 3, 5)), want)


def test_one_json_per_model_and_the_loader(cls_root, export_dir, ckpt_path, tmp_path, capsys):
    """Output template filled per run (a path model enters as its last part); the same weights as an export folder
    and as a Lightning .ckpt give the same record; the table holds each run. The loader CLIP_benchmark calls seeds
    random weights as diffmm's does and reads --pretrained none as no weights."""
    records = clip_benchmark(model=[export_dir, ckpt_path], dataset="wds/shapes", dataset_root=cls_root,
                             no_amp=True, batch_size=16, num_workers=0, quiet=True,
                             output=str(tmp_path / "out" / "{dataset}_{pretrained}_{model}_{language}_{task}.json"))
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["shapes_none_diffclip-tiny_en_zeroshot_classification.json",
                     "shapes_none_last.ckpt_en_zeroshot_classification.json"]
    assert [r["model"] for r in records] == [export_dir, ckpt_path]
    assert records[0]["metrics"] == records[1]["metrics"] and not math.isnan(records[0]["metrics"]["acc5"])
    assert capsys.readouterr().out.count("| wds/shapes | zeroshot_classification |") == 2

    from clip_benchmark.models import TYPE2FUNC

    register(seed=3)
    net, _, tok = TYPE2FUNC["diffmm"](model_name="CLIP-Tiny", pretrained="none", cache_dir=None, device="cpu")
    ref = load_clip("CLIP-Tiny", None, device="cpu", seed=3)[0]
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), ref.state_dict().values()))
    assert tok(["a photo"]).shape == (1, net.config.text_cfg.context_length)


def test_wds_folder_and_errors(cls_root, ret_root, export_dir, tmp_path, capsys):
    wds = read_wds_folder(cls_root)
    assert wds.name == "wds/shapes" and wds.shards.endswith("test/{0..2}.tar") and wds.classnames and wds.templates
    assert read_wds_folder(str(tmp_path)) is None
    assert main(["eval", "clip-benchmark", "--model", "DiffCLIP-Tiny", "--dataset", "wds/shapes", "--dataset_root",
                 str(tmp_path / "missing"), "--num_workers", "0", "--quiet", "true",
                 "--output", str(tmp_path / "x.json")]) == 2
    assert "nshards.txt" in capsys.readouterr().err
    # task auto on a retrieval folder: CLIP_benchmark's own assert, as one line
    assert main(["eval", "clip-benchmark", "--model", export_dir, "--dataset", "wds/shape_captions", "--dataset_root",
                 ret_root, "--num_workers", "0", "--quiet", "true", "--output", str(tmp_path / "y.json")]) == 2
    assert "Classes not specified for wds/shape_captions" in capsys.readouterr().err
