"""Pictures (PNG, drawn on matplotlib ``Figure`` objects, no pyplot state): CLIP / DiffCLIP attention maps,
needle attention, loss curves.

* :func:`cls_attention` + :func:`plot_attention_maps`: the CLS token's attention over the image patches
  in one vision layer, per head and averaged, overlaid on the image. Differential layers show
  ``A1 - lambda*A2`` (may be negative), standard layers ``A``; each panel is scaled to its own range.
* :func:`plot_needle_attention`: share of attention on the answer needle (and accuracy) per depth.
* :func:`plot_loss_curves`: loss columns of Lightning ``CSVLogger`` ``metrics.csv`` files against step.
"""
from __future__ import annotations

import csv
import math
import os
from typing import Mapping, Optional, Sequence

import numpy as np
import torch
from matplotlib.figure import Figure

from diffmm.eval.attention_capture import AttentionRecorder
from diffmm.eval.common import EvalError, model_device


def save_figure(fig: Figure, out: str) -> str:
    """Write ``fig`` as a PNG (parent folders created); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return out


@torch.no_grad()
def cls_attention(model, image: torch.Tensor, *, layer: int = -1, prefix: Optional[str] = None) -> dict:
    """The CLS row of one vision attention layer, as patch grids.

    Args:
        model: a CLIP (``encode_image``) or a bare vision tower (``forward(images)``).
        image: one preprocessed image (3, S, S).
        layer: which vision attention call (python index; -1 = last).
        prefix: keep layers whose name starts with it (default ``visual`` if the model has one).

    Returns:
        ``heads`` (h, g, g), ``mean`` (g, g), ``kind`` (``standard`` / ``diff`` / ``diff_v2``), ``layer`` name.
    """
    if prefix is None:
        prefix = "visual" if hasattr(model, "visual") else ""
    dev = model_device(model)
    with AttentionRecorder(model, include=lambda n: n.startswith(prefix)) as rec:
        x = image[None].to(dev)
        (model.encode_image(x) if hasattr(model, "encode_image") else model(x))
    if not rec.records:
        raise EvalError(f"no attention layer under {prefix!r} was recorded; is this a ViT?")
    r = rec.records[layer]
    maps = r.select_queries(slice(0, 1)).maps()[0, :, 0]  # (h, S): CLS query
    S = maps.shape[-1]
    g = int(math.isqrt(S - 1))
    n_prefix = S - g * g
    if g * g + n_prefix != S or n_prefix < 1:
        raise EvalError(f"{r.name}: {S} tokens do not form CLS + a square patch grid")
    heads = maps[:, n_prefix:].reshape(-1, g, g).float().cpu()
    return {"heads": heads, "mean": heads.mean(0), "kind": r.kind, "layer": r.name}


def _show_image(image) -> np.ndarray:
    """(H, W, 3) floats in [0, 1] from a PIL image or a (3, H, W) tensor (min-max scaled)."""
    if isinstance(image, torch.Tensor):
        a = image.detach().float().cpu().permute(1, 2, 0).numpy()
        return (a - a.min()) / max(a.max() - a.min(), 1e-8)
    return np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0


def plot_attention_maps(image, entries: Mapping[str, dict], out: str, *, max_heads: int = 8, alpha: float = 0.55,
                        title: str = "CLS attention over patches") -> str:
    """One row per model: the image, the head mean and each head, maps upsampled and overlaid.

    Args:
        image: what to draw under the maps (PIL image or (3, H, W) tensor; the model's input size).
        entries: label -> :func:`cls_attention` result.
    """
    img = _show_image(image)
    H, W = img.shape[:2]
    n_cols = 2 + min(max_heads, max(e["heads"].shape[0] for e in entries.values()))
    fig = Figure(figsize=(2.1 * n_cols, 2.3 * len(entries)))
    axes = fig.subplots(len(entries), n_cols, squeeze=False)
    for row, (label, e) in enumerate(entries.items()):
        panels = [("image", None), ("mean", e["mean"])] + [(f"head {i}", m) for i, m in
                                                             enumerate(e["heads"][:max_heads])]
        for col in range(n_cols):
            ax = axes[row, col]
            ax.axis("off")
            if col >= len(panels):
                continue
            name, m = panels[col]
            ax.imshow(img)
            if m is not None:
                up = torch.nn.functional.interpolate(m[None, None], size=(H, W), mode="bilinear",
                                                     align_corners=False)[0, 0].numpy()
                lo, hi = float(m.min()), float(m.max())
                ax.imshow(up, cmap="turbo", vmin=lo, vmax=hi if hi > lo else lo + 1e-8, alpha=alpha)
                name = f"{name} [{lo:.3g}, {hi:.3g}]"
            ax.set_title(f"{label}\n{name}" if col == 0 else name, fontsize=7)
    kinds = {e["kind"] for e in entries.values()}
    note = "; DIFF layers: A1 - lambda*A2 (may be < 0)" if kinds - {"standard"} else ""
    fig.suptitle(f"{title} (each panel scaled to its own [min, max], blue -> red{note})", fontsize=9)
    return save_figure(fig, out)


def plot_needle_attention(results: Mapping[str, Mapping[str, Mapping[float, float]]], out: str, *,
                          title: str = "Multi-needle retrieval") -> str:
    """Grouped bars per depth, one group member per model.

    Args:
        results: label -> {"attention": {depth: share on the answer}, "accuracy": {depth: acc}} (either optional;
            from a :class:`~diffmm.eval.needle.NeedleResult`: its ``attention_by_depth`` and ``accuracy_by_depth``).
    """
    panels = [k for k in ("attention", "accuracy") if any(r.get(k) for r in results.values())]
    if not panels:
        raise EvalError("plot_needle_attention: no attention or accuracy values to draw")
    fig = Figure(figsize=(5.5 * len(panels), 3.6))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, key in zip(axes[0], panels):
        depths = sorted({float(d) for r in results.values() for d in r.get(key, {})})
        width = 0.8 / max(1, len(results))
        for i, (label, r) in enumerate(results.items()):
            vals = {float(d): v for d, v in r.get(key, {}).items()}
            bars = ax.bar(np.arange(len(depths)) + i * width - 0.4 + width / 2,
                          [vals.get(d, np.nan) for d in depths], width, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        ax.set_xticks(np.arange(len(depths)), [f"{100 * d:.0f}%" for d in depths])
        ax.set_xlabel("answer depth in the context")
        ax.set_ylabel("attention share on the answer needle" if key == "attention" else "retrieval accuracy")
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, out)


def read_metrics_csv(path: str) -> dict[str, np.ndarray]:
    """Columns of a CSVLogger ``metrics.csv`` as float arrays (empty cells -> NaN)."""
    if not os.path.isfile(path):
        raise EvalError(f"metrics file not found: {path}")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise EvalError(f"{path}: no rows")
    cols: dict[str, list[float]] = {k: [] for k in rows[0]}
    for r in rows:
        for k in cols:
            try:
                cols[k].append(float(r[k]) if r.get(k) not in (None, "") else math.nan)
            except ValueError:
                cols[k].append(math.nan)
    return {k: np.array(v) for k, v in cols.items()}


def plot_loss_curves(runs: Mapping[str, str], out: str, *, metrics: Optional[Sequence[str]] = None,
                     x: str = "step", log_y: bool = False, title: str = "Loss curves") -> str:
    """One panel per metric (default: every column with ``loss`` in its name), one line per run.

    Args:
        runs: label -> path of a ``metrics.csv`` (or of the folder holding it).
        metrics: columns to draw.
        x: x-axis column (``step``; falls back to the row number).
    """
    data = {}
    for label, path in runs.items():
        if os.path.isdir(path):
            path = os.path.join(path, "metrics.csv")
        data[label] = read_metrics_csv(path)
    if metrics is None:
        metrics = sorted({c for d in data.values() for c in d if "loss" in c.lower()})
    if not metrics:
        raise EvalError(f"no loss columns in {list(runs.values())}; pass metrics=")
    fig = Figure(figsize=(5 * len(metrics), 3.5))
    axes = fig.subplots(1, len(metrics), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for label, d in data.items():
            if m not in d:
                continue
            xs = d.get(x, np.arange(len(d[m])))
            ok = ~np.isnan(d[m]) & ~np.isnan(xs)
            ax.plot(xs[ok], d[m][ok], marker="o" if ok.sum() < 30 else None, ms=3, label=label)
        ax.set_title(m, fontsize=9)
        ax.set_xlabel(x)
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, out)
