"""Zero-shot classification: exact accuracy on a hand-built model, parity with open_clip, streaming, bad input."""
from __future__ import annotations

import os
import weakref

import numpy as np
import pytest
import torch
from eval_helpers import (KeyCLIP, KeyTokenizer, code_image, known_dataset, tiny_open_clip, to_tensor_rgb,
                          write_image_folder, write_label_shard)
from idx_helpers import write_idx

from diffmm.eval.classnames import get_templates
from diffmm.eval.common import EvalError
from diffmm.eval.image_sources import IdxSource, ImageFolderSource, open_image_source
from diffmm.eval.zeroshot import build_zero_shot_classifier, evaluate_zero_shot, zero_shot

C = 10
TEMPLATES = ["a photo of {}.", "a drawing of {}.", "a sketch of {}."]
NAMES = [f"class{c}" for c in range(C)]


def expected(labels, rankings):
    conf = np.zeros((C, C), dtype=np.int64)
    for y, r in zip(labels, rankings):
        conf[y, r[0]] += 1
    return conf


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("zs")
    labels, rankings = known_dataset(C)
    write_image_folder(str(root / "folder"), labels, rankings, C)
    os.makedirs(root / "idx")
    write_idx(str(root / "idx" / "t10k-images-idx3-ubyte.gz"), np.stack([code_image(r) for r in rankings]))
    write_idx(str(root / "idx" / "t10k-labels-idx1-ubyte"), np.array(labels, dtype=np.uint8))
    write_label_shard(str(root / "a.tar"), labels[:50], rankings[:50])
    write_label_shard(str(root / "b.tar"), labels[50:], rankings[50:])
    write_label_shard(str(root / "j.tar"), labels, rankings, label_in_json=True)
    return root, labels, rankings


@pytest.mark.parametrize("kind", ["folder", "idx", "shards", "json-label"])
def test_known_accuracy(data, kind):
    root, labels, rankings = data
    spec, field = {"folder": (str(root / "folder"), "cls"), "idx": (str(root / "idx"), "cls"),
                   "shards": (str(root / "{a,b}.tar"), "cls"), "json-label": (str(root / "j.tar"), "json:label")}[kind]
    source = open_image_source(spec, to_tensor_rgb, classnames=NAMES if kind != "folder" else None,
                               label_field=field, batch_size=16, num_workers=0)
    res = zero_shot(KeyCLIP(C, len(TEMPLATES)), KeyTokenizer(["photo", "drawing", "sketch"]), source, NAMES,
                    TEMPLATES, show_progress=False)
    assert res.n == 100
    assert res.top1 == pytest.approx(0.60, abs=0) and res.top5 == pytest.approx(0.90, abs=0)
    np.testing.assert_array_equal(res.confusion, expected(labels, rankings))
    conf = expected(labels, rankings)
    assert res.per_class_accuracy == pytest.approx([conf[i, i] / conf[i].sum() for i in range(C)])
    d = res.to_dict()
    assert d["top1"] == 0.6 and d["confusion_matrix"] == conf.tolist()
    md = res.to_markdown()
    assert "| top-1 (%) | 60.00 |" in md and "| top-5 (%) | 90.00 |" in md


def test_classifier_equals_open_clip():
    import open_clip
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

    model, tok = tiny_open_clip()
    names = list(IMAGENET_CLASSNAMES[:11])
    for templates in (OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES):
        ref = open_clip.build_zero_shot_classifier(model, tok, names, templates, num_classes_per_batch=7)
        ours = build_zero_shot_classifier(model, tok, names,
                                          get_templates("openai" if len(templates) == 80 else "simple"))
        assert ours.shape == (32, 11)
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    # string templates from a file path through the same code
    ref = open_clip.build_zero_shot_classifier(model, tok, names, ["a photo of a {}.", "art of the {}."])
    torch.testing.assert_close(build_zero_shot_classifier(model, tok, names, ["a photo of a {c}.", "art of the {}."]),
                               ref, rtol=0, atol=1e-6)


