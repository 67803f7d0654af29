"""Escape times as survival data: Kaplan-Meier curves, medians and log-rank tests over the MQAR run JSONs.

A run "survives" while it is still on the plateau; its event is the escape step, and a run that never escaped is
censored at its ``max_steps``. Used by :mod:`mqar` (``--summarize``); needs numpy, scipy and matplotlib.
The curve and the log-rank p agree with ``scipy.stats.ecdf`` / ``scipy.stats.logrank`` on censored data.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Optional

import numpy as np
from scipy.stats import chi2


def times_events(runs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(time, escaped) per run: the escape step, or max_steps (censored) when the run never escaped."""
    t = np.array([r["escape_step"] if r["escape_step"] is not None else r["max_steps"] for r in runs], float)
    e = np.array([r["escape_step"] is not None for r in runs], bool)
    return t, e


def kaplan_meier(t: np.ndarray, e: np.ndarray) -> tuple[list[float], list[float]]:
    """The Kaplan-Meier step curve: (steps, fraction not yet escaped), starting at (0, 1.0)."""
    steps, surv, s = [0.0], [1.0], 1.0
    for u in np.unique(t[e]):
        at_risk = int(np.sum(t >= u))
        s *= 1.0 - int(np.sum((t == u) & e)) / at_risk
        steps.append(float(u))
        surv.append(s)
    return steps, surv


def km_median(steps: list[float], surv: list[float]) -> Optional[float]:
    """The first step at which the survival curve is at or below 0.5; None when it never gets there."""
    return next((st for st, s in zip(steps, surv) if s <= 0.5), None)


def logrank_p(t1: np.ndarray, e1: np.ndarray, t2: np.ndarray, e2: np.ndarray) -> Optional[float]:
    """Two-sided log-rank test (chi-square, 1 df) of two groups' escape times; None without any event."""
    t, e = np.concatenate([t1, t2]), np.concatenate([e1, e2])
    in1 = np.concatenate([np.ones(len(t1), bool), np.zeros(len(t2), bool)])
    observed_minus_expected, variance = 0.0, 0.0
    for u in np.unique(t[e]):
        at_risk = t >= u
        n, n1 = int(at_risk.sum()), int((at_risk & in1).sum())
        d, d1 = int(((t == u) & e).sum()), int(((t == u) & e & in1).sum())
        observed_minus_expected += d1 - d * n1 / n
        if n > 1:
            variance += d * (n1 / n) * (1 - n1 / n) * (n - d) / (n - 1)
    if variance == 0:
        return None
    return float(chi2.sf(observed_minus_expected ** 2 / variance, 1))


def load_runs(folder: str) -> dict[str, list[dict]]:
    """The run JSONs of a folder, grouped by cell, each group sorted by seed."""
    cells: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*-s*.json"))):
        with open(path) as f:
            run = json.load(f)
        cells.setdefault(run["cell"], []).append(run)
    return {c: sorted(rs, key=lambda r: r["seed"]) for c, rs in cells.items()}


def summarize(cells: dict[str, list[dict]], reference: str) -> dict:
    """Per cell: runs, escaped, KM median, mean ± std among escaped, the KM curve, log-rank p against ``reference``."""
    out = {}
    for cell, runs in cells.items():
        t, e = times_events(runs)
        steps, surv = kaplan_meier(t, e)
        hit = t[e]
        row = {"runs": len(runs), "escaped": int(e.sum()), "seeds": [r["seed"] for r in runs],
               "escape_steps": [r["escape_step"] for r in runs], "max_steps": sorted({r["max_steps"] for r in runs}),
               "km_median": km_median(steps, surv),
               "escaped_mean": float(hit.mean()) if len(hit) else None,
               "escaped_std": float(hit.std(ddof=1)) if len(hit) > 1 else None,
               "km_curve": {"steps": steps, "not_escaped": surv},
               "train_seconds_mean": float(np.mean([r["train_seconds"] for r in runs]))}
        if reference in cells and cell != reference:
            row["logrank_p_vs_reference"] = logrank_p(*times_events(cells[reference]), t, e)
        out[cell] = row
    return {"reference": reference, "cells": out}


def table(summary: dict) -> str:
    """Markdown: one row per cell."""
    def num(x, fmt="{:.0f}"):
        return "-" if x is None else fmt.format(x)

    rows = ["| cell | escaped / runs | KM median step | mean ± std (escaped) | log-rank p vs "
            f"{summary['reference']} | escape step per seed |", "|---|---|---|---|---|---|"]
    for cell, r in summary["cells"].items():
        steps = ", ".join("-" if s is None else str(s) for s in r["escape_steps"])
        rows.append(f"| {cell} | {r['escaped']}/{r['runs']} | {num(r['km_median'])} | {num(r['escaped_mean'])} ± "
                    f"{num(r['escaped_std'])} | {num(r.get('logrank_p_vs_reference'), '{:.3g}')} | {steps} |")
    return "\n".join(rows) + "\n"


def plot(summary: dict, path: str) -> None:
    """One Kaplan-Meier step curve per cell (fraction of runs not yet escaped vs step) as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cell, r in summary["cells"].items():
        steps, surv = r["km_curve"]["steps"], r["km_curve"]["not_escaped"]
        end = max(r["max_steps"])
        ax.step(steps + [end], surv + [surv[-1]], where="post", label=f"{cell} ({r['escaped']}/{r['runs']})",
                linestyle="-" if cell.startswith("diff") else "--")
    ax.set_xlabel("training step")
    ax.set_ylabel("fraction of runs still on the plateau")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("MQAR escape times (Kaplan-Meier; never escaped = censored at max_steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
