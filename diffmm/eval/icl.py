"""In-context-learning order robustness (DIFF Transformer paper, section 3.5).

K demonstrations are drawn once from a labelled set; the same demonstrations are shown in P
different orders. For each order every test example is classified by the label whose text is most
likely after the prompt ``Input: <text>\\nLabel:``; the spread (max - min) and the standard
deviation of accuracy over the orders measure how much the order matters.

Arrangements: ``random`` (random permutations) or ``grouped`` (demonstrations of one class kept
together; the class order is permuted).
"""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from diffmm.eval.common import EvalError, markdown_table
from diffmm.eval.lm_utils import context_limit, score_continuations

Example = tuple[str, str]  # (text, label)


def load_jsonl_examples(path: str, text_key: str = "text", label_key: str = "label") -> list[Example]:
    """``{"text": ..., "label": ...}`` lines (labels are turned into strings)."""
    if not os.path.isfile(path):
        raise EvalError(f"ICL data file not found: {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append((str(row[text_key]), str(row[label_key])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise EvalError(f"{path}:{n}: expected a JSON object with {text_key!r} and {label_key!r} "
                                f"({type(e).__name__}: {e})") from None
    if not out:
        raise EvalError(f"{path}: no examples")
    return out


@dataclass
class ICLConfig:
    """Settings: ``shots`` demonstrations, ``orders`` arrangements, prompt formats."""

    shots: int = 8
    orders: int = 10
    arrangement: str = "random"
    example_format: str = "Input: {text}\nLabel: {label}\n\n"
    query_format: str = "Input: {text}\nLabel:"
    label_prefix: str = " "
    seed: int = 0
    batch_size: int = 16

    def __post_init__(self):
        if self.arrangement not in ("random", "grouped"):
            raise EvalError(f"ICL arrangement {self.arrangement!r}; expected random or grouped")
        if self.shots < 1 or self.orders < 1:
            raise EvalError(f"ICL needs shots >= 1 and orders >= 1; got {self.shots}, {self.orders}")


@dataclass
class ICLResult:
    labels: list[str]
    accuracies: list[float]
    orders: list[list[str]] = field(default_factory=list)  # demonstration labels in prompt order, per order
    config: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def summary(self) -> dict:
        a = np.array(self.accuracies)
        return {"mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()), "max": float(a.max()),
                "spread": float(a.max() - a.min())}

    def to_dict(self) -> dict:
        return {**asdict(self), **self.summary}

    def to_markdown(self, name: str = "model") -> str:
        s = self.summary
        return markdown_table(["model", "orders", "mean acc (%)", "std", "min", "max", "spread (max-min)"],
                              [[name, len(self.accuracies), 100 * s["mean"], 100 * s["std"], 100 * s["min"],
                                100 * s["max"], 100 * s["spread"]]])


def pick_demonstrations(train: Sequence[Example], k: int, rng: random.Random) -> list[Example]:
    """K demonstrations, as balanced over the labels as K allows: the first example of every label (in sorted
    label order), then the second, ..., each label's examples shuffled with ``rng``."""
    if k > len(train):
        raise EvalError(f"ICL: {k} demonstrations requested but the training set has {len(train)} examples")
    by_label: dict[str, list[Example]] = {}
    for ex in train:
        by_label.setdefault(ex[1], []).append(ex)
    for lab in sorted(by_label):
        rng.shuffle(by_label[lab])
    ranked = [(j, ex) for lab in sorted(by_label) for j, ex in enumerate(by_label[lab])]
    return [ex for _, ex in sorted(ranked, key=lambda r: r[0])[:k]]


def arrangements(demos: list[Example], cfg: ICLConfig, rng: random.Random) -> list[list[Example]]:
    """``cfg.orders`` orders of the demonstrations (distinct where possible)."""
    out, seen = [], set()
    labels = sorted({lab for _, lab in demos})
    for _ in range(cfg.orders * 20):
        if cfg.arrangement == "random":
            order = list(demos)
            rng.shuffle(order)
        else:
            cls = list(labels)
            rng.shuffle(cls)
            order = [d for c in cls for d in demos if d[1] == c]
        key = tuple(order)
        if key not in seen:
            seen.add(key)
            out.append(order)
        if len(out) == cfg.orders:
            break
    return out


def icl_order_robustness(model, tokenizer, train: Sequence[Example], test: Sequence[Example], cfg: ICLConfig,
                         *, show_progress: bool = True) -> ICLResult:
    """Accuracy of the same K demonstrations in ``cfg.orders`` orders (see module doc)."""
    rng = random.Random(cfg.seed)
    labels = sorted({lab for _, lab in train})
    unknown = sorted({lab for _, lab in test} - set(labels))
    if unknown:
        raise EvalError(f"ICL: test labels {unknown[:5]} never occur in the demonstration pool")
    demos = pick_demonstrations(train, cfg.shots, rng)
    orders = arrangements(demos, cfg, rng)
    label_ids = [tokenizer.encode(cfg.label_prefix + lab) for lab in labels]
    limit = context_limit(model)
    accs = []
    t0 = time.perf_counter()
    for order in tqdm(orders, desc="ICL orders", disable=not show_progress, unit="order"):
        prefix = "".join(cfg.example_format.format(text=t, label=lab) for t, lab in order)
        contexts, conts = [], []
        for text, _ in test:
            ctx = tokenizer.encode(prefix + cfg.query_format.format(text=text))
            if limit is not None and len(ctx) + max(map(len, label_ids)) > limit:
                raise EvalError(f"ICL: a prompt has {len(ctx)} tokens; the model takes {limit}. Use fewer shots")
            for ids in label_ids:
                contexts.append(ctx)
                conts.append(ids)
        scores = [s for s, _ in score_continuations(model, contexts, conts, batch_size=cfg.batch_size)]
        scores = np.array(scores).reshape(len(test), len(labels))
        pred = [labels[i] for i in scores.argmax(1)]
        accs.append(float(np.mean([p == lab for p, (_, lab) in zip(pred, test)])))
    return ICLResult(labels, accs, [[lab for _, lab in o] for o in orders], asdict(cfg), time.perf_counter() - t0)
