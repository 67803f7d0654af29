"""The report's pictures: loss curves, CLS attention maps of both CLIP models, lambda per layer, needle attention.

Loss curves, attention maps and needle bars are drawn by ``diffmm.eval.plots``; this module picks
what goes into them and draws the lambda-per-layer panel itself.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from typing import Mapping, Sequence

import numpy as np

from diffmm.demo.evaluate import clip_tools


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def loss_curves(runs: Mapping[str, Mapping[int, str]], out: str, title: str, metric: str = "train/loss") -> str:
    """``metric`` against step: every run thin, the mean over seeds thick, one colour per model.

    Args:
        runs: model label -> seed -> path of the run's CSVLogger ``metrics.csv``.
    """
    from diffmm.eval.plots import read_metrics_csv

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (label, seeds) in enumerate(runs.items()):
        color = f"C{i}"
        curves = []
        for seed, path in sorted(seeds.items()):
            cols = read_metrics_csv(path)
            x, y = cols.get("step"), cols.get(metric)
            if x is None or y is None:
                continue
            ok = ~np.isnan(x) & ~np.isnan(y)
            ax.plot(x[ok], y[ok], color=color, alpha=0.3, lw=0.8)
            curves.append(dict(zip(x[ok].astype(int).tolist(), y[ok].tolist())))
        if curves:
            steps = sorted(set.intersection(*[set(c) for c in curves]))
            mean = [np.mean([c[s] for c in curves]) for s in steps]
            ax.plot(steps, mean, color=color, lw=2, label=f"{label} (mean of {len(curves)} seed(s))")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title + " (thin: single seeds)", fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def holdout_images(paths: Sequence[str], n: int) -> list[tuple[str, object]]:
    """The first ``n`` (name, PIL image) pairs of the held-out style's shards."""
    from PIL import Image

    out: list[tuple[str, object]] = []
    for p in paths:
        with tarfile.open(p) as tf:
            members: dict[str, dict[str, bytes]] = {}
            for m in tf:
                if not m.isfile() or "." not in m.name:
                    continue
                key, ext = m.name.split(".", 1)
                members.setdefault(key, {})[ext] = tf.extractfile(m).read()
                sample = members[key]
                if "png" in sample and "json" in sample:
                    name = json.loads(sample.pop("json"))["name"]
                    img = Image.open(io.BytesIO(sample.pop("png"))).convert("RGB")
                    out.append((name, img))
                    if len(out) >= n:
                        return out
    return out


def attention_maps(models: Mapping[str, object], images: Sequence[tuple[str, object]], out_dir: str) -> list[str]:
    """One PNG per image: the last vision layer's CLS attention of every model, per head and averaged."""
    import torch

    from diffmm.eval.plots import cls_attention, plot_attention_maps

    files = []
    for i, (name, img) in enumerate(images):
        entries, shown = {}, None
        for label, model in models.items():
            transform, _ = clip_tools(model)
            x = transform(img)  # (3, S, S)
            with torch.no_grad():
                entries[label] = cls_attention(model, x)
            shown = img.resize((4 * x.shape[-1], 4 * x.shape[-1]))
        path = os.path.join(out_dir, f"attention_{i}.png")
        files.append(plot_attention_maps(shown, entries, path, title=f"'{name}' (held-out style): CLS attention, "
                                                                        f"last vision layer"))
    return files


def lambda_per_layer(after: Mapping[str, Mapping[int, Mapping[str, float]]],
                     start: Mapping[str, Mapping[int, Mapping[str, float]]],
                     init: Mapping[str, Mapping[str, float]], out: str) -> str:
    """lambda of every differential layer after training and at step 0 (means over seeds, bars = std),
    and the constant lambda_init it is built around.

    Args:
        after, start: model label -> seed -> layer name -> lambda (after training / before the first step).
        init: model label -> layer name -> lambda_init.
    """
    plt = _plt()
    fig, axes = plt.subplots(1, len(after), figsize=(5.5 * len(after), 3.6), squeeze=False)
    for ax, (label, per_seed) in zip(axes[0], after.items()):
        layers = list(next(iter(per_seed.values())))
        x = np.arange(len(layers))
        for values, fmt, name in ((start.get(label, {}), "s:", "step 0"), (per_seed, "o-", "after training")):
            if not values:
                continue
            vals = np.array([[values[s].get(n, np.nan) for n in layers] for s in sorted(values)])  # (seeds, L)
            std = vals.std(0, ddof=1) if vals.shape[0] > 1 else np.zeros(len(layers))
            ax.errorbar(x, vals.mean(0), yerr=std, fmt=fmt, capsize=3, label=f"{name} ({vals.shape[0]} seeds)")
        ax.plot(x, [init.get(label, {}).get(n, np.nan) for n in layers], "x--", color="gray", label="lambda_init")
        ax.set_xticks(x, [_short(n) for n in layers], rotation=45, fontsize=7)
        ax.set_ylabel("lambda")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Differential attention: lambda per layer", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def _short(name: str) -> str:
    """``visual.blocks.3.attn`` -> ``visual 3``; ``transformer.resblocks.0.attn`` -> ``text 0``; ``blocks.2.attn`` -> ``2``."""
    parts = name.split(".")
    idx = next((p for p in parts if p.isdigit()), "?")
    tower = {"visual": "vision", "transformer": "text"}.get(parts[0], "")
    return f"{tower} {idx}".strip()


def needle_bars(results: Mapping[str, Mapping[str, Mapping[str, float]]], out: str) -> str:
    """Accuracy and attention share on the answer per depth (means over seeds), one bar per model."""
    from diffmm.eval.plots import plot_needle_attention

    return plot_needle_attention({k: {kind: {float(d): v for d, v in r.get(kind, {}).items()}
                                      for kind in ("attention", "accuracy")} for k, r in results.items()}, out,
                                 title="Multi-needle retrieval (tiny LMs, means over seeds)")
