"""Write ``results.json`` (everything, machine-readable) and ``report.md`` (tables, plots, verdict, step log)."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence

from diffmm.demo.summary import CLIP_METRICS, LM_METRICS, Metric, fmt, fmt_delta

#: headline numbers of the papers (SPEC sections 2-3), shown beside the demo's for scale
PAPER = {
    "clip": [
        ("zero-shot ImageNet top-1 %, CC3M (ViT-B/16, 40 epochs)", 13.6, 14.4),
        ("zero-shot ImageNet top-1 %, CC12M (ViT-B/16, 40 epochs)", 31.8, 33.8),
    ],
    "lm": [
        ("validation loss, 1.4B params / 10B tokens", 3.087, 3.062),
        ("multi-needle accuracy, 4K context, N=6, R=2", 0.35, 0.85),
        ("top-1 attention logit (3B models)", 318.0, 38.8),
        ("top-1 hidden state (3B models)", 3609.0, 1688.0),
    ],
}


DATA_LABELS = {
    "train_pairs": "emoji image-caption pairs for training", "holdout_pairs": "held-out style pairs",
    "fashion_test_images": "Fashion-MNIST test images available", "lm_train_documents": "Python-docs training pages",
    "lm_val_documents": "Python-docs validation pages", "tokenizer": "LM tokenizer",
    "built_clip": "built by this run (image-text)", "built_lm": "built by this run (language)",
}


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: str, obj: Any) -> str:
    """Write ``obj`` as indented JSON (NaN/inf -> null, keys -> str) atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_finite(obj), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _wins(stats: dict, metric: Metric) -> str:
    if metric.higher_is_better is None or not stats or stats.get("n", 0) == 0:
        return "n/a"
    return f"{stats['wins']}/{stats['n']} seeds"


def _comparison_table(part: dict, metrics: Sequence[Metric], chance: dict[str, str]) -> str:
    base, diff = part["models"]["baseline"], part["models"]["differential"]
    rows = []
    for m in metrics:
        s_b = part["summary"].get(base, {}).get(m.key, {})
        s_d = part["summary"].get(diff, {}).get(m.key, {})
        p = part["paired"].get(m.key, {})
        arrow = "" if m.higher_is_better is None else (" (↑)" if m.higher_is_better else " (↓)")
        rows.append([m.label + arrow, fmt(s_b, m), fmt(s_d, m), fmt_delta(p, m), _wins(p, m), chance.get(m.key, "")])
    return _table(["metric", base, diff, f"{diff} − {base} (paired)", f"{diff} better on", "chance"], rows)


def _per_seed_table(part: dict, metrics: Sequence[Metric]) -> str:
    from diffmm.demo.summary import lookup

    models = [part["models"]["baseline"], part["models"]["differential"]]
    seeds = sorted({s for name in models for s in part["runs"].get(name, {})}, key=int)  # int, or str from JSON
    headers = ["metric"] + [f"{name} s{s}" for name in models for s in seeds]
    rows = []
    for m in metrics:
        row = [m.key]
        for name in models:
            for s in seeds:
                v = lookup(part["runs"].get(name, {}).get(s, {}), m.path)
                row.append("n/a" if v is None else f"{v * (100 if m.percent else 1):.{m.digits}f}")
        rows.append(row)
    return _table(headers, rows)


