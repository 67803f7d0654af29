"""studies/mechanism/analyze.py: paired statistics and the verdict rules stated before the runs."""
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "studies", "mechanism"))
analyze = pytest.importorskip("analyze")


def _arm(values: dict[str, list[float]]) -> dict[int, dict]:
    n = len(next(iter(values.values())))
    return {s: {k: v[s] for k, v in values.items()} for s in range(n)}


def test_paired_matches_a_hand_computation():
    a = _arm({"x": [3.0, 5.0, 4.0, 6.0]})
    b = _arm({"x": [1.0, 2.0, 3.0, 3.0]})
    d = analyze.paired(a, b, "x")
    diffs = np.array([2.0, 3.0, 1.0, 3.0])
    t = diffs.mean() / (diffs.std(ddof=1) / np.sqrt(4))
    from scipy import stats
    assert d["mean"] == pytest.approx(2.25) and d["std"] == pytest.approx(diffs.std(ddof=1))
    assert d["p"] == pytest.approx(2 * stats.t.sf(abs(t), 3))
    assert (d["positive"], d["ge2"], d["n"]) == (4, 3, 4)


def _arms(b_minus_c: list[float], share_b_minus_c: list[float]) -> dict:
    base = [30.0, 31.0, 29.0, 32.0, 30.5, 31.5]
    steps = {f"group@{s}": base for s in analyze.STEPS}
    a = _arm({**steps, "share": [80.0] * 6})
    c = _arm({**steps, "share": [80.0] * 6})
    b = _arm({**{k: [x + d for x, d in zip(v, b_minus_c)] for k, v in steps.items()},
              "share": [80.0 + d for d in share_b_minus_c]})
    return {"A": a, "B": b, "C": c}


def test_verdict_support_against_and_inconclusive():
    v = analyze.verdict(_arms([2.5, 3.0, 2.2, 2.8, 2.1, 1.0], [1, 2, 3, 1, 2, 1]))
    assert v["subtraction_helps"] and not v["against"]
    v = analyze.verdict(_arms([2.5, 3.0, 2.2, 2.8, 2.1, 1.0], [-1, -2, -3, -1, -2, -1]))  # less mass on the subject
    assert not v["subtraction_helps"] and v["text"].startswith("inconclusive")
    v = analyze.verdict(_arms([0.2, -0.3, 0.5, 0.1, -0.2, 0.4], [1] * 6))
    assert v["against"] and not v["subtraction_helps"]


def test_committed_tables_render():
    for name, render in analyze.SECTIONS.items():
        text = render(ROOT)
        assert text.startswith("|"), name  # every section has its runs committed
