"""Pictures and the ``diffmm eval`` command line (end to end on tiny inputs; bad input gives one-line errors)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from eval_helpers import known_dataset, write_image_folder
from PIL import Image

from diffmm.cli import main
from diffmm.eval.plots import cls_attention, plot_attention_maps, plot_loss_curves, plot_needle_attention


def _png_ok(path):
    assert os.path.isfile(path) and os.path.getsize(path) > 5000
    with Image.open(path) as im:
        assert im.format == "PNG" and min(im.size) > 200


def test_cls_attention_shapes_and_diff_sign(tmp_path):
    diffmm = pytest.importorskip("diffmm")
    if "DiffCLIP-Tiny" not in diffmm.list_models():
        pytest.skip("no DiffCLIP-Tiny config yet")
    x = torch.randn(3, 64, 64)
    entries = {}
    for name in ("CLIP-Tiny", "DiffCLIP-Tiny"):
        model = diffmm.create_model(name).eval()
        e = cls_attention(model, x)
        g = 64 // model.config.vision_cfg.patch_size
        assert e["heads"].shape[1:] == (g, g) and e["mean"].shape == (g, g)
        entries[name] = e
    assert entries["CLIP-Tiny"]["kind"] == "standard" and entries["DiffCLIP-Tiny"]["kind"] == "diff"
    assert float(entries["CLIP-Tiny"]["heads"].min()) >= 0  # softmax rows
    out = plot_attention_maps(x, entries, str(tmp_path / "att.png"))
    _png_ok(out)


def test_needle_and_loss_plots(tmp_path):
    _png_ok(plot_needle_attention({"DIFF": {"attention": {0.0: 0.6, 0.5: 0.4}, "accuracy": {0.0: 1.0, 0.5: 0.5}},
                                   "Transformer": {"attention": {0.0: 0.2, 0.5: 0.1}}}, str(tmp_path / "n.png")))
    csv = tmp_path / "metrics.csv"
    rows = ["epoch,step,train/loss,val/loss"] + [f"0,{s},{3 - s / 50:.3f}," for s in range(0, 100, 5)]
    rows += ["0,99,,2.1", "1,199,,1.9"]
    csv.write_text("\n".join(rows) + "\n")
    out = plot_loss_curves({"diff": str(tmp_path), "std": str(csv)}, str(tmp_path / "loss.png"))
    _png_ok(out)


def test_cli_zeroshot_end_to_end(tmp_path, capsys):
    labels, rankings = known_dataset(10)
    root = write_image_folder(str(tmp_path / "imgs"), labels[:20], rankings[:20], 10, prefix="item ")
    rc = main(["eval", "zeroshot", "--model", "CLIP-Tiny", "--data", root, "--batch_size",
               "8", "--workers", "0", "--templates", "plain", "--out", str(tmp_path / "r.json"), "--md",
               str(tmp_path / "r.md"), "--progress", "false"])
    assert rc == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["n"] == 20 and len(res["confusion_matrix"]) == 10 and res["classnames"][0] == "item 0"
    assert "| top-1 (%) |" in (tmp_path / "r.md").read_text()


def test_cli_bad_input_one_line_errors(tmp_path, capsys):
    labels, rankings = known_dataset(10)
    root = write_image_folder(str(tmp_path / "imgs"), labels[:20], rankings[:20], 10)
    (tmp_path / "names.txt").write_text("a\nb\nc\n")
    (tmp_path / "empty.txt").write_text("\n")
    cases = [
        (["--classnames", str(tmp_path / "names.txt")], "3 class names given but"),
        (["--templates", str(tmp_path / "empty.txt")], "the template list is empty"),
        (["--classnames", str(tmp_path / "nope.txt")], "class names file not found"),
    ]
    for extra, msg in cases:
        rc = main(["eval", "zeroshot", "--model", "CLIP-Tiny", "--data", root, "--workers", "0", "--progress", "false",
                   *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and msg in err[-1] and err[-1].startswith("diffmm eval zeroshot: error:")
    rc = main(["eval", "zeroshot", "--model", "No-Such-Model", "--data", root])
    assert rc == 2 and "unknown model 'No-Such-Model'" in capsys.readouterr().err
    # a bad flag value: one line naming the flag, and the help that lists the flags
    rc = main(["eval", "zeroshot", "--model", "CLIP-Tiny", "--data", root, "--batch_size", "many"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("diffmm eval zeroshot: error: --batch_size:"), err
    assert main(["eval", "zeroshot", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--label_field" in out and "the IDX or wds split: train or test" in out
    assert "show a progress bar" in out  # the shared options are documented too


def test_cli_plot_loss_and_lm_tasks(tmp_path, capsys):
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,train/loss\n" + "\n".join(f"{s},{5 - s / 10}" for s in range(10)) + "\n")
    assert main(["eval", "plot-loss", "--run+", f"a={csv}", "--out", str(tmp_path / "l.png")]) == 0
    _png_ok(str(tmp_path / "l.png"))
    # ICL on a random tiny DiffLM with the CLIP BPE: runs end to end and writes JSON
    data = tmp_path / "cls.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"{w} {w}", "label": lab}) for lab, ws in
                              (("good", ["sun", "joy", "cake", "gift"]), ("bad", ["rain", "mud", "pain", "loss"]))
                              for w in ws) + "\n")
    rc = main(["eval", "icl", "--lm", "config:diff-tiny", "--train", str(data), "--test", str(data), "--shots", "2",
               "--orders", "2", "--progress", "false", "--out", str(tmp_path / "icl.json")])
    assert rc == 0
    res = json.loads((tmp_path / "icl.json").read_text())
    assert len(res["accuracies"]) == 2 and 0 <= res["mean"] <= 1