def _verdict(part: dict, metrics: Sequence[Metric], what: str) -> str:
    base, diff = part["models"]["baseline"], part["models"]["differential"]
    quality = [m for m in metrics if m.higher_is_better is not None and m.key in part["paired"]
               and part["paired"][m.key].get("n", 0) > 0]
    if not quality:
        return f"No {what} comparison could be made (see the failed steps).\n"
    n_seeds = max(part["paired"][m.key]["n"] for m in quality)
    groups: dict[str, list[str]] = {"differential": [], "baseline": [], "mixed": [], "tie": []}
    for m in quality:
        groups.setdefault(part["paired"][m.key]["verdict"], []).append(m.label)
    every = "on the single seed" if n_seeds == 1 else f"on every one of the {n_seeds} seeds"
    lines = [f"Over {len(quality)} compared metrics ({n_seeds} seed{'s' if n_seeds > 1 else ''}):"]
    lines.append(f"- {diff} better than {base} {every}: {len(groups['differential'])}"
                 + (f" ({'; '.join(groups['differential'])})" if groups["differential"] else ""))
    lines.append(f"- {base} better {every}: {len(groups['baseline'])}"
                 + (f" ({'; '.join(groups['baseline'])})" if groups["baseline"] else ""))
    lines.append(f"- mixed across seeds (no consistent winner): {len(groups['mixed'])}"
                 + (f" ({'; '.join(groups['mixed'])})" if groups["mixed"] else ""))
    if groups["tie"]:
        lines.append(f"- identical: {len(groups['tie'])} ({'; '.join(groups['tie'])})")
    lines.append("")
    if n_seeds < 3:
        lines.append("With fewer than 3 seeds these signs say nothing about which attention is better.")
    else:
        lines.append(f"Agreement in sign on all {n_seeds} seeds happens by chance with probability "
                     f"2^-{n_seeds - 1} = {2 ** -(n_seeds - 1):.2f} per metric when there is no real difference, "
                     "so single consistent metrics are weak evidence; compare the paired differences with "
                     "their spread.")
    return "\n".join(lines) + "\n"


def _outlier_table(part: dict) -> str:
    from diffmm.demo.summary import mean_std

    rows = []
    for name in (part["models"]["baseline"], part["models"]["differential"]):
        runs = part["runs"].get(name, {})
        for kind, label in (("attention_logits", "attention logits"), ("hidden_states", "hidden states")):
            row = [name, label]
            for k in ("top1", "top2", "top3", "top10", "top100", "median"):
                vals = [r["outliers"][f"{kind}_{k}"] for r in runs.values()
                        if "outliers" in r and r["outliers"].get(f"{kind}_{k}") is not None]
                s = mean_std(vals)
                if s["mean"] is None:
                    row.append("n/a")
                else:
                    digits = 3 if k == "median" else 2
                    row.append(f"{s['mean']:.{digits}f}" + (f" ± {s['std']:.{digits}f}" if s["std"] is not None else ""))
            rows.append(row)
    return _table(["model", "activation", "top-1", "top-2", "top-3", "top-10", "top-100", "median"], rows)


def _img(path: Optional[str], out: str, alt: str, run_out: Optional[str] = None) -> str:
    """A markdown image link relative to ``out``. Plot paths are stored relative to the report folder
    (older runs: relative to the working directory or absolute, with ``run_out`` their report folder)."""
    found = None
    if path:
        candidates = [os.path.join(out, path)]
        if run_out:
            candidates.append(os.path.join(out, os.path.relpath(path, run_out)))
        found = next((c for c in candidates if os.path.isfile(c)), None)
    if found is None:
        return f"*({alt}: not drawn, see the steps below)*\n"
    return f"![{alt}]({os.path.relpath(found, out)})\n"


def _paper_table(rows, base: str, diff: str) -> str:
    return _table(["paper result (full scale)", base, diff], [[r[0], r[1], r[2]] for r in rows])


