"""scripts/results_tables.py: regenerates the docs' result tables from the committed results, finds stale ones,
and imports a demo run without machine paths."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def rt():
    spec = importlib.util.spec_from_file_location("results_tables", os.path.join(ROOT, "scripts", "results_tables.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def tree(tmp_path, rt) -> str:
    """A copy of the docs and results the generator reads."""
    files = {rt.DOC, os.path.join(rt.DEMO_DIR, "results.json"), os.path.join(rt.DEMO_DIR, "config.json"),  # + preset
             os.path.join(rt.SCRATCH_DIR, "results.json")}
    for f in files:
        os.makedirs(tmp_path / os.path.dirname(f), exist_ok=True)
        shutil.copyfile(os.path.join(ROOT, f), tmp_path / f)
    shutil.copytree(os.path.join(ROOT, "results", "mechanism"), tmp_path / "results" / "mechanism")  # the study's runs
    return str(tmp_path)


def test_committed_docs_are_current(rt, tree):
    assert rt.check(tree) == []


def test_a_changed_number_is_stale_and_rewritten(rt, tree, capsys):
    path = os.path.join(tree, "docs", "results.md")
    with open(path) as f:
        text = f.read()
    begin = text.index("<!-- BEGIN GENERATED demo-lm")
    row = text.index("| final train loss", begin)
    tampered = text[:row] + text[row:].replace("| final train loss", "| final train loss (edited)", 1)
    with open(path, "w") as f:
        f.write(tampered)
    assert rt.check(tree) == ["docs/results.md: demo-lm"]
    assert rt.main(["--check", "--root", tree]) == 1
    assert rt.main(["--root", tree]) == 0
    with open(path) as f:
        assert f.read() == text
    assert "updated docs/results.md" in capsys.readouterr().out


def test_changed_results_change_the_tables(rt, tree):
    path = os.path.join(tree, rt.SCRATCH_DIR, "results.json")
    with open(path) as f:
        r = json.load(f)
    clip = r["parts"]["clip"]
    clip["summary"][clip["models"][0]]["train_loss"]["mean"] += 1.0
    with open(path, "w") as f:
        json.dump(r, f)
    assert rt.check(tree) == ["docs/results.md: demo-clip"]


def test_missing_markers_are_reported(rt, tree):
    path = os.path.join(tree, "docs", "results.md")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace("<!-- END GENERATED demo-lm -->", ""))
    assert "docs/results.md: no markers for section demo-lm" in rt.check(tree)


def test_import_demo_copies_results_without_machine_paths(rt, tree, tmp_path):
    run = tmp_path / "somewhere" / "report"
    (run / "attention").mkdir(parents=True)
    with open(os.path.join(ROOT, "results", "demo", "results.json")) as f:
        r = json.load(f)
    r["command"] = f"diffmm demo --quick --out {run}"
    r["config"].update(out=str(run), preset="quick")
    r["plots"] = {"clip_loss": f"{run}/clip_loss_curves.png"}
    (run / "results.json").write_text(json.dumps(r))
    (run / "report.md").write_text(f"# report\n\n![CLIP loss curves](clip_loss_curves.png)\nlog: {run}/demo.log\n")
    (run / "clip_loss_curves.png").write_bytes(b"\x89PNG fake")
    written = rt.import_demo(str(run), tree)
    assert sorted(written) == sorted(os.path.join("results", "demo", f) for f in
                                     ("results.json", "config.json", "README.md", "report.md", "clip_loss_curves.png"))
    for f in ("results.json", "config.json", "report.md"):
        text = open(os.path.join(tree, "results", "demo", f)).read()
        assert str(tmp_path) not in text, f
    got = json.load(open(os.path.join(tree, "results", "demo", "results.json")))
    assert got["command"] == "diffmm demo --quick --out results/demo" and got["config"]["out"] == "results/demo"
    assert got["plots"]["clip_loss"] == "results/demo/clip_loss_curves.png"
    cfg = json.load(open(os.path.join(tree, "results", "demo", "config.json")))
    assert cfg["preset"] == "quick" and cfg["config"]["seeds"] == r["config"]["seeds"]
    steps = ", ".join(f"{r['config']['steps'][p]} {p} steps" for p in r["config"]["parts"])
    assert f"(a smoke test: {len(r['config']['seeds'])} seed(s), {steps}" in open(
        os.path.join(tree, "results", "demo", "README.md")).read()
    assert "log: results/demo/demo.log" in open(os.path.join(tree, "results", "demo", "report.md")).read()


def test_scrub_hides_paths_outside_the_repository(rt, tree):
    text = rt.scrub(f'{{"a": "/tmp/x/y.json", "b": "{tree}/docs/results.md", "c": "/home/u/data"}}', "report", tree)
    assert text == '{"a": "<path>", "b": "docs/results.md", "c": "<path>"}'