def test_classifier_equals_open_clip_on_diffclip():
    diffmm = pytest.importorskip("diffmm")
    open_clip = pytest.importorskip("open_clip")
    try:
        names = [n for n in diffmm.list_models() if "tiny" in n.lower() and "diff" in n.lower()]
    except (ImportError, AttributeError, ModuleNotFoundError):
        pytest.skip("diffmm.models.clip is not there yet")
    if not names:
        pytest.skip("no tiny DiffCLIP config registered yet")
    model = diffmm.create_model(names[0]).eval()
    tok = diffmm.get_tokenizer(names[0])
    classes = ["cat", "dog", "car", "tree", "boat"]
    ref = open_clip.build_zero_shot_classifier(model, tok, classes, ["a photo of a {}.", "a {} drawing."])
    ours = build_zero_shot_classifier(model, tok, classes, ["a photo of a {}.", "a {} drawing."])
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_streams_thousands_with_progress_and_bounded_memory(capsys):
    """5000 images pass through; at most two yielded batches are alive at once; the bar reaches 5000."""
    C2, n, bs = 10, 5000, 250
    model = KeyCLIP(C2, 1)
    clf = build_zero_shot_classifier(model, KeyTokenizer(["photo"]), [f"class{c}" for c in range(C2)],
                                     ["a photo of {}."])
    alive, peak = [0], [0]

    def dec():
        alive[0] -= 1

    class Stream:
        num_samples = n
        skipped = {}

        def __iter__(self):
            rng = np.random.default_rng(0)
            for _ in range(0, n, bs):
                y = rng.integers(0, C2, bs)
                imgs = torch.full((bs, 3, 8, 8), 7 / 255)
                imgs[:, 0, 0, 0] = torch.tensor(y, dtype=torch.float32) / 255  # always right
                imgs[:, 0, 0, 1:5] = 1.0  # code 255 = none
                alive[0] += 1
                peak[0] = max(peak[0], alive[0])
                weakref.finalize(imgs, dec)
                yield imgs, torch.tensor(y)
                del imgs

    res = evaluate_zero_shot(model, clf, Stream(), show_progress=True)
    assert res.n == n and res.top1 == 1.0
    assert peak[0] <= 2, f"{peak[0]} batches alive at once: the evaluation keeps images"
    err = capsys.readouterr().err
    assert "5000/5000" in err


def test_idx_source_streams_thousands(tmp_path):
    rng = np.random.default_rng(0)
    n = 3000
    labels = rng.integers(0, C, n)
    imgs = np.stack([code_image([int(y)] + [(int(y) + 1) % C]) for y in labels])
    write_idx(str(tmp_path / "t10k-images-idx3-ubyte.gz"), imgs)
    write_idx(str(tmp_path / "t10k-labels-idx1-ubyte.gz"), labels.astype(np.uint8))
    src = IdxSource(transform=to_tensor_rgb, folder=str(tmp_path), split="test", batch_size=500, num_classes=C)
    assert src.num_samples == n
    res = zero_shot(KeyCLIP(C, 1), KeyTokenizer(["photo"]), src, NAMES, ["a photo of {}."], show_progress=False)
    assert res.n == n and res.top1 == 1.0


# ------------------------------------------------------------------------------------- bad input
def test_classnames_count_must_match_folders(data):
    root, _, _ = data
    with pytest.raises(EvalError, match=r"9 class names given but .* has 10 class subfolders"):
        ImageFolderSource(str(root / "folder"), to_tensor_rgb, classnames=NAMES[:9])


