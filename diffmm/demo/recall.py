"""Associative recall (MQAR) runs: Transformer vs DIFF V1 vs DIFF V2 at equal parameters, and their aggregation.

One run = one attention type at one width and seed: a parameter-matched ``DiffLM``
(:func:`diffmm.train.recall_run.matched_lm_kwargs`) trained on generated recall data
(:func:`diffmm.train.recall_run.train_recall`), then scored by :func:`diffmm.eval.recall.evaluate_recall`
on a fixed evaluation set of that seed. Runs of the same seed see the same training batches and the
same evaluation sequences, so differences between attention types are paired by seed.

Used by the demo's recall section and by ``scripts/recall_compare.py`` (the longer comparison).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from diffmm.demo.summary import Metric, fmt, fmt_delta, mean_std, paired, summarize

VARIANTS = ("standard", "diff", "diff_v2")
LABELS = {"standard": "Transformer", "diff": "DIFF V1", "diff_v2": "DIFF V2",
          "diff_lambda_constant": "DIFF V1, lambda_init 0.8"}


@dataclass
class RecallStudy:
    """Settings shared by every run of a comparison (flat, JSON-able).

    Attributes:
        variants: attention types compared (the first is the baseline of the paired differences).
        widths: model widths E; ``heads`` standard heads each (DIFF V1: heads/2 differential heads).
        layers: decoder blocks.
        vocab: task vocabulary (= model vocabulary).
        train_seq_lens, train_pairs: training grid (settings that do not fit are left out).
        eval_seq_lens, eval_pairs: evaluation grid.
        noise: distractor level of training and evaluation data.
        steps, batch_size, batch_tokens, lr, min_lr, warmup, weight_decay: training budget and recipe;
            ``steps_per_width`` (one per width) replaces ``steps`` (wider models cost more per step).
        examples: evaluation sequences per setting; attention_examples: of which used for attention shares.
        lambda_init: DIFF V1's ``LMConfig.lambda_init`` (``depth``: the paper's schedule; ``constant``: 0.8).
    """

    variants: tuple[str, ...] = VARIANTS
    widths: tuple[int, ...] = (64,)
    heads: int = 4
    layers: int = 2
    vocab: int = 64
    train_seq_lens: tuple[int, ...] = (64,)
    train_pairs: tuple[int, ...] = (2, 4, 8)
    eval_seq_lens: tuple[int, ...] = (64, 128)
    eval_pairs: tuple[int, ...] = (2, 4, 8)
    noise: float = 1.0
    steps: int = 200
    steps_per_width: Optional[tuple[int, ...]] = None
    batch_size: int = 32
    batch_tokens: Optional[int] = None
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    examples: int = 64
    attention_examples: int = 16
    lambda_init: str = "depth"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def block_size(self) -> int:
        return max(max(self.train_seq_lens), max(self.eval_seq_lens))

    def steps_for(self, width: int) -> int:
        """Training steps of the models of ``width``."""
        if self.steps_per_width is None:
            return self.steps
        if len(self.steps_per_width) != len(self.widths) or width not in self.widths:
            raise ValueError(f"steps_per_width {self.steps_per_width} needs one entry per width {self.widths}")
        return int(self.steps_per_width[list(self.widths).index(width)])


def evaluate_one(study: RecallStudy, model, seed: int) -> dict[str, Any]:
    """The evaluation part of a run record (:meth:`RecallResult.to_dict` on the study's evaluation grid)."""
    from diffmm.data.recall import task_grid
    from diffmm.eval.recall import evaluate_recall

    eval_tasks, _ = task_grid(study.vocab, study.eval_seq_lens, study.eval_pairs, noise=study.noise)
    return evaluate_recall(model, eval_tasks, examples=study.examples, seed=seed, measure_attention=True,
                           attention_examples=study.attention_examples, show_progress=False).to_dict()


def run_one(study: RecallStudy, variant: str, width: int, seed: int, *, print_progress: bool = True,
            save_model: Optional[str] = None) -> dict[str, Any]:
    """Train and score one model; returns the run record (JSON-able). ``save_model``: also write
    ``{"model_kwargs", "state_dict"}`` there (``torch.save``), for :func:`evaluate_one` later."""
    from diffmm.data.recall import task_grid
    from diffmm.train.recall_run import RecallTrainConfig, matched_lm_kwargs, param_counts, train_recall

    extra = {"lambda_init": study.lambda_init} if variant == "diff" and study.lambda_init != "depth" else {}
    kwargs = matched_lm_kwargs(variant, width, study.heads, study.layers, study.vocab, study.block_size, **extra)
    train_tasks, _ = task_grid(study.vocab, study.train_seq_lens, study.train_pairs, noise=study.noise)
    steps = study.steps_for(width)
    cfg = RecallTrainConfig(train_tasks, steps=steps, batch_size=study.batch_size, batch_tokens=study.batch_tokens,
                            lr=study.lr, min_lr=study.min_lr, warmup=min(study.warmup, max(1, steps // 10)),
                            weight_decay=study.weight_decay, log_every=max(1, steps // 50))
    label = f"{LABELS.get(variant, variant)} w{width} seed {seed}"
    run = train_recall(kwargs, cfg, seed, label=label, print_progress=print_progress)
    if save_model:
        import os

        from diffmm.hub.checkpoint import atomic_save

        os.makedirs(os.path.dirname(os.path.abspath(save_model)), exist_ok=True)
        atomic_save({"model_kwargs": kwargs, "state_dict": run.model.state_dict()}, save_model)
    return {"variant": variant, "width": width, "heads": study.heads, "layers": study.layers, "seed": seed,
            "params": param_counts(kwargs), "model_kwargs": kwargs, "train": run.summary(),
            "eval": evaluate_one(study, run.model, seed)}


def load_saved_model(path: str):
    """The ``DiffLM`` written by :func:`run_one` (``save_model``)."""
    import torch

    from diffmm.models.lm import DiffLM, LMConfig

    d = torch.load(path, map_location="cpu", weights_only=True)
    model = DiffLM(LMConfig(**d["model_kwargs"]))
    model.load_state_dict(d["state_dict"])
    return model.eval()


# ---------------------------------------------------------------------------------- aggregation
BASE_METRICS: tuple[Metric, ...] = (
    Metric("accuracy", "recall accuracy %", ("eval", "accuracy"), True, True, 1),
    Metric("answer_share", "attention: answer %", ("eval", "attention", "answer"), True, True, 1),
    Metric("distractor_share", "attention: distractor pairs %", ("eval", "attention", "distractor_pairs"),
           False, True, 1),
    Metric("rest_share", "attention: rest %", ("eval", "attention", "rest"), False,
           True, 1),
    Metric("train_loss", "train answer loss", ("train", "final_train_loss"), False, digits=3),
    Metric("net_share", "attention: net %", ("eval", "attention", "net"), None, True, 1),
    Metric("answer_of_net", "answer / net %", ("eval", "attention", "answer_of_net"), True,
           True, 1),
    Metric("seconds", "train seconds (loaded machine)", ("train", "seconds"), None, digits=0),
)


def recall_metrics(runs: Sequence[dict]) -> tuple[Metric, ...]:
    """The base metrics plus accuracy per sequence length, per pair count and per setting."""
    first = next((r for r in runs if r.get("eval")), None)
    if first is None:
        return BASE_METRICS
    ev = first["eval"]
    extra = [Metric(f"acc_len{k}", f"accuracy at sequence length {k} %", ("eval", "accuracy_by_seq_len", k), True,
                    True, 1) for k in ev.get("accuracy_by_seq_len", {})]
    extra += [Metric(f"acc_pairs{k}", f"accuracy with {k} pairs %", ("eval", "accuracy_by_pairs", k), True, True, 1)
              for k in ev.get("accuracy_by_pairs", {})]
    extra += [Metric(f"acc_task_{k}", f"accuracy {k} %", ("eval", "accuracy_by_task", k), True, True, 1)
              for k in ev.get("accuracy_by_task", {})]
    return BASE_METRICS + tuple(extra)


def aggregate(runs: Sequence[dict], baseline: str = "standard") -> dict[str, Any]:
    """Per width: params, mean ± std per attention type, paired differences (each type - ``baseline``, and
    ``diff_v2 - diff``) over the seeds both have. Keys are strings (JSON)."""
    from diffmm.eval.recall import answer_of_net

    metrics = recall_metrics(runs)
    for r in runs:  # records written before answer_of_net existed
        att = (r.get("eval") or {}).get("attention")
        if att and "answer_of_net" not in att:
            att["answer_of_net"] = answer_of_net(att)
    out: dict[str, Any] = {"baseline": baseline, "widths": {}}
    widths = sorted({int(r["width"]) for r in runs})
    for w in widths:
        by: dict[str, dict[int, dict]] = {}
        for r in runs:
            if int(r["width"]) == w:
                by.setdefault(r["variant"], {})[int(r["seed"])] = r
        variants = [v for v in VARIANTS if v in by] + sorted(set(by) - set(VARIANTS))
        entry: dict[str, Any] = {
            "variants": variants, "seeds": {v: sorted(by[v]) for v in variants},
            "params": {v: next(iter(by[v].values()))["params"] for v in variants},
            "summary": {v: summarize(by[v], metrics) for v in variants}, "paired": {}}
        pairs = [(v, baseline) for v in variants if v != baseline and baseline in by]
        if "diff" in by and "diff_v2" in by:
            pairs.append(("diff_v2", "diff"))
        for v, b in pairs:
            entry["paired"][f"{v} - {b}"] = paired(by[b], by[v], metrics)
        out["widths"][str(w)] = entry
    out["metrics"] = [asdict(m) for m in metrics]
    return out


def _m(agg: dict) -> dict[str, Metric]:
    return {d["key"]: Metric(**{**d, "path": tuple(d["path"])}) for d in agg["metrics"]}


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _wins(p: dict) -> str:
    return "" if p.get("wins") is None or not p.get("n") else f" ({p['wins']}/{p['n']})"


def _chance(key: str) -> str:
    import re

    n = re.search(r"-N(\d+)", key)
    return f"{100 / int(n.group(1)):.1f}" if n else ""


def recall_markdown(agg: dict, *, per_setting: bool = True) -> str:
    """Tables of :func:`aggregate`: per width the models (mean ± std over seeds), the paired differences
    (with on how many seeds the first-named model is better) and, optionally, accuracy per setting."""
    m = _m(agg)
    md = []
    for w, e in agg["widths"].items():
        names = [LABELS.get(v, v) for v in e["variants"]]
        seeds = sorted({s for v in e["variants"] for s in e["seeds"][v]})
        md.append(f"**Width {w}** (seeds {', '.join(map(str, seeds))}; mean ± std over seeds)\n")
        cols = ["accuracy", "answer_share", "distractor_share", "rest_share", "net_share", "answer_of_net",
                "train_loss", "seconds"]
        rows = []
        for v, name in zip(e["variants"], names):
            p = e["params"][v]
            rows.append([name, f"{p['total']:,} / {p['non_embedding']:,}"]
                        + [fmt(e["summary"][v].get(k, {}), m[k]) for k in cols])
        md.append(_table(["model", "params (total / non-embedding)"] + [m[k].label for k in cols], rows))
        md.append("\nRecall accuracy: mean over the evaluation settings. Attention: the query's attention at the "
                  "retrieval layer, as shares of its absolute mass sum(|a|) on the queried pair (answer), the other "
                  "pairs and the rest; net = sum(a) / sum(|a|) (100 % for softmax; less where a DIFF map cancels); "
                  "answer / net = the answer's share of what is left after cancellation. Train answer loss: the "
                  "last 10 % of training.\n")
        if e["paired"]:
            pcols = ["accuracy", "answer_share", "distractor_share", "answer_of_net", "train_loss"]
            rows = []
            for name, p in e["paired"].items():
                a, b = name.split(" - ")
                rows.append([f"{LABELS.get(a, a)} − {LABELS.get(b, b)}"]
                            + [fmt_delta(p.get(k, {}), m[k]) + _wins(p.get(k, {})) for k in pcols])
            md.append("\nPaired differences (same seed, same data; in brackets: seeds on which the first model "
                      "is better):\n\n" + _table(["comparison"] + [m[k].label for k in pcols], rows))
        if per_setting:
            keys = [k for k in m if k.startswith("acc_task_")]
            keys = [k for k in keys if any(k in e["summary"][v] for v in e["variants"])]
            if keys:
                rows = [[k[len("acc_task_"):]] + [fmt(e["summary"][v].get(k, {}), m[k]) for v in e["variants"]]
                        + [_chance(k)] for k in keys]
                md.append("\nRecall accuracy % per setting (L = sequence length, N = pairs; chance: one of the N "
                          "values at random):\n\n" + _table(["setting"] + names + ["chance"], rows))
        md.append("")
    return "\n".join(md)


def plot_input(agg: dict, width: str, runs: Sequence[dict]) -> dict[str, dict]:
    """Per attention type at ``width``: mean accuracy per setting (with std) and mean attention shares, in the
    form :func:`diffmm.eval.recall.plot_recall` draws."""
    out = {}
    e = agg["widths"][width]
    for v in e["variants"]:
        rs = [r for r in runs if str(r["width"]) == width and r["variant"] == v and r.get("eval")]
        if not rs:
            continue
        tasks = []
        for t in rs[0]["eval"]["tasks"]:
            s = mean_std([x["accuracy"] for r in rs for x in r["eval"]["tasks"] if x["name"] == t["name"]])
            tasks.append({"task": t["task"], "name": t["name"], "accuracy": s["mean"], "accuracy_std": s["std"]})
        att = {}
        if all(r["eval"].get("attention") for r in rs):
            att = {p: mean_std([r["eval"]["attention"][p] for r in rs])["mean"]
                   for p in ("answer", "distractor_pairs", "rest") if all(p in r["eval"]["attention"] for r in rs)}
        out[f"{LABELS.get(v, v)} w{width}"] = {"tasks": tasks, "attention": att}
    return out



# ------------------------------------------------------------------------------------------ demo
def study_from_demo(cfg) -> RecallStudy:
    """The :class:`RecallStudy` of a :class:`~diffmm.demo.config.DemoConfig` (its ``recall_*`` fields)."""
    return RecallStudy(variants=tuple(cfg.recall_variants), widths=(cfg.recall_width,), heads=cfg.recall_heads,
                       layers=cfg.recall_layers, vocab=cfg.recall_vocab,
                       train_seq_lens=tuple(cfg.recall_train_seq_lens), train_pairs=tuple(cfg.recall_train_pairs),
                       eval_seq_lens=tuple(cfg.recall_eval_seq_lens), eval_pairs=tuple(cfg.recall_eval_pairs),
                       noise=cfg.recall_noise, steps=cfg.recall_steps, batch_tokens=cfg.recall_batch_tokens,
                       lr=cfg.recall_lr, min_lr=cfg.recall_lr / 10, warmup=max(1, cfg.recall_steps // 20),
                       examples=cfg.recall_examples, attention_examples=min(32, cfg.recall_examples))


def run_demo_part(demo) -> None:
    """The demo's recall section: one step per (seed, attention type), then the plot; results under
    ``demo.results["recall"]`` (runs, aggregate), re-aggregated after every run."""
    import os

    cfg = demo.cfg
    study = study_from_demo(cfg)
    part = demo.results.setdefault("recall", {"study": study.to_dict(), "runs": {}, "aggregate": {}})
    flat: list[dict] = []

    def store(rec: dict) -> None:
        part["runs"].setdefault(rec["variant"], {})[int(rec["seed"])] = rec
        flat.append(rec)
        part["aggregate"] = aggregate(flat)

    for seed in cfg.seeds:
        for v in study.variants:
            demo.step(f"recall {LABELS.get(v, v)} seed {seed} ({study.steps} steps, train + eval)",
                      lambda v=v, seed=seed: run_one(study, v, study.widths[0], seed), store=store)

    def plot() -> str:
        from diffmm.eval.recall import plot_recall

        w = str(study.widths[0])
        return plot_recall(plot_input(part["aggregate"], w, flat), os.path.join(cfg.out, "recall.png"),
                           title=f"Associative recall (MQAR), width {w}: mean over seeds")

    def keep(path: str) -> None:
        demo.results["plots"]["recall"] = os.path.relpath(path, cfg.out)

    demo.step("plot recall accuracy and attention shares", plot, needs=(flat or None,), store=keep)


def demo_steps(cfg) -> int:
    """Steps the recall section announces."""
    return len(cfg.seeds) * len(cfg.recall_variants) + 1


def report_section(results: dict, img) -> str:
    """The recall section of the demo's ``report.md`` (``img(path, alt)`` renders a plot link)."""
    part = results.get("recall") or {}
    agg = part.get("aggregate") or {}
    s = part.get("study") or {}

    def join(key: str) -> str:
        return ", ".join(map(str, s.get(key, [])))

    md = ["\n## Associative recall (MQAR): Transformer vs DIFF V1 vs DIFF V2\n"]
    md.append(f"{s.get('layers')}-layer decoder LMs of width {join('widths')} ({s.get('heads')} standard heads; "
              "DIFF V1 half as many differential heads; DIFF V2 with its SwiGLU hidden size reduced to the "
              "Transformer's parameter count) trained on generated key-value recall for "
              f"{s.get('steps_per_width') or s.get('steps')} steps of {s.get('batch_tokens') or s.get('batch_size')} "
              f"{'tokens' if s.get('batch_tokens') else 'sequences'} (sequence lengths {join('train_seq_lens')}, "
              f"pairs {join('train_pairs')}, noise {s.get('noise')}), loss on the answers only; evaluated on "
              f"{s.get('examples')} fresh sequences per setting (lengths {join('eval_seq_lens')}, pairs "
              f"{join('eval_pairs')}). Chance is about 1/pairs once a model has learned to answer with a value from "
              "the context. The same seed gives every model the same batches and evaluation sequences. Recall "
              "needs an induction circuit that small models find abruptly after a few hundred steps of this size, "
              "so at the demo's budget the accuracies may still sit at chance; `scripts/recall_compare.py` runs "
              "the longer comparison in `docs/results.md`.\n")
    if agg.get("widths"):
        md.append(recall_markdown(agg))
    else:
        md.append("*(no recall run finished, see the steps below)*\n")
    md.append(img((results.get("plots") or {}).get("recall"), "recall accuracy and attention shares"))
    return "\n".join(md)
