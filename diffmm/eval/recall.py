"""Associative recall (MQAR, Zoology) evaluation: accuracy per setting and where the attention goes (the measures,
with their definitions: docs/evaluation.md, "Associative recall (MQAR)").

For every :class:`~diffmm.data.recall.RecallTask` a fixed set of generated sequences is scored: **accuracy** at
the query keys (and ``sequence_accuracy``), and **attention shares** (``measure_attention``): each query row of
the effective attention (``A``; ``A1 - lambda*A2`` for DIFF, :mod:`diffmm.eval.attention_capture`) split into the
queried pair (**answer**), the other pairs (**distractor pairs**) and the **rest**, as ``sum(a[part]) /
sum(|a|)`` summed over the queries (a DIFF row's negative part gives a negative share; the three add up to
``net``). The **retrieval layer** has the largest answer share. Chance levels: ``chance`` = 1/N and
``rank_chance`` (:func:`~diffmm.data.recall.query_order_stats`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from diffmm.data.recall import IGNORE, RecallBatch, RecallTask, eval_batches, query_order_stats, task_grid
from diffmm.eval.attention_capture import AttentionRecord, AttentionRecorder
from diffmm.eval.common import EvalError, markdown_table, model_device
from diffmm.eval.lm_utils import lm_logits
from diffmm.eval.plots import save_figure

PARTS = ("answer", "distractor_pairs", "rest")
ORDER_EXAMPLES = 2048  # sequences per setting behind ``rank_chance``
log = logging.getLogger("diffmm.eval")


@torch.no_grad()
def recall_hits(model: torch.nn.Module, batch: RecallBatch) -> torch.Tensor:
    """Bool (B, Q): whether each query of ``batch`` is answered (argmax = its value), in query order."""
    device = model_device(model)
    mask = (batch.targets != IGNORE).to(device)  # (B, T): the answer positions
    hits = lm_logits(model, batch.inputs.to(device))[mask].argmax(-1) == batch.targets.to(device)[mask]  # (B*Q,)
    # targets are set at query_pos only and query_pos ascends, so the masked order is (b, q) row-major
    return hits.view(len(batch), -1).cpu()


def part_masks(batch: RecallBatch) -> dict[str, torch.Tensor]:
    """Bool (B, Q, T) masks over key positions for each query: answer, distractor pairs, rest."""
    B, T = batch.inputs.shape
    pos = torch.arange(T)
    pair = batch.query_pair[:, :, None]  # (B, Q, 1)
    answer = (pos[None, None] // 2 == pair) & (pos[None, None] < batch.task.context_len)
    in_block = (pos < batch.task.context_len)[None, None].expand_as(answer)
    return {"answer": answer, "distractor_pairs": in_block & ~answer, "rest": ~in_block}


@torch.no_grad()
def attention_mass(model: torch.nn.Module, batch: RecallBatch, *, chunk: int = 8) -> dict[str, np.ndarray]:
    """Attention mass of the query positions on each part, summed over queries: ``{part: (L, h)}``,
    ``total`` (summed row sums) and ``abs_total`` (summed ``sum(|a|)``), all (L, h). Shares are
    ``mass[part] / mass["abs_total"]``."""
    device = model_device(model)
    masks = part_masks(batch)
    out: dict[str, list] = {}
    for lo in range(0, len(batch), chunk):
        hi = min(len(batch), lo + chunk)
        qpos = batch.query_pos[lo:hi].to(device)  # (b, Q)
        m = {k: v[lo:hi].to(device) for k, v in masks.items()}
        layer_sums: list[dict[str, torch.Tensor]] = []

        def take(rec: AttentionRecord, qpos=qpos, m=m, layer_sums=layer_sums) -> None:  # this chunk's, bound now
            a = rec.maps().double()  # (b, h, T, S)
            b_idx = torch.arange(a.shape[0], device=a.device)[:, None]
            rows = a.permute(0, 2, 1, 3)[b_idx, qpos]  # (b, Q, h, S)
            sums = {k: (rows * mk[:, :, None, :]).sum(dim=(0, 1, 3)) for k, mk in m.items()}  # (h,)
            sums["total"] = rows.sum(dim=(0, 1, 3))
            sums["abs_total"] = rows.abs().sum(dim=(0, 1, 3))
            layer_sums.append(sums)

        with AttentionRecorder(model, on_record=take):
            model(batch.inputs[lo:hi].to(device))
        if not layer_sums:
            raise EvalError("recall attention: the model has no attention layer the recorder knows")
        for k in (*PARTS, "total", "abs_total"):
            val = torch.stack([s[k] for s in layer_sums]).cpu().numpy()  # (L, h)
            out.setdefault(k, []).append(val)
    return {k: np.sum(v, axis=0) for k, v in out.items()}


@dataclass
class TaskResult:
    """Scores of one setting."""

    task: dict
    name: str
    accuracy: float
    sequence_accuracy: float
    queries: int
    sequences: int
    attention: dict = field(default_factory=dict)  # part -> per-layer share (mean over heads); "per_head"
    chance: float = 0.0  # 1/N
    rank_chance: float = 0.0  # answering by the query's rank alone (query_order_stats)


@dataclass
class RecallResult:
    """Scores per setting and the model's attention picture (see module doc)."""

    tasks: list[TaskResult]
    seed: int
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        """Mean of the per-setting accuracies."""
        return float(np.mean([t.accuracy for t in self.tasks]))

    def retrieval_layer(self) -> Optional[int]:
        """Layer with the largest answer share (mean over settings), or None without attention."""
        shares = [t.attention["answer"] for t in self.tasks if t.attention]
        return int(np.argmax(np.mean(shares, axis=0))) if shares else None

    def attention_summary(self) -> dict:
        """Shares of each part at the retrieval layer and per layer, mean over settings (empty without attention)."""
        layer = self.retrieval_layer()
        if layer is None:
            return {}
        with_att = [t for t in self.tasks if t.attention]
        keys = (*PARTS, "net")
        per_layer = {p: np.mean([t.attention[p] for t in with_att], axis=0).tolist() for p in keys}
        out = {"retrieval_layer": layer, **{p: per_layer[p][layer] for p in keys}, "per_layer": per_layer}
        # the fraction of what is left after cancellation that lands on the answer (= the answer share of a softmax
        # row; the needle test's row-sum normalisation); None when the net share is not positive
        out["answer_of_net"] = float(out["answer"] / out["net"]) if out["net"] > 0 else None
        return out

    def accuracy_by(self, key: str) -> dict[int, float]:
        """Mean accuracy over the settings sharing each value of ``key`` (``seq_len`` or ``num_pairs``)."""
        groups: dict[int, list[float]] = {}
        for t in self.tasks:
            groups.setdefault(int(t.task[key]), []).append(t.accuracy)
        return {k: float(np.mean(v)) for k, v in sorted(groups.items())}

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, "seed": self.seed, "seconds": self.seconds,
                "chance": float(np.mean([t.chance for t in self.tasks])),
                "rank_chance": float(np.mean([t.rank_chance for t in self.tasks])),
                "accuracy_by_task": {t.name: t.accuracy for t in self.tasks},
                "accuracy_by_seq_len": {str(k): v for k, v in self.accuracy_by("seq_len").items()},
                "accuracy_by_pairs": {str(k): v for k, v in self.accuracy_by("num_pairs").items()},
                "attention": self.attention_summary(), "tasks": [vars(t) for t in self.tasks]}

    def to_markdown(self, name: str = "model") -> str:
        att = self.attention_summary()
        layer = att.get("retrieval_layer")
        headers = ["setting", "seq len", "pairs", "queries", "accuracy", "all queries right", "chance (1/N)",
                   "chance by query rank"]
        if layer is not None:
            headers += [f"answer share (layer {layer})", "distractor pairs", "rest", "net"]
        rows = []
        for t in self.tasks:
            row = [t.name, t.task["seq_len"], t.task["num_pairs"], t.queries, t.accuracy, t.sequence_accuracy,
                   t.chance, t.rank_chance]
            if layer is not None:
                row += [t.attention[p][layer] if t.attention else float("nan") for p in (*PARTS, "net")]
            rows.append(row)
        mean = ["mean", "", "", sum(t.queries for t in self.tasks), self.accuracy,
                float(np.mean([t.sequence_accuracy for t in self.tasks])),
                float(np.mean([t.chance for t in self.tasks])), float(np.mean([t.rank_chance for t in self.tasks]))]
        if layer is not None:
            mean += [att[p] for p in (*PARTS, "net")]
        rows.append(mean)
        sampler = self.tasks[0].task.get("sampler", "diffmm") if self.tasks else "diffmm"
        return (f"Associative recall (MQAR, {sampler} sampling): {name}, seed {self.seed}\n\n"
                + markdown_table(headers, rows, ".3f"))


