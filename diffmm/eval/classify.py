"""Zero-shot labels for your own, unlabelled images (``diffmm classify``): one row per image.

The classifier is the zero-shot one of :func:`diffmm.eval.zeroshot.build_zero_shot_classifier` (prompt ensembling
over the templates); probabilities are ``softmax(logit_scale * cosine)`` over the given labels, with the model's
own (clamped) logit scale. Unreadable images are skipped, counted and reported.
"""
from __future__ import annotations

import csv
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from diffmm.eval.classnames import Template
from diffmm.eval.common import EvalError, markdown_table, model_device
from diffmm.eval.image_sources import ImageFiles, MapSource
from diffmm.eval.zeroshot import build_zero_shot_classifier, encode_images

SHOW_ROWS = 20  # rows printed to the terminal (all of them go to the output file)


@dataclass
class Predictions:
    """Top-k labels and probabilities of each readable image (``files[i]`` <-> ``labels[i]``, ``probs[i]``)."""

    classnames: list[str]
    files: list[str] = field(default_factory=list)
    labels: list[list[str]] = field(default_factory=list)
    probs: list[list[float]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def header(self) -> list[str]:
        k = len(self.labels[0]) if self.labels else 0
        return ["path", *[x for i in range(1, k + 1) for x in (f"label_{i}", f"prob_{i}")]]

    def rows(self) -> list[list]:
        """``[path, label_1, prob_1, ..., label_k, prob_k]`` per image."""
        return [[f, *[x for pair in zip(lab, pr) for x in pair]]
                for f, lab, pr in zip(self.files, self.labels, self.probs)]

    def to_dict(self) -> dict:
        return {"n": len(self.files), "classnames": list(self.classnames),
                "top_k": len(self.labels[0]) if self.labels else 0,
                "predictions": [{"path": f, "labels": lab, "probs": pr}
                                for f, lab, pr in zip(self.files, self.labels, self.probs)],
                "skipped": dict(self.skipped), "seconds": self.seconds}

    def write_csv(self, path: str) -> str:
        """Write :meth:`header` and :meth:`rows` as CSV (atomically: through a temporary file); returns the path."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(self.header())
            w.writerows([f"{v:.6f}" if isinstance(v, float) else v for v in row] for row in self.rows())
        os.replace(tmp, path)
        return path

    def to_markdown(self, limit: int = SHOW_ROWS) -> str:
        rows = [[os.path.basename(r[0]) if len(r[0]) > 60 else r[0],
                 *[f"{v:.3f}" if isinstance(v, float) else v for v in r[1:]]] for r in self.rows()[:limit]]
        out = markdown_table(self.header(), rows)
        if len(self.files) > limit:
            out += f"\n... {len(self.files) - limit} more rows (all in the --out file)\n"
        return out


def logit_scale_of(model) -> float:
    """The model's clamped ``exp(logit_scale)`` (100 when it has none)."""
    if callable(getattr(model, "logit_scale_value", None)):
        return float(model.logit_scale_value())
    scale = getattr(model, "logit_scale", None)
    return min(float(torch.as_tensor(scale).float().exp()), 100.0) if scale is not None else 100.0


@torch.no_grad()
def classify_images(model, tokenizer, preprocess, files: Sequence[str], classnames: Sequence[str],
                    templates: Sequence[Template] | str, *, top_k: int = 5, batch_size: int = 64, num_workers: int = 2,
                    precision: str = "auto", show_progress: bool = True,
                    max_batches: Optional[int] = None) -> Predictions:
    """Top-k zero-shot labels of each image in ``files`` (see the module docstring).

    Args:
        model: a CLIP-like model (``encode_image`` / ``encode_text``).
        tokenizer: ``list[str] -> LongTensor (n, context)``.
        preprocess: PIL image -> tensor (the model's eval preprocess).
        files: image paths (:func:`~diffmm.eval.image_sources.expand_image_inputs`).
        classnames: the labels to choose from.
        templates: prompt templates (see :func:`~diffmm.eval.classnames.get_templates`).
        top_k: labels per image (at most the number of labels).
        batch_size: images per batch.
        num_workers: DataLoader workers.
        precision: see :func:`diffmm.eval.common.autocast`.
        show_progress: show a progress bar.
        max_batches: stop early (smoke runs).
    """
    device = model_device(model)
    classifier = build_zero_shot_classifier(model, tokenizer, list(classnames), templates,
                                            precision="fp32" if precision == "auto" and device.type != "cuda"
                                            else precision).to(device)  # (D, C)
    scale = logit_scale_of(model)
    if not files:
        raise EvalError("no images given")
    files = list(files)  # unreadable images are skipped, counted in source.skipped and logged once
    source = MapSource(ImageFiles([(f, i) for i, f in enumerate(files)], preprocess), batch_size, num_workers,
                       name="images")
    preds = Predictions(list(classnames))
    bar = tqdm(total=len(files), desc="classify", disable=not show_progress, unit="img")
    t0 = time.perf_counter()
    for images, idx in itertools.islice(source, max_batches):
        probs = (scale * encode_images(model, images, precision=precision) @ classifier).softmax(dim=-1)  # (B, C)
        top = probs.topk(max(1, min(top_k, len(classnames))), dim=-1)
        for i, vals, inds in zip(idx.tolist(), top.values.tolist(), top.indices.tolist()):
            preds.files.append(files[i])
            preds.labels.append([classnames[j] for j in inds])
            preds.probs.append(vals)
        bar.update(len(idx))
    bar.update(sum(source.skipped.values()))
    bar.close()
    preds.skipped = dict(source.skipped)
    preds.seconds = time.perf_counter() - t0
    return preds