def render_markdown(results: dict, out: Optional[str] = None) -> str:
    """The whole ``report.md`` (for the folder ``out``, default the run's) from the ``results.json`` content."""
    cfg, env = results["config"], results["environment"]
    run_out = cfg["out"]
    out = out or run_out
    steps = results["steps"]
    failed = [s for s in steps if s["status"] == "failed"]
    skipped = [s for s in steps if s["status"] == "skipped"]
    md = ["# diffmm demo report\n"]
    wall = results.get("wall_seconds") or 0.0
    loads = [x[0] for x in (env.get("load_start"), env.get("load_end")) if x]
    busy = bool(loads) and max(loads) > (env.get("torch_threads") or env["cores"]) + 0.5  # more than its own threads
    md.append(f"Command: `{results['command']}`  \n"
              f"Finished {results.get('finished', '?')}; wall time **{wall / 60:.1f} min** "
              f"(CPU time {(results.get('cpu_seconds') or 0) / 60:.1f} min), {env['cores']} cores, "
              f"{env['torch_threads']} torch thread(s), load average {env['load_start']} at the start and "
              f"{env.get('load_end', '?')} at the end"
              f"{' (other jobs were running: timings are pessimistic)' if busy else ''}.  \n"
              f"Seeds: {', '.join(map(str, cfg['seeds']))}. Steps: {len(steps) - len(failed) - len(skipped)} ok, "
              f"**{len(failed)} failed**, {len(skipped)} skipped.\n")
    if failed:
        md.append("**Failed steps:** " + "; ".join(f"`{s['name']}`: {s['error']}" for s in failed)
                  + f" (tracebacks in `demo.log`).\n")
    md.append("These are tiny models (about 8M parameters for CLIP, 2M for the LMs, most of them embeddings) "
              "trained for minutes on CPU. The numbers show that the whole pipeline works and how the two "
              "attentions compare *at this scale*; they say nothing about the papers' claims at scale. "
              "See `docs/results.md`.\n")
    data = results.get("data") or {}
    if data:
        md.append("## Data\n")
        md.append(_table(["", "value"], [[DATA_LABELS.get(k, k), ", ".join(v) if isinstance(v, list) else v]
                                         for k, v in data.items()]))
    clip = results.get("clip")
    if clip:
        base, diff = clip["models"]["baseline"], clip["models"]["differential"]
        md.append(f"\n## {base} vs {diff} (image-text)\n")
        md.append(f"Trained on the emoji styles {', '.join(cfg['train_styles'])} for {cfg['clip_steps']} steps of "
                  f"{cfg['clip_batch']} pairs (AdamW lr {cfg['clip_lr']}, warmup {cfg['clip_warmup']}, cosine, "
                  f"weight decay {cfg['clip_weight_decay']}), the same seeds, data order and budget for both; "
                  f"evaluated on the held-out style `{cfg['holdout_style']}` (zero-shot by emoji group and "
                  f"subgroup with the prompt \"an emoji of {{}}.\", image<->text retrieval) and zero-shot on "
                  f"Fashion-MNIST test ({cfg['fmnist_images'] or 'all'} images). Mean ± std over seeds; "
                  "(↑)/(↓): higher/lower is better.\n")
        md.append(_comparison_table(clip, CLIP_METRICS, clip_chance(clip)))
        md.append("\n### Verdict (image-text)\n\n" + _verdict(clip, CLIP_METRICS, "image-text"))
        md.append("\n<details><summary>Per-seed values</summary>\n\n" + _per_seed_table(clip, CLIP_METRICS)
                  + "\n</details>\n")
        plots = results.get("plots", {})
        md.append("\n### Plots\n\n" + _img(plots.get("clip_loss"), out, "CLIP loss curves", run_out))
        for p in plots.get("attention", []):
            md.append(_img(p, out, "attention maps", run_out))
        if not plots.get("attention"):
            md.append(_img(None, out, "attention maps", run_out))
        md.append(f"\nPaper (DiffCLIP, SPEC section 3):\n\n" + _paper_table(PAPER["clip"], "CLIP", "DiffCLIP"))
    lm = results.get("lm")
    if lm:
        base, diff = lm["models"]["baseline"], lm["models"]["differential"]
        kw = cfg["lm_model_kwargs"]
        md.append(f"\n## {base} vs {diff} (language)\n")
        md.append(f"Decoder LMs ({kw.get('n_layer')} layers, width {kw.get('n_embd')}, {kw.get('n_head')} standard "
                  f"heads = {int(kw.get('n_head', 0)) // 2} differential heads, context {kw.get('block_size')}) "
                  f"trained on the Python-docs corpus for {cfg['lm_steps']} steps of {cfg['lm_batch']} x "
                  f"{kw.get('block_size')} tokens (AdamW lr {cfg['lm_lr']}, warmup {cfg['lm_warmup']}, cosine), "
                  f"same seeds and data order; validation on the held-out pages; multi-needle retrieval in "
                  f"{int(_first(lm, ('needle', 'context_length')) or cfg['needle_context'])}-token contexts "
                  f"(N={cfg['needle_needles']}, R={cfg['needle_queried']}, {cfg['needle_trials']} trials at depths "
                  f"{', '.join(str(d) for d in cfg['needle_depths'])}); activation outliers over "
                  f"{cfg['outlier_batches']} validation batches.\n")
        md.append(_comparison_table(lm, LM_METRICS, {}))
        md.append("\n### Verdict (language)\n\n" + _verdict(lm, LM_METRICS, "language"))
        md.append("\n### Activation outliers (DIFF paper Table 5 layout; mean ± std over seeds)\n\n" + _outlier_table(lm))
        md.append("\n<details><summary>Per-seed values</summary>\n\n" + _per_seed_table(lm, LM_METRICS)
                  + "\n</details>\n")
        plots = results.get("plots", {})
        md.append("\n### Plots\n\n" + _img(plots.get("lm_loss"), out, "LM loss curves", run_out)
                  + _img(plots.get("needle"), out, "needle retrieval", run_out))
        md.append(f"\nPaper (DIFF Transformer, SPEC section 2):\n\n" + _paper_table(PAPER["lm"], "Transformer", "DIFF"))
    plots = results.get("plots", {})
    if clip or lm:
        md.append("\n## Lambda per layer\n\n" + _img(plots.get("lambda"), out, "lambda per layer", run_out))
    if results.get("recall"):
        from diffmm.demo.recall import report_section

        md.append(report_section(results, lambda p, alt: _img(p, out, alt, run_out)))
    md.append("\n## Steps\n\n" + _table(["step", "status", "seconds", "CPU seconds", "error"],
                                       [[s["name"], s["status"], f"{s['seconds']:.1f}", f"{s['cpu_seconds']:.1f}",
                                         s.get("error") or ""] for s in steps]))
    md.append(f"\nAll numbers: `results.json`. Training logs: `runs/<model>-seed<k>/csv/metrics.csv`.\n")
    return "\n".join(md)


