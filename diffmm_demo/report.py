"""The demo's numbers and report: mean ± std per model, paired differences with wins per seed, ``report.md``.

One aggregation and one renderer serve every part: a part's results hold its metric definitions, so a
``results.json`` renders without the code that made it (``scripts/results_tables.py`` renders the committed run
into ``docs/results.md`` with :func:`comparison_table`).
"""
from __future__ import annotations

import math
import os
import statistics
from typing import Any, Optional, Sequence

from diffmm.data.files import write_json_atomic


def lookup(run: dict, path: Sequence[str]) -> Any:
    """The value at ``path`` in a run's nested results: a finite number (float) or a text; None otherwise."""
    for p in path:
        run = run.get(p) if isinstance(run, dict) else None
    if isinstance(run, str) or (isinstance(run, (int, float)) and not isinstance(run, bool) and math.isfinite(run)):
        return run if isinstance(run, str) else float(run)
    return None


def mean_std(values: Sequence[float]) -> dict[str, Any]:
    """``{"mean", "std" (sample std; None for one value), "n", "values"}``; mean None when empty."""
    return {"mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None, "n": len(values), "values": list(values)}


def aggregate(part: dict) -> None:
    """Fill ``part["summary"]`` (model -> metric -> mean ± std over seeds) and ``part["paired"]`` (model -> metric ->
    mean ± std of its difference to the baseline, the first model, on the seeds both have, and its ``wins``)."""
    runs, base = part["runs"], part["models"][0]
    part["summary"], part["paired"] = {}, {}
    for x in part["models"]:
        part["summary"][x], values = {}, {}
        for m in part["metrics"]:
            values[m["key"]] = {s: v for s, r in runs[x].items() if isinstance(v := lookup(r, m["path"]), float)}
            part["summary"][x][m["key"]] = mean_std(list(values[m["key"]].values()))
        if x == base:
            continue
        part["paired"][x] = {}
        for m in part["metrics"]:
            b = {s: v for s, r in runs[base].items() if isinstance(v := lookup(r, m["path"]), float)}
            deltas = [v - b[s] for s, v in sorted(values[m["key"]].items(), key=lambda sv: int(sv[0])) if s in b]
            better = m["higher_is_better"]
            wins = None if better is None else sum((d > 0) if better else (d < 0) for d in deltas)
            part["paired"][x][m["key"]] = {**mean_std(deltas), "wins": wins}


def fmt(stats: dict, m: dict, signed: bool = False) -> str:
    """``mean ± std`` in the metric's unit (percent metrics x100); ``n/a`` without a value."""
    if not stats or stats.get("mean") is None:
        return "n/a"
    scale, d = (100.0 if m["percent"] else 1.0), m["digits"]
    text = f"{stats['mean'] * scale:{'+' if signed else ''}.{d}f}"
    return text + (f" ± {stats['std'] * scale:.{d}f}" if stats.get("std") is not None else "")


def table(headers: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (``|`` inside cells escaped)."""
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]) + "\n"


def chance(part: dict, m: dict) -> str:
    """The chance level of metric ``m``, from the first run that records it, shown like the metric."""
    found = [c for rs in part["runs"].values() for r in rs.values() if m["chance"] and (c := lookup(r, m["chance"]))
             is not None]
    if not found or isinstance(found[0], str):
        return found[0] if found else ""
    return f"{found[0] * (100.0 if m['percent'] else 1.0):.{m['digits']}f}"


def comparison_table(part: dict) -> str:
    """Per metric: each model's mean ± std, each other model's paired difference to the baseline and on how many
    seeds it is better, and the chance level."""
    base, others = part["models"][0], part["models"][1:]
    headers = ["metric", *part["models"], *[h for x in others for h in (f"{x} − {base} (paired)", f"{x} better on")]]
    rows = []
    for m in part["metrics"]:
        row = [m["label"] + {None: "", True: " (↑)", False: " (↓)"}[m["higher_is_better"]]]
        row += [fmt(part["summary"].get(x, {}).get(m["key"], {}), m) for x in part["models"]]
        for x in others:
            p = part["paired"].get(x, {}).get(m["key"], {})
            row += [fmt(p, m, signed=True),
                    "n/a" if p.get("wins") is None or not p["n"] else f"{p['wins']}/{p['n']} seeds"]
        rows.append(row + [chance(part, m)])
    return table(headers + ["chance"], rows)


def _img(out: str, path: Optional[str], alt: str) -> str:
    """A picture of the report, or the text of a Markdown file (a table) that a part wrote beside it."""
    ok = path and os.path.isfile(os.path.join(out, path))
    if ok and path.endswith(".md"):
        with open(os.path.join(out, path)) as f:
            return "\n" + f.read() + "\n"
    return f"![{alt}]({path})\n" if ok else f"*({alt}: not drawn, see the steps below)*\n"


def render(results: dict, out: str) -> str:
    """The whole ``report.md`` from the ``results.json`` content (plot paths relative to ``out``)."""
    env, cfg, steps = results["environment"], results["config"], results["steps"]
    failed = [s for s in steps if s["status"] == "failed"]
    skipped = sum(s["status"] == "skipped" for s in steps)
    md = ["# diffmm demo: standard vs differential attention\n",
          f"`{results['command']}` (preset {cfg['preset']}): **{results['status']}**, "
          f"{len(steps) - len(failed) - skipped} steps ok, **{len(failed)} failed**, {skipped} skipped; "
          f"{(results.get('wall_seconds') or 0) / 60:.1f} min "
          f"(CPU {(results.get('cpu_seconds') or 0) / 60:.1f} min) on {env['cores']} cores, {env['torch_threads']} "
          f"torch thread(s), load average {env['load_start']} at the start, {env.get('load_end', '?')} at the end; "
          f"diffmm {env['diffmm']}, torch {env['torch']}, Python {env['python']}. Seeds: "
          f"{', '.join(map(str, cfg['seeds']))}.\n"]
    if failed:
        md.append("**Failed steps:** " + "; ".join(f"`{s['name']}`: {s['error']}" for s in failed)
                  + " (tracebacks in `demo.log`).\n")
    md.append("Tiny models trained for minutes on CPU: the numbers show that the pipeline works and how the attentions "
              "compare *at this scale*, nothing about the papers' claims at scale (`docs/results.md`). Each run is "
              "`diffmm fit` with a file of `configs/` and the overrides shown; its checkpoint is "
              "`checkpoints/<model>-seed<k>.ckpt` (for `diffmm eval`, `diffmm classify`, `diffmm.load_pretrained`), "
              "its log `runs/<model>-seed<k>/csv/metrics.csv`. The paired columns give the mean ± std of the "
              "difference on each seed and on how many seeds the model is better: with n seeds the same sign on all "
              "of them happens by chance with probability 2^-(n-1) per metric, so compare a difference with its "
              "spread.\n")
    for part in results["parts"].values():
        md.append(f"## {part['title']}\n\n{part['about']} Mean ± std over seeds; (↑)/(↓): higher/lower is better.\n\n"
                  + comparison_table(part) + "\n<details><summary>training commands</summary>\n\n"
                  + "".join(f"- `{c}`\n" for c in part["commands"].values()) + "\n</details>\n")
        for name, paths in part["plots"].items():
            md.append("".join(_img(out, p, name) for p in (paths if isinstance(paths, list) else [paths])))
        if part["paper"]:
            md.append(f"\nPaper: {part['paper']['source']}, for scale:\n\n"
                      + table(["paper result (full scale)", *part["paper"]["columns"]], part["paper"]["rows"]))
    md.append("## Lambda per layer\n\n" + _img(out, results["plots"].get("lambda"), "lambda per layer"))
    md.append("## Steps\n\n" + table(["step", "status", "seconds", "CPU seconds", "error"], [
        [s["name"], s["status"], f"{s['seconds']:.1f}", f"{s['cpu_seconds']:.1f}", s["error"] or ""] for s in steps]))
    return "\n".join(md) + "\nAll numbers: `results.json`.\n"


def write_report(results: dict, out: str) -> None:
    """Aggregate every part and (re)write ``out/results.json`` and ``out/report.md``."""
    for part in results["parts"].values():
        aggregate(part)
    write_json_atomic(os.path.join(out, "results.json"), results)
    with open(os.path.join(out, "report.md.tmp"), "w") as f:
        f.write(render(results, out))
    os.replace(os.path.join(out, "report.md.tmp"), os.path.join(out, "report.md"))