def test_labels_beyond_classnames(data):
    root, _, _ = data
    with pytest.raises(EvalError, match=r"labels go up to 9 \(10 classes\) but 8 class names"):
        open_image_source(str(root / "idx"), to_tensor_rgb, classnames=NAMES[:8], num_workers=0)
    src = open_image_source(str(root / "a.tar"), to_tensor_rgb, num_workers=0)
    with pytest.raises(EvalError, match=r"label 9 in .*a.tar is out of range for 8 class names"):
        zero_shot(KeyCLIP(8, 1), KeyTokenizer(["photo"]), src, NAMES[:8], ["a photo of {}."], show_progress=False)


def test_empty_or_bad_templates():
    model, tok = KeyCLIP(C, 1), KeyTokenizer(["photo"])
    with pytest.raises(EvalError, match="template list is empty"):
        build_zero_shot_classifier(model, tok, NAMES, [])
    with pytest.raises(EvalError, match=r"has no \{\}"):
        build_zero_shot_classifier(model, tok, NAMES, ["a photo"])


def test_template_and_classname_files(tmp_path):
    from diffmm.eval.classnames import get_classnames

    (tmp_path / "t.txt").write_text("# comment\na photo of {}.\n\n")
    assert get_templates(str(tmp_path / "t.txt")) == ["a photo of {}."]
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(EvalError, match="empty.txt: the template list is empty"):
        get_templates(str(tmp_path / "empty.txt"))
    (tmp_path / "c.json").write_text('{"groups": ["a", "b"], "templates": ["x {}"]}')
    assert get_classnames(str(tmp_path / "c.json") + ":groups") == ["a", "b"]
    with pytest.raises(EvalError, match="no key 'nope'"):
        get_classnames(str(tmp_path / "c.json") + ":nope")
    assert len(get_classnames("imagenet")) == 1000 and len(get_templates("openai")) == 80
    with pytest.raises(EvalError, match="class names file not found"):
        get_classnames(str(tmp_path / "missing.txt"))


def test_unreadable_images_are_skipped_and_counted(data, tmp_path, caplog):
    import shutil

    root, labels, rankings = data
    folder = tmp_path / "f"
    shutil.copytree(root / "folder", folder)
    (folder / "class3" / "broken.png").write_bytes(b"not a png at all")
    (folder / "class4" / "empty.jpg").write_bytes(b"")
    src = ImageFolderSource(str(folder), to_tensor_rgb, batch_size=16, num_workers=0)
    res = zero_shot(KeyCLIP(C, 1), KeyTokenizer(["photo"]), src, src.classnames, ["a photo of {}."],
                    show_progress=False)
    assert res.n == 100 and res.top1 == 0.6
    assert res.skipped == {"unreadable_image": 2}
    assert res.to_dict()["skipped"] == {"unreadable_image": 2}
    assert any("broken.png" in r.message or "empty.jpg" in r.message for r in caplog.records)


def test_autocast_path_and_pretrained_loading(tmp_path):
    """bf16 autocast (the AMP path, here on CPU) agrees with fp32; load_clip reads a saved state dict."""
    diffmm = pytest.importorskip("diffmm")
    if "DiffCLIP-Tiny" not in diffmm.list_models():
        pytest.skip("no DiffCLIP-Tiny config yet")
    from diffmm.eval.loading import load_clip

    torch.manual_seed(1)
    ref = diffmm.create_model("DiffCLIP-Tiny").eval()
    torch.save(ref.state_dict(), tmp_path / "w.pt")
    model, preprocess, tok = load_clip("DiffCLIP-Tiny", str(tmp_path / "w.pt"), device="cpu")
    names = ["cat", "dog", "car"]
    w32 = build_zero_shot_classifier(model, tok, names, "simple")
    torch.testing.assert_close(w32, build_zero_shot_classifier(ref, tok, names, "simple"))
    w16 = build_zero_shot_classifier(model, tok, names, "simple", precision="bf16")
    torch.testing.assert_close(w16, w32, atol=3e-2, rtol=0)
    from PIL import Image

    x = preprocess(Image.new("RGB", (40, 30), (200, 30, 30)))
    assert x.shape == (3, 64, 64)


