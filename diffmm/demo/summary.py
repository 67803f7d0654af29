"""Aggregate per-seed results: mean +- std per model, and paired differences (differential - baseline).

A metric is read from a run's nested results by a path such as ``("zs_group", "top1")``. With
few seeds nothing here is a significance test; the verdict only says whether the sign of the
paired difference is the same on every seed.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class Metric:
    """A number to compare: where it is, how to show it, and which direction is better (None: neither)."""

    key: str
    label: str
    path: tuple[str, ...]
    higher_is_better: Optional[bool]
    percent: bool = False
    digits: int = 2


CLIP_METRICS: tuple[Metric, ...] = (
    Metric("train_loss", "final train loss (contrastive)", ("train", "final_train_loss"), False, digits=3),
    Metric("zs_group_top1", "zero-shot held-out style, 9 groups: top-1 %", ("zs_group", "top1"), True, True),
    Metric("zs_subgroup_top1", "zero-shot held-out style, 99 subgroups: top-1 %", ("zs_subgroup", "top1"), True, True),
    Metric("zs_subgroup_top5", "zero-shot held-out style, 99 subgroups: top-5 %", ("zs_subgroup", "top5"), True, True),
    Metric("zs_fmnist_top1", "zero-shot Fashion-MNIST, 10 classes: top-1 %", ("zs_fmnist", "top1"), True, True),
    Metric("i2t_r1", "retrieval held-out style, image->text R@1 %", ("retrieval", "image_to_text_R@1"), True, True),
    Metric("i2t_r5", "retrieval held-out style, image->text R@5 %", ("retrieval", "image_to_text_R@5"), True, True),
    Metric("t2i_r1", "retrieval held-out style, text->image R@1 %", ("retrieval", "text_to_image_R@1"), True, True),
    Metric("t2i_r5", "retrieval held-out style, text->image R@5 %", ("retrieval", "text_to_image_R@5"), True, True),
    Metric("samples_per_s", "training throughput, samples/s", ("train", "samples_per_s"), None, digits=1),
)

LM_METRICS: tuple[Metric, ...] = (
    Metric("train_loss", "final train loss", ("train", "final_train_loss"), False, digits=3),
    Metric("val_loss", "validation loss (nats/token)", ("val", "val_loss"), False, digits=3),
    Metric("val_ppl", "validation perplexity", ("val", "val_ppl"), False, digits=1),
    Metric("needle_acc", "multi-needle accuracy %", ("needle", "accuracy"), True, True),
    Metric("needle_attn", "attention share on the answer needle %", ("needle", "answer_attention"), True, True),
    Metric("logit_top1", "top-1 attention logit |max|", ("outliers", "attention_logits_top1"), False),
    Metric("logit_median", "median attention logit |.|", ("outliers", "attention_logits_median"), None, digits=3),
    Metric("hidden_top1", "top-1 hidden state |max|", ("outliers", "hidden_states_top1"), False),
    Metric("hidden_median", "median hidden state |.|", ("outliers", "hidden_states_median"), None, digits=3),
    Metric("tokens_per_s", "training throughput, tokens/s", ("train", "tokens_per_s"), None, digits=0),
)


def lookup(results: dict, path: Sequence[str]) -> Optional[float]:
    """The number at ``path`` in nested dicts, or None when missing / not finite."""
    cur: Any = results
    for p in path:
        if not isinstance(cur, dict) or p not in cur:
            return None
        cur = cur[p]
    if isinstance(cur, bool) or not isinstance(cur, (int, float)) or not math.isfinite(cur):
        return None
    return float(cur)


def mean_std(values: Sequence[float]) -> dict[str, Any]:
    """``{"mean", "std" (sample std, None for one value), "n", "values"}``; mean None when empty."""
    vals = [float(v) for v in values]
    if not vals:
        return {"mean": None, "std": None, "n": 0, "values": []}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else None,
            "n": len(vals), "values": vals}


def summarize(per_seed: dict[int, dict], metrics: Sequence[Metric]) -> dict[str, dict]:
    """Per metric: mean/std over the seeds that have it (seed order kept in ``seeds``)."""
    out = {}
    for m in metrics:
        pairs = [(s, lookup(r, m.path)) for s, r in sorted(per_seed.items())]
        pairs = [(s, v) for s, v in pairs if v is not None]
        out[m.key] = {**mean_std([v for _, v in pairs]), "seeds": [s for s, _ in pairs]}
    return out


def paired(base: dict[int, dict], diff: dict[int, dict], metrics: Sequence[Metric]) -> dict[str, dict]:
    """Per metric: the difference ``diff - base`` on every seed both have, its mean/std, and on how many
    seeds the differential model is better (``wins``; None when the metric has no better direction)."""
    out = {}
    for m in metrics:
        deltas, wins = [], 0
        for s in sorted(set(base) & set(diff)):
            a, b = lookup(base[s], m.path), lookup(diff[s], m.path)
            if a is None or b is None:
                continue
            d = b - a
            deltas.append(d)
            if m.higher_is_better is not None and ((d > 0) if m.higher_is_better else (d < 0)):
                wins += 1
        stats = mean_std(deltas)
        stats["wins"] = wins if m.higher_is_better is not None else None
        stats["verdict"] = verdict(len(deltas), wins, m.higher_is_better, deltas)
        out[m.key] = stats
    return out


def verdict(n: int, wins: int, higher_is_better: Optional[bool], deltas: Sequence[float]) -> str:
    """``differential`` / ``baseline`` (better on every seed), ``mixed``, ``tie``, ``n/a``."""
    if n == 0 or higher_is_better is None:
        return "n/a"
    if all(d == 0 for d in deltas):
        return "tie"
    if wins == n:
        return "differential"
    if wins == 0 and all(d != 0 for d in deltas):
        return "baseline"
    return "mixed"


def fmt(stats: dict, metric: Metric, signed: bool = False) -> str:
    """``mean ± std`` in the metric's unit (percent metrics x100); ``n/a`` when there is no value.

    ``signed`` writes the mean with its sign (``+0.12 ± 0.05``), for paired differences.
    """
    if not stats or stats.get("mean") is None:
        return "n/a"
    scale = 100.0 if metric.percent else 1.0
    d = metric.digits
    s = f"{stats['mean'] * scale:{'+' if signed else ''}.{d}f}"
    if stats.get("std") is not None:
        s += f" ± {stats['std'] * scale:.{d}f}"
    return s


def fmt_delta(stats: dict, metric: Metric) -> str:
    """Signed ``+mean ± std`` of a paired difference."""
    return fmt(stats, metric, signed=True)
