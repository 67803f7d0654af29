"""The mechanism study's statistics and tables, from the run JSONs under ``results/mechanism/``.

    python studies/mechanism/analyze.py      # results/mechanism/summary.json, then the tables of docs/results.md

The tables are sections of docs/results.md that ``scripts/results_tables.py`` regenerates (and ``--check``s in the
docs test) with the ``render_*`` functions below. The verdict follows the rules stated before the runs
(studies/mechanism/README.md, "Statistics").
"""
from __future__ import annotations

import glob
import json
import os
import sys
from typing import Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
VIT, DINO, MQAR = (os.path.join("results", "mechanism", k) for k in ("vit", "dinov2", "mqar"))
SUMMARY = os.path.join("results", "mechanism", "summary.json")
ARMS = {"A": "standard", "B": "differential (paper)", "C": "B, lambda fixed at 0", "D": "standard + B's epilogue"}
COMPARISONS = [("B", "A"), ("B", "C"), ("C", "A"), ("D", "A"), ("B", "D")]
STEPS = (100, 200, 300, 400)


def load(root: str, folder: str) -> list[dict]:
    runs = []
    for path in sorted(glob.glob(os.path.join(root, folder, "*.json"))):
        if os.path.basename(path) != "summary.json":
            with open(path) as f:
                runs.append(json.load(f))
    return runs


def vit_table(root: str) -> dict[str, dict[int, dict]]:
    """arm -> seed -> the numbers the tables compare."""
    out: dict[str, dict[int, dict]] = {}
    for r in load(root, VIT):
        f, att = r["final"], r["final"]["attention"]["-1"]
        out.setdefault(r["arm"], {})[r["seed"]] = {
            **{f"group@{s}": r["zero_shot"][str(s)]["group"]["top1"] * 100 for s in STEPS if str(s) in r["zero_shot"]},
            **{f"subgroup@{s}": r["zero_shot"][str(s)]["subgroup"]["top1"] * 100 for s in STEPS
               if str(s) in r["zero_shot"]},
            "linear_probe": f["linear_probe"]["top1"] * 100, "few_shot": f["few_shot"]["top1"] * 100,
            "share": att["map_share_mean"] * 100, "uniform": att["uniform_share"] * 100,
            "pos_share": att["map_positive_share_mean"] * 100 if "map_positive_share_mean" in att else None,
            "a1_share": np.mean(att["a1_share"]) * 100 if "a1_share" in att else None,
            "a2_share": np.mean(att["a2_share"]) * 100 if "a2_share" in att else None,
            "entropy": att["entropy_mean"], "max_entropy": att["max_entropy"],
            "lambda": float(np.mean(f["lambda"])) if f.get("lambda") else None,
            **{f"robust:{c}": v["group"]["top1"] * 100 for c, v in f["robustness"].items()},
            "train_seconds": r["train_seconds"], "eval_seconds": r["eval_seconds"]}
    return out


def paired(a: dict[int, dict], b: dict[int, dict], key: str) -> Optional[dict]:
    """Per-seed differences a - b on ``key`` over the seeds both have: mean, std, paired t-test p, seeds > 0."""
    from scipy import stats
    seeds = sorted(s for s in a if s in b and a[s].get(key) is not None and b[s].get(key) is not None)
    if len(seeds) < 2:
        return None
    d = np.array([a[s][key] - b[s][key] for s in seeds])
    p = float(stats.ttest_rel([a[s][key] for s in seeds], [b[s][key] for s in seeds]).pvalue) if d.std() > 0 else 1.0
    return {"seeds": seeds, "diffs": d.round(2).tolist(), "mean": float(d.mean()), "std": float(d.std(ddof=1)),
            "p": p, "positive": int((d > 0).sum()), "ge2": int((d >= 2).sum()), "n": len(seeds)}


def verdict(t: dict[str, dict[int, dict]]) -> dict:
    """The pre-stated rules applied to arms B, C (and A for early speed)."""
    bc, share = paired(t["B"], t["C"], "group@400"), paired(t["B"], t["C"], "share")
    ba = {s: paired(t["B"], t["A"], f"group@{s}") for s in STEPS}
    n = bc["n"] if bc else 0
    support = bool(bc and bc["ge2"] >= n - 1 and bc["p"] < 0.05 and share and share["positive"] >= n - 1)
    against = bool(bc and abs(bc["mean"]) < 1)
    early = bool(ba[400] and abs(ba[400]["mean"]) < 1 and any(ba[s] and ba[s]["mean"] >= 1 for s in (100, 200)))
    if support:
        text = "supports \"the subtraction helps\""
    elif against:
        text = "counts against \"the subtraction helps\" (B within 1 point of C)"
    else:
        text = "inconclusive by the stated rules"
    return {"subtraction_helps": support, "against": against, "early_speed_only": early, "text": text,
            "B-C": bc, "B-C_share": share, "B-A": ba}