class _Bar:
    """Records what a progress bar was told: its total and how far it got."""

    made: list = []

    def __init__(self, total=None, **kwargs):
        self.total, self.n = total, 0
        _Bar.made.append(self)

    def update(self, k):
        self.n += k

    def close(self):
        pass


@pytest.mark.parametrize("max_batches,total", [(None, 100), (2, 32), (50, 100)])
def test_the_progress_bar_ends_where_max_batches_stops(data, monkeypatch, max_batches, total):
    import diffmm.eval.zeroshot as zs

    root, labels, rankings = data
    monkeypatch.setattr(zs, "tqdm", _Bar)
    _Bar.made = []
    source = open_image_source(str(root / "folder"), to_tensor_rgb, batch_size=16, num_workers=0)
    res = zero_shot(KeyCLIP(C, len(TEMPLATES)), KeyTokenizer(["photo", "drawing", "sketch"]), source, NAMES,
                    TEMPLATES, max_batches=max_batches)
    assert [(b.total, b.n) for b in _Bar.made] == [(total, total)] and res.n == total


# ------------------------------------------------------------------------------------------- labels by name
def test_labels_by_class_name(data, tmp_path):
    """Shards whose labels are class names (``json:NAME`` or ``.cls``) score as those with class indices."""
    root, labels, rankings = data
    for field, in_json in (("json:label", True), ("cls", False)):
        path = write_label_shard(str(tmp_path / f"names-{in_json}.tar"), [NAMES[y] for y in labels], rankings,
                                 label_in_json=in_json)
        source = open_image_source(path, to_tensor_rgb, classnames=NAMES, label_field=field, batch_size=16,
                                   num_workers=0)
        res = zero_shot(KeyCLIP(C, 1), KeyTokenizer(["photo"]), source, NAMES, ["a photo of {}."],
                        show_progress=False)
        assert res.n == 100 and res.skipped == {}, field
        np.testing.assert_array_equal(res.confusion, expected(labels, rankings))


def test_parse_label_by_name():
    from diffmm.data.decode import class_index, parse_label

    names = class_index(["golden retriever", "cat", "Cat", "dog"])
    for value, want in (("golden_retriever", 0), ("Golden  Retriever", 0), ("DOG", 3), (2, 2), ("1", 1)):
        assert parse_label({"json": {"c": value}}, "json:c", names) == want, value
    for value, which in (("cat", "exactly one"), ("bird", "any")):  # cat and Cat match both when case is ignored
        with pytest.raises(ValueError, match=f"'{value}' is neither an integer label nor {which} of the class names"):
            parse_label({"json": {"c": value}}, "json:c", names)
    with pytest.raises(ValueError, match="'dog' is not an integer label; give the class names"):
        parse_label({"cls": b"dog\n"}, "cls")


def test_an_evaluation_that_scores_nothing_is_an_error(data, tmp_path, capsys):
    """Labels that name no class skip every sample: ``diffmm eval zeroshot`` says so in one line, exit status 2."""
    from diffmm.cli import main

    root, labels, rankings = data
    path = write_label_shard(str(tmp_path / "other.tar"), ["dog"] * 10, rankings[:10], label_in_json=True)
    source = open_image_source(path, to_tensor_rgb, classnames=NAMES, label_field="json:label", num_workers=0)
    with pytest.raises(EvalError, match=r"other.tar: no image was scored \(skipped: bad_label 10;"):
        zero_shot(KeyCLIP(C, 1), KeyTokenizer(["photo"]), source, NAMES, ["a photo of {}."], show_progress=False)
    (tmp_path / "names.txt").write_text("\n".join(NAMES) + "\n")
    rc = main(["eval", "zeroshot", "--model", "CLIP-Tiny", "--data", path, "--label_field", "json:label",
               "--classnames", str(tmp_path / "names.txt"), "--workers", "0", "--progress", "false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("diffmm eval zeroshot: error: zero-shot on ") and "bad_label 10" in err[-1]
