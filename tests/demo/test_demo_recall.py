"""The demo's recall section: every (seed, attention type) run, the aggregate, the plot and the report section."""
from __future__ import annotations

import json
import os

from diffmm.demo import DemoConfig, run_demo
from diffmm.demo.pipeline import planned_steps


def test_demo_recall_section(tmp_path):
    out = str(tmp_path / "report")
    cfg = DemoConfig(out=out, data=str(tmp_path / "nodata"), parts=("recall",), seeds=(0, 1), threads=1,
                     recall_width=16, recall_heads=2, recall_layers=1, recall_vocab=16,
                     recall_train_seq_lens=(8,), recall_train_pairs=(2,), recall_eval_seq_lens=(8, 16),
                     recall_eval_pairs=(2,), recall_steps=3, recall_batch_tokens=64, recall_examples=4)
    assert planned_steps(cfg) == 2 * 3 + 1
    assert run_demo(cfg, command="test") == 0
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["status"] == "ok" and len(res["steps"]) == 7
    part = res["recall"]
    assert set(part["runs"]) == {"standard", "diff", "diff_v2"}
    assert all(set(r) == {"0", "1"} for r in part["runs"].values())
    run = part["runs"]["diff_v2"]["1"]
    assert run["train"]["steps"] == 3 and set(run["eval"]["accuracy_by_task"]) == {"L8-N2", "L16-N2"}
    w = part["aggregate"]["widths"]["16"]
    assert w["summary"]["diff"]["accuracy"]["n"] == 2 and set(w["paired"]) == {
        "diff - standard", "diff_v2 - standard", "diff_v2 - diff"}
    # parameter-matched: the three models are within one SwiGLU hidden unit per layer of each other
    totals = [w["params"][v]["total"] for v in ("standard", "diff", "diff_v2")]
    assert max(totals) - min(totals) <= 3 * 16
    assert os.path.getsize(os.path.join(out, "recall.png")) > 0
    md = open(os.path.join(out, "report.md")).read()
    assert "## Associative recall (MQAR)" in md and "DIFF V2 − Transformer" in md and "![recall" in md
    assert "Lambda per layer" not in md  # no CLIP / LM part ran
