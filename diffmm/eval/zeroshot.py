"""Zero-shot image classification with any model that has open_clip's ``encode_image`` / ``encode_text``.

    classifier = build_zero_shot_classifier(model, tokenizer, classnames, templates)   # (D, C)
    result = evaluate_zero_shot(model, classifier, source)                             # streams batches
    print(result.to_markdown())

The classifier of class c is the normalised mean of the normalised text embeddings of all its
prompts (CLIP's prompt ensembling). Evaluation keeps only a C x C confusion matrix and top-k
counts, so memory does not grow with the number of images.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from diffmm.eval.classnames import Template, fill_template, get_templates
from diffmm.eval.common import EvalError, autocast, markdown_table, model_device


@torch.no_grad()
def encode_texts(model, tokenizer, texts: Sequence[str], *, device: torch.device | None = None,
                 batch_size: int = 256, precision: str = "fp32") -> torch.Tensor:
    """L2-normalised text embeddings (len(texts), D), fp32."""
    device = device or model_device(model)
    out = []
    for i in range(0, len(texts), batch_size):
        tokens = torch.as_tensor(tokenizer(list(texts[i:i + batch_size]))).to(device)
        with autocast(device, precision):
            feats = model.encode_text(tokens)
        out.append(F.normalize(feats.float(), dim=-1))
    return torch.cat(out)


@torch.no_grad()
def encode_images(model, images: torch.Tensor, *, precision: str = "fp32") -> torch.Tensor:
    """L2-normalised image embeddings (B, D), fp32."""
    device = model_device(model)
    with autocast(device, precision):
        feats = model.encode_image(images.to(device, non_blocking=True))
    return F.normalize(feats.float(), dim=-1)


@torch.no_grad()
def build_zero_shot_classifier(model, tokenizer, classnames: Sequence[str], templates: Sequence[Template] | str,
                               *, device: torch.device | None = None, classes_per_batch: int = 10,
                               precision: str = "fp32") -> torch.Tensor:
    """Classifier weights (D, C): per class, the normalised mean of its normalised prompt embeddings.

    Args:
        model: anything with ``encode_text(tokens)``.
        tokenizer: ``list[str] -> LongTensor (n, context)``.
        classnames: C names.
        templates: prompt templates (``{}`` marks the name) or a built-in name (``openai``, ``simple``).
        classes_per_batch: classes whose prompts are encoded in one forward.
    """
    templates = get_templates(templates)
    if not classnames:
        raise EvalError("the class name list is empty")
    device = device or model_device(model)
    T = len(templates)
    columns = []
    for start in range(0, len(classnames), classes_per_batch):
        names = classnames[start:start + classes_per_batch]
        texts = [fill_template(t, c) for c in names for t in templates]
        emb = encode_texts(model, tokenizer, texts, device=device, batch_size=len(texts), precision=precision)
        emb = emb.view(len(names), T, -1).mean(dim=1)  # (c, D)
        columns.append(F.normalize(emb, dim=-1))
    return torch.cat(columns).T.contiguous()  # (D, C)


@dataclass
class ZeroShotResult:
    """Counts of a zero-shot run. ``confusion[i, j]`` = images of true class i predicted as j."""

    classnames: list[str]
    confusion: np.ndarray
    topk_correct: dict[int, int]
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def n(self) -> int:
        return int(self.confusion.sum())

    def topk(self, k: int) -> float:
        """Top-k accuracy in [0, 1]."""
        return self.topk_correct[k] / self.n if self.n else math.nan

    @property
    def top1(self) -> float:
        return self.topk(1)

    @property
    def top5(self) -> float:
        return self.topk(5)

    @property
    def per_class_accuracy(self) -> list[float]:
        """Accuracy of each true class (NaN for classes without images)."""
        support = self.confusion.sum(axis=1)
        return [float(self.confusion[i, i] / s) if s else math.nan for i, s in enumerate(support)]

    @property
    def mean_per_class_accuracy(self) -> float:
        accs = [a for a in self.per_class_accuracy if not math.isnan(a)]
        return float(np.mean(accs)) if accs else math.nan

    def to_dict(self) -> dict:
        return {
            "n": self.n, **{f"top{k}": self.topk(k) for k in sorted(self.topk_correct)},
            "mean_per_class_accuracy": self.mean_per_class_accuracy,
            "per_class": {name: {"accuracy": acc, "support": int(s)} for name, acc, s in
                          zip(self.classnames, self.per_class_accuracy, self.confusion.sum(axis=1))},
            "classnames": list(self.classnames),
            "confusion_matrix": self.confusion.tolist(),
            "skipped": dict(self.skipped), "seconds": self.seconds,
        }

    def to_markdown(self, title: str = "Zero-shot classification", max_confusion: int = 20) -> str:
        rows = [["images", self.n]] + [[f"top-{k} (%)", 100 * self.topk(k)] for k in sorted(self.topk_correct)]
        rows += [["mean per-class accuracy (%)", 100 * self.mean_per_class_accuracy],
                 ["skipped", sum(self.skipped.values())]]
        out = f"## {title}\n\n" + markdown_table(["metric", "value"], rows)
        support = self.confusion.sum(axis=1)
        out += "\n### Per class\n\n" + markdown_table(
            ["class", "images", "accuracy (%)"],
            [[c, int(s), 100 * a] for c, s, a in zip(self.classnames, support, self.per_class_accuracy)])
        if len(self.classnames) <= max_confusion:
            out += "\n### Confusion matrix (rows: true, columns: predicted)\n\n" + markdown_table(
                ["true \\ pred", *range(len(self.classnames))],
                [[f"{i} {c}", *map(int, self.confusion[i])] for i, c in enumerate(self.classnames)])
        return out


@torch.no_grad()
def evaluate_zero_shot(model, classifier: torch.Tensor, source: Iterable, *, classnames: Sequence[str] | None = None,
                       topk: Sequence[int] = (1, 5), precision: str = "auto", show_progress: bool = True,
                       max_batches: int | None = None) -> ZeroShotResult:
    """Stream ``(images, labels)`` batches through the model and count hits.

    Args:
        classifier: (D, C) from :func:`build_zero_shot_classifier`.
        source: iterable of ``(images (B,3,S,S), labels (B,))``; if it has ``skipped`` / ``num_samples``
            attributes (the sources of :mod:`diffmm.eval.image_sources`), they are used.
        classnames: names for the report (default ``class0..``).
        topk: the k of the top-k accuracies (clamped to C).
        precision: see :func:`diffmm.eval.common.autocast`.
        max_batches: stop early (smoke runs).
    """
    device = model_device(model)
    classifier = classifier.to(device, torch.float32)
    C = classifier.shape[1]
    names = list(classnames) if classnames is not None else [f"class{i}" for i in range(C)]
    if len(names) != C:
        raise EvalError(f"{len(names)} class names for a classifier of {C} classes")
    confusion = torch.zeros(C * C, dtype=torch.long)
    ks = sorted(set(topk))
    correct = dict.fromkeys(ks, 0)
    total, per_batch = getattr(source, "num_samples", None), getattr(source, "batch_size", None)
    if total and max_batches is not None and per_batch:  # the bar ends where max_batches stops
        total = min(total, max_batches * per_batch)
    bar = tqdm(total=total, desc="zero-shot", disable=not show_progress, unit="img")
    t0 = time.perf_counter()
    for images, labels in itertools.islice(source, max_batches):
        labels = labels.to(device)
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= C):
            bad = int(labels.max()) if int(labels.max()) >= C else int(labels.min())
            raise EvalError(f"label {bad} in {getattr(source, 'name', 'the data')} is out of range for {C} class "
                            f"names; give one class name per label")
        logits = encode_images(model, images, precision=precision) @ classifier  # (B, C)
        ranked = logits.topk(min(max(ks), C), dim=1).indices  # (B, kmax)
        hit = ranked == labels[:, None]
        for k in ks:
            correct[k] += int(hit[:, :k].any(dim=1).sum())
        confusion += torch.bincount((labels * C + ranked[:, 0]).cpu(), minlength=C * C)
        bar.update(len(labels))
    bar.close()
    skipped = dict(getattr(source, "skipped", {}))
    if not int(confusion.sum()):
        why = ("skipped: " + ", ".join(f"{k} {v}" for k, v in skipped.items()) + "; the first of each kind is logged"
               if skipped else "the source gave no images")
        raise EvalError(f"zero-shot on {getattr(source, 'name', 'the data')}: no image was scored ({why})")
    return ZeroShotResult(names, confusion.view(C, C).numpy(), correct, skipped, time.perf_counter() - t0)


def zero_shot(model, tokenizer, source: Iterable, classnames: Sequence[str], templates: Sequence[Template] | str,
              **kwargs) -> ZeroShotResult:
    """:func:`build_zero_shot_classifier` then :func:`evaluate_zero_shot` (kwargs go to the latter)."""
    classifier = build_zero_shot_classifier(model, tokenizer, classnames, templates,
                                            precision=kwargs.get("precision", "fp32"))
    return evaluate_zero_shot(model, classifier, source, classnames=classnames, **kwargs)