def clip_chance(clip: dict) -> dict[str, str]:
    """Chance level (in %) of each image-text metric that has one, as the tables print it."""
    chance = {}
    for key, path in (("zs_group_top1", ("zs_group", "chance_top1")), ("zs_subgroup_top1", ("zs_subgroup", "chance_top1")),
                      ("zs_fmnist_top1", ("zs_fmnist", "chance_top1")), ("i2t_r1", ("retrieval", "chance_R1")),
                      ("t2i_r1", ("retrieval", "chance_R1"))):
        c = _first(clip, path)
        if c is not None:
            chance[key] = f"{100 * c:.2f}"
    c = _first(clip, ("zs_subgroup", "chance_top1"))
    if c is not None:
        chance["zs_subgroup_top5"] = f"{500 * c:.2f}"
    c = _first(clip, ("retrieval", "chance_R1"))
    if c is not None:
        chance["i2t_r5"] = chance["t2i_r5"] = f"{500 * c:.2f}"
    return chance


def _first(part: dict, path: Sequence[str]) -> Optional[float]:
    """The value at ``path`` in the first run that has it."""
    from diffmm.demo.summary import lookup

    for runs in part.get("runs", {}).values():
        for r in runs.values():
            v = lookup(r, path)
            if v is not None:
                return v
    return None


def write_report(results: dict, out: str) -> tuple[str, str]:
    """Write ``out/results.json`` and ``out/report.md``; returns both paths."""
    j = write_json(os.path.join(out, "results.json"), results)
    md_path = os.path.join(out, "report.md")
    tmp = md_path + ".tmp"
    with open(tmp, "w") as f:
        f.write(render_markdown(results, out))
    os.replace(tmp, md_path)
    return j, md_path
