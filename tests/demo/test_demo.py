"""The demo's orchestration on tiny synthetic data: report files, JSON fields, spread over seeds, failures.

The synthetic emoji shards are written directly; Fashion-MNIST and the text corpus go through the
real demo builders (``diffmm.data``) on small synthetic sources. Models are the Tiny configs shrunk
to one layer and 16 px, trained for 2 steps: the run checks the plumbing, not the learning.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import random
import shutil
import struct
import sys

import numpy as np
import pytest
from PIL import Image

from diffmm.data.writer import ShardWriter
from diffmm.demo import DemoConfig, run_demo
from diffmm.demo.summary import CLIP_METRICS, LM_METRICS, Metric, fmt, fmt_delta, mean_std, paired, summarize

GROUPS = ["Smileys & Emotion", "Animals & Nature", "Flags"]
SUBGROUPS = ["face-smiling", "animal-mammal", "animal-bird", "country-flag"]
SUB_TO_GROUP = [0, 1, 1, 2]
WORDS = ("python module function class method value list string file object return import error "
         "the a of to is in and for with as by on this that be are can it from").split()


def _emoji_style(root: str, style: str, n: int, seed: int) -> None:
    rng = random.Random(0)  # the same emoji (names, labels) in every style; the art differs by `seed`
    art = np.random.default_rng(seed)
    with ShardWriter(os.path.join(root, style), f"emoji-{style}", maxcount=16) as w:
        for i in range(n):
            sub = rng.randrange(len(SUBGROUPS))
            img = Image.fromarray(art.integers(0, 255, (20, 20, 3), dtype=np.uint8))
            buf = io.BytesIO()
            img.save(buf, "PNG")
            name = f"{SUBGROUPS[sub].replace('-', ' ')} {i}"
            meta = {"name": name, "group_id": SUB_TO_GROUP[sub], "subgroup_id": sub, "style": style}
            w.write(f"e{i:04d}", {"png": buf.getvalue(), "txt": f"an emoji of {name}, {WORDS[i % len(WORDS)]}",
                                  "json": json.dumps(meta)})


def _write_idx(path: str, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> str:
    from diffmm.demo.datasets import build_fashion_mnist, build_python_docs

    root = tmp_path_factory.mktemp("demo")
    data = str(root / "data")
    emoji = os.path.join(data, "emoji")
    for k, style in enumerate(("s1", "s2", "held")):
        _emoji_style(emoji, style, 24, seed=k)
    with open(os.path.join(emoji, "classes.json"), "w") as f:
        json.dump({"groups": GROUPS, "subgroups": SUBGROUPS, "templates": ["an emoji of {}."]}, f)
    idx = root / "idx"
    idx.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 20), ("t10k", 40)):
        _write_idx(str(idx / f"{prefix}-images-idx3-ubyte.gz"), rng.integers(0, 255, (n, 28, 28)))
        _write_idx(str(idx / f"{prefix}-labels-idx1-ubyte.gz"), np.arange(n) % 10)
    build_fashion_mnist(data, source_dir=str(idx), progress=False)
    src = root / "_sources"
    (src / "library").mkdir(parents=True)
    wr = random.Random(0)
    for i in range(24):
        text = "\n\n".join(" ".join(wr.choice(WORDS) for _ in range(wr.randint(3, 6))).capitalize() + "." for _ in range(60))
        (src / "library" / f"mod{i}.rst.txt").write_text(f"Module {i}\n========\n\n{text}\n")
    build_python_docs(data, source_dir=str(src), vocab_size=320, val_every=4, progress=False)
    return data


def _tiny_config(data: str, out: str, **changes) -> DemoConfig:
    cfg = DemoConfig(
        out=out, data=data, seeds=(0, 1), threads=1, num_workers=0,
        clip_model_kwargs=dict(embed_dim=16, vision_cfg=dict(image_size=16, patch_size=8, width=32, layers=1,
                                                             head_width=16),
                               text_cfg=dict(context_length=16, width=32, heads=2, layers=1)),
        train_styles=("s1", "s2"), holdout_style="held", clip_steps=2, clip_batch=8, clip_warmup=1, zs_batch=16,
        fmnist_images=32, holdout_images=None, attention_images=1,
        lm_model_kwargs=dict(n_layer=1, n_embd=32, n_head=2, block_size=128), lm_steps=2, lm_batch=4, lm_warmup=1,
        lm_val_batches=2, needle_needles=1, needle_queried=1, needle_depths=(0.0, 1.0), needle_trials=1,
        needle_digits=2, outlier_batches=1, log_every=1)
    return cfg.replace(**changes)


def test_demo_end_to_end_writes_report(demo_data, tmp_path):
    out = str(tmp_path / "report")
    rc = run_demo(_tiny_config(demo_data, out, parts=("clip", "lm")), command="test")  # recall: test_demo_recall.py
    assert rc == 0
    for name in ("report.md", "results.json", "demo.log", "clip_loss_curves.png", "lm_loss_curves.png",
                 "lambda_per_layer.png", "needle.png", os.path.join("attention", "attention_0.png")):
        path = os.path.join(out, name)
        assert os.path.isfile(path) and os.path.getsize(path) > 0, name
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["status"] == "ok"
    assert {s["status"] for s in res["steps"]} == {"ok"}
    assert len(res["steps"]) == 2 + 2 * 2 * 5 + 2 + 1 + 2 * 2 * 4 + 2 + 1  # data, runs, plots, haystack, lambda
    for part, metrics in (("clip", CLIP_METRICS), ("lm", LM_METRICS)):
        p = res[part]
        base, diff = p["models"]["baseline"], p["models"]["differential"]
        assert set(p["runs"][base]) == set(p["runs"][diff]) == {"0", "1"}
        for name in (base, diff):
            for m in metrics:
                s = p["summary"][name][m.key]
                assert s["n"] == 2 and s["std"] is not None, (part, name, m.key)
        for m in metrics:
            assert p["paired"][m.key]["n"] == 2
    run = res["clip"]["runs"]["DiffCLIP-Tiny"]["0"]
    assert run["train"]["steps"] == 2 and run["train"]["lambdas"]  # differential layers report lambda
    assert not res["clip"]["runs"]["CLIP-Tiny"]["0"]["train"]["lambdas"]
    assert run["zs_group"]["classes"] == 3 and run["zs_subgroup"]["classes"] == 4
    assert run["zs_group"]["images"] == 24 and run["retrieval"]["images"] == 24
    assert run["zs_fmnist"]["classes"] == 10 and run["zs_fmnist"]["images"] == 32
    lm = res["lm"]["runs"]["diff-tiny"]["1"]
    assert lm["val"]["val_loss"] > 0 and 0 <= lm["needle"]["accuracy"] <= 1
    assert lm["outliers"]["attention_logits_top1"] >= lm["outliers"]["attention_logits_median"]
    # identical budgets: both models of a pair saw the same number of steps
    assert res["lm"]["runs"]["transformer-tiny"]["1"]["train"]["steps"] == lm["train"]["steps"]
    md = open(os.path.join(out, "report.md")).read()
    assert "CLIP-Tiny vs DiffCLIP-Tiny" in md and "transformer-tiny vs diff-tiny" in md
    assert "**0 failed**" in md and "![lambda per layer](lambda_per_layer.png)" in md
    mean = res["clip"]["summary"]["CLIP-Tiny"]["zs_group_top1"]["mean"]
    assert f"{100 * mean:.2f} ±" in md
    # the report can be re-rendered from results.json, also after the folder was moved
    from diffmm.demo.cli import main

    moved = str(tmp_path / "moved")
    shutil.copytree(out, moved)
    os.remove(os.path.join(moved, "report.md"))
    assert main(["--render-only", "--out", moved]) == 0
    assert open(os.path.join(moved, "report.md")).read() == md


def test_failed_step_is_reported_and_sets_exit_status(demo_data, tmp_path, monkeypatch):
    import diffmm.demo.evaluate as ev

    def broken(*args, **kwargs):
        raise RuntimeError("needle exploded")

    monkeypatch.setattr(ev, "needle", broken)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: Lightning's own progress bar
    out = str(tmp_path / "report")
    rc = run_demo(_tiny_config(demo_data, out, parts=("lm",), seeds=(0,)), command="test")
    assert rc == 1
    res = json.load(open(os.path.join(out, "results.json")))
    assert res["status"] == "failed"
    status = {s["name"]: s for s in res["steps"]}
    assert status["eval needle diff-tiny seed 0"]["status"] == "failed"
    assert "needle exploded" in status["eval needle diff-tiny seed 0"]["error"]
    assert status["train diff-tiny seed 0 (2 steps x 4 rows)"]["status"] == "ok"
    assert status["eval val diff-tiny seed 0"]["status"] == "ok"  # the other evaluations still ran
    assert status["plot needle retrieval"]["status"] == "skipped"
    assert res["lm"]["summary"]["diff-tiny"]["val_loss"]["n"] == 1
    md = open(os.path.join(out, "report.md")).read()
    assert "**2 failed**" in md and "needle exploded" in md  # both LMs
    assert "needle exploded" in open(os.path.join(out, "demo.log")).read()  # with its traceback


def test_missing_data_fails_with_the_install_line(tmp_path, monkeypatch):
    import diffmm.demo.data as builders
    from diffmm.data.system_data import require_debian_file

    def missing(*args, **kwargs):
        require_debian_file(str(tmp_path / "NotoColorEmoji.ttf"), "fonts-noto-color-emoji")

    monkeypatch.setattr(builders, "build_emoji", missing)
    out = str(tmp_path / "report")
    rc = run_demo(_tiny_config(str(tmp_path / "nodata"), out, parts=("clip",), seeds=(0,)), command="test")
    assert rc == 1
    res = json.load(open(os.path.join(out, "results.json")))
    first = res["steps"][0]
    assert first["status"] == "failed" and first["name"].startswith("data (clip)")
    assert "install the Debian package fonts-noto-color-emoji" in first["error"]
    assert all(s["status"] == "skipped" for s in res["steps"][1:])
    assert "install the Debian package fonts-noto-color-emoji" in open(os.path.join(out, "report.md")).read()


def test_ensure_demo_data_builds_only_what_is_missing(demo_data, tmp_path, monkeypatch):
    import diffmm.demo.data as builders
    from diffmm.demo.data import ensure_demo_data

    calls = []
    monkeypatch.setattr(builders, "build_emoji", lambda out, styles: calls.append(("emoji", tuple(styles))))
    monkeypatch.setattr(builders, "build_fashion_mnist", lambda out: calls.append(("fashion",)))
    monkeypatch.setattr(builders, "build_python_docs", lambda out: calls.append(("text",)))
    assert ensure_demo_data(demo_data, ("clip", "lm"), ("s1", "s2", "held")) == {}
    assert calls == []
    ensure_demo_data(demo_data, ("clip",), ("s1", "other"))
    assert calls == [("emoji", ("other",))]
    calls.clear()
    ensure_demo_data(str(tmp_path), ("clip", "lm"), ("s1",))
    assert calls == [("emoji", ("s1",)), ("fashion",), ("text",)]


def test_summary_statistics_and_verdicts():
    m = Metric("acc", "accuracy", ("ev", "acc"), True, percent=True)
    lo = Metric("loss", "loss", ("ev", "loss"), False, digits=3)
    base = {0: {"ev": {"acc": 0.10, "loss": 2.0}}, 1: {"ev": {"acc": 0.20, "loss": 2.0}}, 2: {"ev": {"acc": 0.30}}}
    diff = {0: {"ev": {"acc": 0.15, "loss": 1.5}}, 1: {"ev": {"acc": 0.25, "loss": 2.5}}, 2: {"ev": {"acc": 0.40}}}
    s = summarize(base, [m, lo])
    assert s["acc"]["mean"] == pytest.approx(0.2) and s["acc"]["std"] == pytest.approx(0.1)
    assert s["loss"]["n"] == 2 and s["loss"]["seeds"] == [0, 1]
    p = paired(base, diff, [m, lo])
    assert p["acc"]["values"] == pytest.approx([0.05, 0.05, 0.10])
    assert p["acc"]["wins"] == 3 and p["acc"]["verdict"] == "differential"
    assert p["loss"]["wins"] == 1 and p["loss"]["verdict"] == "mixed"
    assert paired({0: {"ev": {"acc": 0.3}}}, {0: {"ev": {"acc": 0.1}}}, [m])["acc"]["verdict"] == "baseline"
    assert fmt(s["acc"], m) == "20.00 ± 10.00" and fmt_delta(p["acc"], m).startswith("+6.67 ± ")
    assert fmt(mean_std([]), m) == "n/a" and mean_std([1.0])["std"] is None
    assert fmt(mean_std([2.0]), lo) == "2.000"


def test_config_and_cli_arguments():
    from diffmm.demo.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["--quick", "--seeds", "3,4", "--lm-steps", "30",
                                                      "--holdout", "openmoji", "--parts", "lm"]))
    assert cfg.seeds == (3, 4) and cfg.lm_steps == 30 and cfg.lm_warmup == 3 and cfg.parts == ("lm",)
    assert cfg.holdout_style == "openmoji" and "openmoji" not in cfg.train_styles
    full = config_from_args(build_parser().parse_args([]))
    assert len(full.seeds) >= 3 and full.clip_steps > cfg.clip_steps
    with pytest.raises(ValueError, match="held-out style"):
        DemoConfig(train_styles=("noto", "twitter"), holdout_style="twitter")
    with pytest.raises(ValueError, match="seeds repeat"):
        DemoConfig(seeds=(1, 1))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--parts", "vision"])
