"""diffmm classify (per-image zero-shot labels), inline templates, unlabelled image inputs, random-weights warning."""
from __future__ import annotations

import csv
import json
import logging
import os

import numpy as np
import pytest
import torch
from eval_helpers import KeyCLIP, KeyTokenizer, RANK_WEIGHTS, code_image, known_dataset, to_tensor_rgb
from PIL import Image

import diffmm
from diffmm.cli import main as diffmm_main
from diffmm.eval.classify import classify_images
from diffmm.eval.classnames import get_templates, parse_labels
from diffmm.eval.common import EvalError
from diffmm.eval.image_sources import expand_image_inputs

C = 10
NAMES = [f"class{c}" for c in range(C)]


def _flat_folder(root, rankings) -> list[str]:
    os.makedirs(root, exist_ok=True)
    paths = []
    for i, r in enumerate(rankings):
        paths.append(os.path.join(root, f"img{i:03d}.png"))
        Image.fromarray(code_image(r)).save(paths[-1])
    return paths


def _expected_probs(ranking: list[int], scale: float = 100.0) -> np.ndarray:
    """softmax(scale * cos) of KeyCLIP's image feature against its one-template class classifiers, from scratch."""
    dim = C + 1
    f = np.zeros(dim)
    for w, c in zip(RANK_WEIGHTS, ranking):
        f[c] += w
    f /= np.linalg.norm(f)
    cols = np.zeros((dim, C))
    for c in range(C):
        cols[c, c], cols[C, c] = 1.0, 0.3
    cols /= np.linalg.norm(cols, axis=0, keepdims=True)
    z = scale * f @ cols
    e = np.exp(z - z.max())
    return e / e.sum()


def test_classify_images_exact_topk_and_probabilities(tmp_path):
    _, rankings = known_dataset(C)
    paths = _flat_folder(str(tmp_path / "flat"), rankings[:12])
    open(tmp_path / "flat" / "broken.png", "wb").write(b"not a png")
    files = expand_image_inputs([str(tmp_path / "flat")])
    assert len(files) == 13 and files == sorted(files)
    preds = classify_images(KeyCLIP(C, 1), KeyTokenizer(["photo"]), to_tensor_rgb, files, NAMES, ["a photo of {}."],
                            top_k=3, batch_size=5, num_workers=0, show_progress=False)
    assert preds.skipped == {"unreadable_image": 1} and preds.files == paths
    for path, labels, probs, ranking in zip(preds.files, preds.labels, preds.probs, rankings):
        assert labels == [f"class{c}" for c in ranking[:3]], path
        want = _expected_probs(ranking)
        np.testing.assert_allclose(probs, [want[c] for c in ranking[:3]], rtol=1e-5, atol=1e-7)
    assert preds.header() == ["path", "label_1", "prob_1", "label_2", "prob_2", "label_3", "prob_3"]


def test_image_inputs_templates_and_labels(tmp_path):
    _, rankings = known_dataset(C)
    a = _flat_folder(str(tmp_path / "a"), rankings[:3])
    b = _flat_folder(str(tmp_path / "b" / "deep"), rankings[3:5])
    got = expand_image_inputs([a[1], str(tmp_path / "a" / "*.png"), str(tmp_path / "b")])
    assert got == [a[1], a[0], a[2], *b]  # order kept, each file once
    assert expand_image_inputs([str(tmp_path / "**" / "*.png")]) == sorted(a + b)
    for bad, msg in (([str(tmp_path / "nope.png")], "no such image file, folder or pattern"),
                     ([str(tmp_path / "*.jpg")], "the pattern matches no files")):
        with pytest.raises(EvalError, match=msg):
            expand_image_inputs(bad)
    assert get_templates("a photo of a {}.") == ["a photo of a {}."]
    assert get_templates(["a {} here", "plain"]) == ["a {} here", "{}"]
    (tmp_path / "t.txt").write_text("x {}\n")
    assert get_templates(["y {}", str(tmp_path / "t.txt")]) == ["y {}", "x {}"]
    with pytest.raises(EvalError, match="has no {} .*give a built-in list"):
        get_templates("a photo")
    assert parse_labels(" cat, dog ,red car") == ["cat", "dog", "red car"]
    with pytest.raises(EvalError, match="an empty name"):
        parse_labels("cat,,dog")


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("w") / "clip_tiny.pt"
    torch.save(diffmm.create_model("CLIP-Tiny").state_dict(), path)
    return str(path)