def summarize(root: str = REPO) -> dict:
    t = vit_table(root)
    out = {"vit": {"per_seed": t, "verdict": verdict(t) if {"B", "C", "A"} <= set(t) else None,
                   "comparisons": {f"{x}-{y}": {k: paired(t[x], t[y], k) for k in
                                                 [*(f"group@{s}" for s in STEPS), "subgroup@400", "linear_probe",
                                                  "few_shot", "share", "pos_share", "entropy",
                                                  *(f"robust:{c}" for c in ROBUST)]}
                                   for x, y in COMPARISONS if x in t and y in t}}}
    runs = load(root, VIT) + load(root, DINO) + load(root, MQAR)
    out["compute"] = {"vit_runs": len(load(root, VIT)), "dinov2_runs": len(load(root, DINO)),
                      "mqar_runs": len(load(root, MQAR)),
                      "train_hours": sum(r.get("train_seconds", 0) for r in runs) / 3600,
                      "eval_hours": sum(r.get("eval_seconds", 0) for r in runs) / 3600}
    return out


ROBUST = ["clean", "noise_0.1", "noise_0.2", "blur_1", "blur_2", "scene_0", "scene_1", "scene_2", "scene_3"]


def _ms(values: list, digits: int = 1) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    return f"{np.mean(v):.{digits}f} ± {np.std(v, ddof=1):.{digits}f}" if len(v) > 1 else f"{v[0]:.{digits}f}"


def _col(t: dict, arm: str, key: str) -> list:
    return [t[arm][s].get(key) for s in sorted(t[arm])]