def evaluate_recall(model: torch.nn.Module, tasks: Sequence[RecallTask], *, examples: int = 256, batch_size: int = 32,
                    seed: int = 0, measure_attention: bool = False, attention_examples: Optional[int] = 64,
                    show_progress: bool = True) -> RecallResult:
    """Score ``model`` on ``examples`` generated sequences per task (the same sequences for every model of a seed).

    Args:
        tasks: settings; their vocabulary must fit the model's.
        examples: sequences per setting.
        batch_size: sequences per forward.
        seed: evaluation-set seed (a stream disjoint from training batches of the same seed).
        measure_attention: also compute the attention shares (on the first ``attention_examples``
            sequences of each setting; None = all).
    """
    if not tasks:
        raise EvalError("recall: give at least one task")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    block = getattr(getattr(model, "config", None), "block_size", None)
    for t in tasks:
        if vocab is not None and t.vocab_size > vocab:
            raise EvalError(f"recall: task vocabulary {t.vocab_size} exceeds the model's vocab_size {vocab}")
        if block is not None and t.seq_len > block:
            raise EvalError(f"recall: seq_len {t.seq_len} exceeds the model's block_size {block}")
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    bar = tqdm(total=len(tasks) * examples, desc="recall", disable=not show_progress, unit="seq")
    results = []
    try:
        for task in tasks:
            hits, mass, seen = [], None, 0
            for batch in eval_batches(task, examples, batch_size, seed):
                hits.append(recall_hits(model, batch))
                if measure_attention and (attention_examples is None or seen < attention_examples):
                    n = len(batch) if attention_examples is None else min(len(batch), attention_examples - seen)
                    sub = RecallBatch(*(x[:n] for x in (batch.inputs, batch.targets, batch.keys, batch.values,
                                                        batch.query_pos, batch.query_pair)), task)
                    m = attention_mass(model, sub)
                    mass = m if mass is None else {k: mass[k] + m[k] for k in m}
                    seen += n
                bar.update(len(batch))
            h = torch.cat(hits)  # (examples, Q)
            att = {}
            if mass is not None:
                share = {p: mass[p] / mass["abs_total"] for p in (*PARTS, "total")}  # (L, h)
                share["net"] = share.pop("total")
                att = {p: share[p].mean(1).tolist() for p in (*PARTS, "net")}
                att["per_head"] = {p: share[p].tolist() for p in (*PARTS, "net")}
            order = query_order_stats(task, ORDER_EXAMPLES, seed)
            results.append(TaskResult(task.to_dict(), task.name, float(h.float().mean()),
                                      float(h.all(1).float().mean()), int(h.numel()), int(h.shape[0]), att,
                                      order["uniform_chance"], order["rank_chance"]))
    finally:
        bar.close()
        model.train(was_training)
    return RecallResult(results, seed, time.perf_counter() - t0)


