"""The demo's recall part: Transformer vs DIFF V1 vs DIFF V2 trained with the recall configs, scored by
``evaluate_recall``, compared in the report."""
from __future__ import annotations

import json
import os

from diffmm_demo import run_demo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_recall_part(tmp_path):
    out = str(tmp_path / "report")
    assert run_demo(out, quick=True, seeds=[0, 1], parts=["recall"], data=str(tmp_path / "nodata"), recall_steps=3,
                    threads=1, workers=0) == 0
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["status"] == "ok" and len(res["steps"]) == 2 * 3 * 2 + 2 + 1  # no data step
    part = res["parts"]["recall"]
    assert part["models"] == ["Transformer", "DIFF V1", "DIFF V2"]
    assert all(set(r) == {"0", "1"} for r in part["runs"].values())
    run = part["runs"]["DIFF V2"]["1"]
    assert run["train"]["steps"] == 3 and set(run["recall"]["accuracy_by_task"]) == {"L16-N2", "L16-N4", "L64-N2",
                                                                                     "L64-N4"}
    assert part["summary"]["DIFF V1"]["accuracy"]["n"] == 2 and set(part["paired"]) == {"DIFF V1", "DIFF V2"}
    # the configs' models are parameter-matched: within 0.2 % of the Transformer's count
    params = [part["summary"][x]["params"]["mean"] for x in part["models"]]
    assert all(abs(p - params[0]) <= 0.002 * params[0] for p in params)
    assert os.path.getsize(os.path.join(out, "recall.png")) > 0
    md = open(os.path.join(out, "report.md")).read()
    assert "## Associative recall (MQAR)" in md and "DIFF V2 − Transformer (paired)" in md and "![recall" in md
    assert "| recall accuracy L16-N2 % (↑) |" in md and "| 50.0 |" in md  # chance 1/N beside the setting
    assert "![lambda per layer](lambda_per_layer.png)" in md  # DIFF V1's layers