def render_arms(root: str) -> str:
    """Zero-shot over training, probes and time per arm (mean ± std over seeds)."""
    t = vit_table(root)
    head = ("| arm | seeds | groups top-1 % @100 | @200 | @300 | @400 | subgroups top-1 % @400 | linear probe % | "
            "5-shot % | train s / run |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in (a for a in ARMS if a in t):
        lines.append(f"| {arm}: {ARMS[arm]} | {len(t[arm])} | " + " | ".join(
            _ms(_col(t, arm, f"group@{s}")) for s in STEPS) + f" | {_ms(_col(t, arm, 'subgroup@400'))} | "
            f"{_ms(_col(t, arm, 'linear_probe'))} | {_ms(_col(t, arm, 'few_shot'))} | "
            f"{_ms(_col(t, arm, 'train_seconds'), 0)} |")
    return "\n".join(lines) + "\n"


def render_paired(root: str) -> str:
    """Paired differences (same seed) on zero-shot groups at each step."""
    t = vit_table(root)
    lines = ["| difference (points) | step | per seed | mean ± std | seeds > 0 | paired t-test p |",
             "|---|---|---|---|---|---|"]
    for x, y in COMPARISONS:
        if x in t and y in t:
            for s in STEPS:
                d = paired(t[x], t[y], f"group@{s}")
                if d:
                    lines.append(f"| {x} − {y} | {s} | {', '.join(f'{v:+.1f}' for v in d['diffs'])} | "
                                 f"{d['mean']:+.2f} ± {d['std']:.2f} | {d['positive']}/{d['n']} | {d['p']:.3f} |")
    return "\n".join(lines) + "\n"


def render_attention(root: str) -> str:
    """Attention mass on the subject, entropy, lambda per arm."""
    t = vit_table(root)
    lines = ["| arm | CLS mass on the subject %: effective map, absolute | its positive part | A1 | A2 | uniform map "
             "| entropy (nats; max ln 65 = 4.17) | lambda (mean of 4 layers) |", "|---|---|---|---|---|---|---|---|"]
    for arm in (a for a in ARMS if a in t):
        lam = _col(t, arm, "lambda")
        lines.append(f"| {arm}: {ARMS[arm]} | {_ms(_col(t, arm, 'share'))} | {_ms(_col(t, arm, 'pos_share'))} | "
                     f"{_ms(_col(t, arm, 'a1_share'))} | "
                     f"{_ms(_col(t, arm, 'a2_share'))} | {_ms(_col(t, arm, 'uniform'))} | "
                     f"{_ms(_col(t, arm, 'entropy'), 3)} | {_ms(lam, 3) if any(v is not None for v in lam) else '-'} |")
    return "\n".join(lines) + "\n"


def render_robustness(root: str) -> str:
    """Zero-shot group top-1 under noise, blur and distractors per arm."""
    t = vit_table(root)
    names = {"clean": "clean", "noise_0.1": "noise 0.1", "noise_0.2": "noise 0.2", "blur_1": "blur 1",
             "blur_2": "blur 2", "scene_0": "40 px, 0 distractors", "scene_1": "+1", "scene_2": "+2", "scene_3": "+3"}
    lines = ["| arm | " + " | ".join(names[c] for c in ROBUST) + " |", "|---|" + "---|" * len(ROBUST)]
    for arm in (a for a in ARMS if a in t):
        lines.append(f"| {arm} | " + " | ".join(_ms(_col(t, arm, f"robust:{c}")) for c in ROBUST) + " |")
    return "\n".join(lines) + "\n"


def render_dinov2(root: str) -> str:
    """DINOv2 with its last blocks trainable: zero-shot, lambda, beta and ||A1 - A2|| before and after."""
    runs = load(root, DINO)
    if not runs:
        return "*(no DINOv2 runs)*\n"
    by = {}
    for r in runs:
        by.setdefault(r["arm"], []).append(r)
    lines = ["| arm | seeds | steps | groups top-1 % | subgroups top-1 % | lambda per block: start → end | "
             "mean abs beta at the end | mean ‖A1 − A2‖ (CLS row): start → end |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in ("standard", "diff"):
        rs = sorted(by.get(arm, []), key=lambda r: r["seed"])
        if not rs:
            continue
        g = _ms([r["zero_shot"]["group"]["top1"] * 100 for r in rs])
        sg = _ms([r["zero_shot"]["subgroup"]["top1"] * 100 for r in rs])
        if arm == "diff":
            lam0 = np.mean([r["start"]["lambda"] for r in rs], axis=0)
            lam1 = np.mean([r["end"]["lambda"] for r in rs], axis=0)
            lam = ", ".join(f"{a:.2f} → {b:.2f}" for a, b in zip(lam0, lam1))
            beta = _ms([float(np.mean(np.abs(r["end"]["beta"]))) for r in rs], 3)

            def gap(state: str, r: dict) -> float:
                return float(np.mean([v["a1_minus_a2"] for v in r[state]["attention"].values()]))
            a12 = f"{np.mean([gap('start', r) for r in rs]):.4f} → {_ms([gap('end', r) for r in rs], 4)}"
        else:
            lam = beta = a12 = "-"
        lines.append(f"| {arm} | {len(rs)} | {rs[0]['steps']} | {g} | {sg} | {lam} | {beta} | {a12} |")
    return "\n".join(lines) + "\n"


def render_mqar(root: str) -> str:
    sys.path.insert(0, HERE)
    import survival
    cells = survival.load_runs(os.path.join(root, MQAR))
    return survival.table(survival.summarize(cells, "diff_Ldepth_Sdepth")) if cells else "*(no MQAR runs)*\n"


def render_compute(root: str) -> str:
    """Each part's runs and their wall time (seconds of the run's own processes, with others sharing the cores)."""
    lines = ["| part | runs | train s per run (mean, min-max) | measure s per run | sum, hours | CPU "
             "| threads per run |",
             "|---|---|---|---|---|---|---|"]
    total = 0.0
    for name, folder in (("ViT arms", VIT), ("DINOv2", DINO), ("MQAR", MQAR)):
        runs = load(root, folder)
        if not runs:
            continue
        tr = [r["train_seconds"] for r in runs]
        ev = [r.get("eval_seconds", 0.0) for r in runs]
        total += sum(tr) + sum(ev)
        lines.append(f"| {name} | {len(runs)} | {np.mean(tr):.0f} ({min(tr):.0f}-{max(tr):.0f}) | "
                     f"{np.mean(ev):.0f} | {(sum(tr) + sum(ev)) / 3600:.2f} | {runs[0].get('cpu', '?')} | "
                     f"{runs[0].get('threads', runs[0].get('torch_threads', '?'))} |")
    lines.append(f"| all | | | | {total / 3600:.2f} | | |")
    return "\n".join(lines) + "\n"


#: docs/results.md sections (scripts/results_tables.py) -> renderer
SECTIONS = {"mechanism-arms": render_arms, "mechanism-paired": render_paired,
            "mechanism-attention": render_attention, "mechanism-robustness": render_robustness,
            "mechanism-dinov2": render_dinov2, "mechanism-mqar": render_mqar, "mechanism-compute": render_compute}


def plot_zero_shot(root: str, path: str) -> str:
    """Zero-shot group top-1 over training per arm (mean ± std over seeds, each seed faint)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = vit_table(root)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, color in zip(ARMS, ("tab:gray", "tab:red", "tab:blue", "tab:green")):
        if arm not in t:
            continue
        ys = np.array([[t[arm][s][f"group@{k}"] for k in STEPS] for s in sorted(t[arm])])
        for y in ys:
            ax.plot(STEPS, y, color=color, alpha=0.2, lw=1)
        ax.errorbar(STEPS, ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else None, color=color, lw=2, capsize=3,
                    label=f"{arm}: {ARMS[arm]} ({len(ys)} seeds)")
    ax.axhline(100 / 9, color="k", ls=":", lw=1, label="chance (9 groups)")
    ax.set(xlabel="training step", ylabel="zero-shot top-1 %, held-out art, 9 groups", xticks=STEPS,
           title="Tiny LiT ViT: the four arms")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(root, path), dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    s = summarize(REPO)
    print(f"wrote {plot_zero_shot(REPO, os.path.join('results', 'mechanism', 'vit_zero_shot.png'))}")
    with open(os.path.join(REPO, SUMMARY), "w") as f:
        json.dump(s, f, indent=1, default=float)
    v = s["vit"]["verdict"]
    print(f"wrote {SUMMARY}; verdict: {v['text'] if v else 'n/a'}; compute {s['compute']}")
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import results_tables
    return results_tables.main([])


if __name__ == "__main__":
    sys.exit(main())