def tasks_from_grid(vocab_size: int, seq_lens: Iterable[int], num_pairs: Iterable[int], **kwargs) -> list[RecallTask]:
    """Every ``(seq_len, pairs)`` setting that fits (:func:`diffmm.data.recall.task_grid`; the others are logged);
    EvalError when none does."""
    try:
        tasks, skipped = task_grid(vocab_size, seq_lens, num_pairs, **kwargs)
    except ValueError as e:
        raise EvalError(f"recall: {e}") from None
    if skipped:
        log.warning("recall: left out %s (too many pairs for the sequence length or the vocabulary of %d)",
                    ", ".join(skipped), vocab_size)
    return tasks


# ---------------------------------------------------------------------------------------- plot
def plot_recall(results: Mapping[str, dict], out: str, *, title: str = "Associative recall (MQAR)") -> str:
    """Accuracy against the sequence length (one panel per number of pairs, one line per model) and the
    attention shares at each model's retrieval layer (stacked bars).

    Args:
        results: label -> :meth:`RecallResult.to_dict` (or a dict with ``tasks`` (name, task, accuracy,
            optional ``accuracy_std``) and ``attention``), e.g. a mean over seeds.
    """
    pairs = sorted({t["task"]["num_pairs"] for r in results.values() for t in r["tasks"]})
    if not pairs:
        raise EvalError("plot_recall: no results to draw")
    with_att = {k: r["attention"] for k, r in results.items() if r.get("attention")}
    n = len(pairs) + (1 if with_att else 0)
    fig = Figure(figsize=(3.6 * n, 3.4))
    axes = fig.subplots(1, n, squeeze=False)
    for ax, N in zip(axes[0], pairs):
        lens = set()
        for label, r in results.items():
            pts = sorted((t["task"]["seq_len"], t["accuracy"], t.get("accuracy_std") or 0.0)
                         for t in r["tasks"] if t["task"]["num_pairs"] == N)
            if pts:
                x, y, e = map(np.array, zip(*pts))
                lens.update(x.tolist())
                ax.errorbar(x, y, yerr=e, marker="o", ms=3, capsize=2, label=label)
        ax.axhline(1 / N, color="gray", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(lens), [str(v) for v in sorted(lens)])
        ax.minorticks_off()
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("sequence length")
        ax.set_title(f"{N} key-value pairs (dotted: 1/{N})", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("recall accuracy")
    axes[0][0].legend(fontsize=7)
    if with_att:
        ax = axes[0][-1]
        labels = list(with_att)
        colors = {"answer": "tab:green", "distractor_pairs": "tab:orange", "rest": "tab:gray"}
        bottom_pos = np.zeros(len(labels))
        bottom_neg = np.zeros(len(labels))
        for p in PARTS:
            vals = np.array([with_att[k][p] for k in labels])
            base = np.where(vals >= 0, bottom_pos, bottom_neg)
            ax.bar(np.arange(len(labels)), vals, 0.6, bottom=base, color=colors[p], label=p.replace("_", " "))
            bottom_pos += np.clip(vals, 0, None)
            bottom_neg += np.clip(vals, None, 0)
        for i, k in enumerate(labels):
            ax.text(i, bottom_pos[i] + 0.02, f"{with_att[k]['answer']:.2f}", ha="center", fontsize=7)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xticks(np.arange(len(labels)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("attention share at the retrieval layer")
        ax.set_title("where the query attends", fontsize=9)
        ax.set_ylim(min(0.0, bottom_neg.min()) - 0.05, max(1.0, bottom_pos.max()) + 0.12)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.subplots_adjust(wspace=0.35)
    fig.suptitle(title, fontsize=10, y=1.03)
    return save_figure(fig, out)