def test_cli_classify_csv_json_and_skips(tmp_path, tiny_weights, capsys, caplog):
    rgb = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
    os.makedirs(tmp_path / "imgs" / "sub")
    for i, (name, c) in enumerate(rgb.items()):
        Image.new("RGB", (48, 40), c).save(tmp_path / "imgs" / ("sub" if i else "") / f"{name}.png")
    (tmp_path / "imgs" / "bad.jpg").write_bytes(b"")
    Image.new("RGB", (30, 30), (9, 9, 9)).save(tmp_path / "single.jpg")
    args = ["classify", "--model", "CLIP-Tiny", "--pretrained", tiny_weights, "--labels", "red,green,blue,black",
            "--templates+", "a {} square", "--templates+", "a photo of a {}.", "--top_k", "2", "--workers", "0",
            str(tmp_path / "imgs"), str(tmp_path / "single.jpg")]
    with caplog.at_level(logging.WARNING, logger="diffmm.eval"):
        assert diffmm_main([*args, "--out", str(tmp_path / "p.csv")]) == 0
    out, err = capsys.readouterr()
    assert "| path | label_1 | prob_1 | label_2 | prob_2 |" in out and "wrote" in err
    assert any("skipped 1 of 5 images (1 unreadable_image)" in r.message for r in caplog.records)
    assert not any("random weights" in r.message for r in caplog.records)
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    assert [os.path.basename(r["path"]) for r in rows] == ["red.png", "blue.png", "green.png", "single.jpg"]
    # the probabilities are the model's own: recompute one row through the Python API
    model, _, preprocess = diffmm.create_model_and_transforms("CLIP-Tiny", tiny_weights)
    model.eval()
    from diffmm.eval.zeroshot import build_zero_shot_classifier

    clf = build_zero_shot_classifier(model, diffmm.get_tokenizer(model), ["red", "green", "blue", "black"],
                                     ["a {} square", "a photo of a {}."])
    with torch.no_grad():
        img = model.encode_image(preprocess(Image.open(rows[0]["path"]))[None], normalize=True)
        probs = (model.logit_scale_value() * img @ clf).softmax(-1)[0]
    top = probs.topk(2)
    assert [rows[0]["label_1"], rows[0]["label_2"]] == [["red", "green", "blue", "black"][i] for i in top.indices]
    np.testing.assert_allclose([float(rows[0]["prob_1"]), float(rows[0]["prob_2"])], top.values.numpy(), atol=2e-6)
    assert diffmm_main([*args, "--out", str(tmp_path / "p.json"), "--progress", "false"]) == 0
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["n"] == 4 and res["skipped"] == {"unreadable_image": 1} and res["top_k"] == 2
    assert res["templates"] == ["a {} square", "a photo of a {}."]
    assert [p["labels"][0] for p in res["predictions"]] == [r["label_1"] for r in rows]


def test_cli_classify_errors_and_random_weight_warning(tmp_path, capsys, caplog):
    Image.new("RGB", (20, 20), (1, 2, 3)).save(tmp_path / "x.png")
    (tmp_path / "bad.png").write_bytes(b"")
    base = ["classify", "--model", "CLIP-Tiny", "--workers", "0", "--progress", "false"]
    cases = [([*base, "--labels", "a,b", str(tmp_path / "nope.png")], "no such image file, folder or pattern"),
             ([*base, "--labels", "a,b", "--out", "p.txt", str(tmp_path / "x.png")], "expected a .csv or .json"),
             ([*base, "--labels", "a,,b", str(tmp_path / "x.png")], "an empty name"),
             ([*base, "--labels", "a,b", "--templates", "no slot", str(tmp_path / "x.png")], "has no {}"),
             ([*base, "--labels", "a,b", str(tmp_path / "bad.png")], "none of the 1 images could be read"),
             (["classify", "--model", "ViT-B-32", "--labels", "a", str(tmp_path / "x.png")],
              "did you mean open_clip:ViT-B-32"),
             ([*base, str(tmp_path / "x.png")], "give one of --labels or --classnames"),
             ([*base, "--labels", "a,b", "--top_k", "0", str(tmp_path / "x.png")], "--top_k 0: expected a positive")]
    for argv, msg in cases:
        assert diffmm_main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("diffmm classify: error:") and msg in err[-1], (argv, err)
    with caplog.at_level(logging.WARNING, logger="diffmm.eval"):
        assert diffmm_main([*base, "--labels", "a,b", str(tmp_path / "x.png")]) == 0
    assert any("'CLIP-Tiny' has random weights" in r.message for r in caplog.records)


def test_zeroshot_inline_templates_and_unlabelled_inputs(tmp_path, tiny_weights, capsys):
    _, rankings = known_dataset(C)
    flat = tmp_path / "flat"
    _flat_folder(str(flat), rankings[:4])
    for spec in (str(flat), str(flat / "*.png")):
        assert diffmm_main(["eval", "zeroshot", "--model", "CLIP-Tiny", "--pretrained", tiny_weights, "--data", spec,
                            "--workers", "0"]) == 2
        err = capsys.readouterr().err
        assert "has no labels" in err and "diffmm classify" in err
    labelled = tmp_path / "lab"
    for c in ("cat", "dog"):
        os.makedirs(labelled / c)
        Image.new("RGB", (16, 16), (5, 5, 5)).save(labelled / c / "0.png")
    assert diffmm_main(["eval", "zeroshot", "--model", "CLIP-Tiny", "--pretrained", tiny_weights, "--data",
                        str(labelled), "--templates+", "a silhouette of a {}", "--templates+", "openai", "--workers",
                        "0", "--progress", "false", "--out", str(tmp_path / "z.json")]) == 0
    assert json.loads((tmp_path / "z.json").read_text())["n"] == 2
