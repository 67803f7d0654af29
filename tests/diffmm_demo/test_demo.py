"""The demo's orchestration on tiny synthetic data: ``diffmm fit`` per model and seed with the config files (shrunk
copies of configs/), evaluation of the saved checkpoints, the report files and JSON, spread over seeds, failures.

Data and configs: ``conftest.py`` (tiny synthetic data, models shrunk to one layer and 16 px, trained for 2 steps:
the run checks the plumbing, not the learning).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

import diffmm

from diffmm_demo import run_demo
from diffmm_demo.parts import mean_over_seeds, metric
from diffmm_demo.report import aggregate, comparison_table, fmt, mean_std


def test_demo_end_to_end_writes_report(demo_data, configs, tmp_path):
    out = str(tmp_path / "report")
    rc = run_demo(out, quick=True, seeds=[0, 1], parts=["clip", "lm"], data=demo_data, clip_steps=2, lm_steps=2,
                  threads=1, workers=0, configs=configs)  # the recall part: test_demo_recall.py
    assert rc == 0
    assert os.path.isfile(os.path.join(out, "demo.log"))  # empty: no step failed
    for name in ("report.md", "results.json", "clip_loss_curves.png", "lm_loss_curves.png",
                 "lambda_per_layer.png", "needle.png", "attention/attention_0.png",
                 "runs/diff-tiny-seed1/csv/metrics.csv",
                 *[f"checkpoints/{m}-seed{s}.ckpt" for m in ("CLIP-Tiny", "DiffCLIP-Tiny", "diff-tiny")
                   for s in (0, 1)]):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["status"] == "ok" and {s["status"] for s in res["steps"]} == {"ok"}
    assert len(res["steps"]) == 2 * (1 + 2 * 2 * 5 + 2) - 2 * 2 + 1  # data, runs (CLIP: 4 evals, LM: 3), plots, lambda
    assert res["config"]["preset"] == "custom" and res["command"].startswith("python -m diffmm_demo run --out ")
    for key in ("clip", "lm"):
        p = res["parts"][key]
        base, diff = p["models"]
        assert set(p["runs"][base]) == set(p["runs"][diff]) == {"0", "1"}
        for m in p["metrics"]:
            if key == "clip" and m["key"] == "throughput":
                continue  # 72 training pairs: one batch per epoch, and the rate is measured within an epoch
            for name in (base, diff):
                assert p["summary"][name][m["key"]]["n"] == 2 and p["summary"][name][m["key"]]["std"] is not None
            assert p["paired"][diff][m["key"]]["n"] == 2
        assert "--seed_everything=1" in p["commands"][diff] and "--trainer.max_steps=2" in p["commands"][diff]
    run = res["parts"]["clip"]["runs"]["DiffCLIP-Tiny"]["0"]
    assert run["train"]["steps"] == 2 and run["train"]["lambdas"] and run["train"]["lambda_first_logged"]
    assert not res["parts"]["clip"]["runs"]["CLIP-Tiny"]["0"]["train"]["lambdas"]
    assert run["zs_group"]["classes"] == 3 and run["zs_subgroup"]["classes"] == 4
    assert run["zs_group"]["images"] == 24 and run["retrieval"]["images"] == 24
    assert run["zs_fmnist"]["classes"] == 10 and run["zs_fmnist"]["images"] == 40
    lm = res["parts"]["lm"]["runs"]["diff-tiny"]["1"]
    assert lm["val"]["nll"] > 0 and 0 <= lm["needle"]["accuracy"] <= 1
    assert lm["outliers"]["attention_logits"]["top1"] >= lm["outliers"]["attention_logits"]["median"]
    # identical budgets: both models of a pair saw the same number of steps
    assert res["parts"]["lm"]["runs"]["transformer-tiny"]["1"]["train"]["steps"] == lm["train"]["steps"]
    md = open(os.path.join(out, "report.md")).read()
    assert "CLIP-Tiny vs DiffCLIP-Tiny" in md and "transformer-tiny vs diff-tiny" in md and "**0 failed**" in md
    assert "![lambda per layer](lambda_per_layer.png)" in md and "arXiv 2410.05258" in md
    mean = res["parts"]["clip"]["summary"]["CLIP-Tiny"]["zs_group_top1"]["mean"]
    assert f"{100 * mean:.2f} ±" in md
    # a checkpoint is an ordinary diffmm fit checkpoint
    model = diffmm.load_pretrained(os.path.join(out, "checkpoints", "DiffCLIP-Tiny-seed1.ckpt"))
    assert model.config.vision_cfg.image_size == 16


def test_failed_step_is_reported_and_sets_exit_status(demo_data, configs, tmp_path, monkeypatch):
    import diffmm_demo.parts as parts

    def broken(*args, **kwargs):
        raise RuntimeError("needle exploded")

    monkeypatch.setattr(parts, "multi_needle", broken)
    out = str(tmp_path / "report")
    rc = run_demo(out, seeds=[0], parts=["lm"], data=demo_data, lm_steps=2, threads=1, workers=0, configs=configs)
    assert rc == 1
    res = json.load(open(os.path.join(out, "results.json")))
    assert res["status"] == "failed"
    status = {s["name"]: s for s in res["steps"]}
    assert status["eval needle diff-tiny seed 0"]["status"] == "failed"
    assert "needle exploded" in status["eval needle diff-tiny seed 0"]["error"]
    assert status["train diff-tiny seed 0 (2 steps)"]["status"] == "ok"
    assert status["eval val diff-tiny seed 0"]["status"] == "ok"  # the other evaluations still ran
    assert status["plot needle retrieval (lm)"]["status"] == "skipped"
    assert res["parts"]["lm"]["summary"]["diff-tiny"]["val_loss"]["n"] == 1
    md = open(os.path.join(out, "report.md")).read()
    assert "**2 failed**" in md and "needle exploded" in md  # both LMs
    assert "needle exploded" in open(os.path.join(out, "demo.log")).read()  # with its traceback


def test_missing_data_fails_with_the_install_line(tmp_path, monkeypatch):
    import diffmm_demo.run as run
    from diffmm_demo.system_data import require_debian_file

    def missing(*args, **kwargs):
        require_debian_file(str(tmp_path / "NotoColorEmoji.ttf"), "fonts-noto-color-emoji")

    monkeypatch.setattr(run, "build_emoji", missing)
    out = str(tmp_path / "report")
    assert run_demo(out, seeds=[0], parts=["clip"], data=str(tmp_path / "nodata"), threads=1) == 1
    res = json.load(open(os.path.join(out, "results.json")))
    first = res["steps"][0]
    assert first["status"] == "failed" and first["name"].startswith("data (clip)")
    assert "install the Debian package fonts-noto-color-emoji" in first["error"]
    assert {s["status"] for s in res["steps"][1:-1]} == {"skipped"}
    assert "install the Debian package fonts-noto-color-emoji" in open(os.path.join(out, "report.md")).read()


def test_ensure_data_builds_only_what_is_missing(demo_data, tmp_path, monkeypatch):
    import diffmm_demo.run as run

    calls = []
    monkeypatch.setattr(run, "build_emoji", lambda out, styles: calls.append(("emoji", tuple(styles))))
    monkeypatch.setattr(run, "build_fashion_mnist", lambda out: calls.append(("fashion",)))
    monkeypatch.setattr(run, "build_python_docs", lambda out: calls.append(("text",)))
    run.ensure_data(demo_data, ("emoji", "fashion-mnist", "python-docs"))
    assert calls == []
    shutil.copytree(demo_data, tmp_path / "data")
    os.remove(tmp_path / "data" / "emoji" / "google" / "sizes.json")
    shutil.rmtree(tmp_path / "data" / "python-docs")
    run.ensure_data(str(tmp_path / "data"), ("emoji", "python-docs"))
    assert calls == [("emoji", ("google",)), ("text",)]


def test_aggregation_wins_and_tables():
    acc = metric("acc", "accuracy %", "ev.acc", True, percent=True, chance="ev.chance")
    loss = metric("loss", "loss", "ev.loss", False, digits=3)
    part = {"models": ["base", "diff"], "metrics": [acc, loss], "runs": {
        "base": {0: {"ev": {"acc": 0.10, "loss": 2.0, "chance": 0.25}}, 1: {"ev": {"acc": 0.20, "loss": 2.0}},
                 2: {"ev": {"acc": 0.30}}},
        "diff": {0: {"ev": {"acc": 0.15, "loss": 1.5}}, 1: {"ev": {"acc": 0.25, "loss": 2.5}},
                 2: {"ev": {"acc": 0.40}}}}}
    aggregate(part)
    s = part["summary"]["base"]
    assert s["acc"]["mean"] == pytest.approx(0.2) and s["acc"]["std"] == pytest.approx(0.1) and s["loss"]["n"] == 2
    p = part["paired"]["diff"]
    assert p["acc"]["values"] == pytest.approx([0.05, 0.05, 0.10]) and p["acc"]["wins"] == 3
    assert p["loss"]["values"] == [-0.5, 0.5] and p["loss"]["wins"] == 1
    assert fmt(s["acc"], acc) == "20.00 ± 10.00" and fmt(p["acc"], acc, signed=True).startswith("+6.67 ± ")
    assert fmt(mean_std([]), acc) == "n/a" and fmt(mean_std([2.0]), loss) == "2.000"
    rows = comparison_table(part).splitlines()
    assert rows[0] == "| metric | base | diff | diff − base (paired) | diff better on | chance |"
    assert rows[2] == "| accuracy % (↑) | 20.00 ± 10.00 | 26.67 ± 12.58 | +6.67 ± 2.89 | 3/3 seeds | 25.00 |"
    assert mean_over_seeds([{"a": [1, 2], "n": "x"}, {"a": [3, 4], "n": "y"}]) == {"a": [2.0, 3.0], "n": "x"}


def test_threads_fall_back_to_one_on_a_busy_machine_and_say_so(monkeypatch, capsys):
    import diffmm_demo.run as run

    monkeypatch.setattr(run.os, "getloadavg", lambda: (2.5, 2.0, 1.0))
    assert run.torch_threads(0, 2) == 1
    assert "load average (2.5) already reaches the 2 cores" in capsys.readouterr().err
    assert run.torch_threads(2, 2) == 2 and run.torch_threads(0, 4) == 4  # chosen, or a quiet machine: all cores
    assert capsys.readouterr().err == ""


def test_bad_arguments_are_one_error():
    for kwargs in ({"parts": ["vision"]}, {"seeds": [1, 1]}, {"seeds": []}, {"holdout": "emojipedia"}):
        with pytest.raises(ValueError, match=r"^parts \[.*\] \(a subset of"):
            run_demo("unused", **kwargs)
