"""Associative recall (MQAR): Transformer vs DIFF V1 vs DIFF V2 at equal parameters, several widths and seeds, on CPU.

Every run trains a parameter-matched 2-layer ``DiffLM`` (``diffmm.train.recall_run.matched_lm_kwargs``) on
generated recall data for the same number of steps, then scores it on a fixed evaluation set of its seed
(accuracy per sequence length and number of pairs, attention shares on the answer / distractor pairs /
rest). Runs of one seed see the same training batches and evaluation sequences, so the differences are
paired by seed.

Resumable: each run writes ``OUT/runs/<variant>-w<width>-s<seed>.json`` and is skipped when that file
exists with the same settings. At the end (or with ``--aggregate-only``) it writes ``OUT/aggregate.json``,
``OUT/table.md``, ``OUT/recall_w<width>.png`` and, with ``--docs``, the tables into the marked section of
that markdown file.

    python scripts/recall_compare.py --out results/recall                       # the committed comparison
    python scripts/recall_compare.py --out pilot-out --variants standard --widths 64 --seeds 0 --steps 300
    python scripts/recall_compare.py --out results/recall --aggregate-only --docs docs/results.md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from diffmm.demo.recall import VARIANTS, RecallStudy, aggregate, plot_input, recall_markdown, run_one

BEGIN, END = "<!-- recall-comparison:begin -->", "<!-- recall-comparison:end -->"


def parse(argv=None) -> argparse.Namespace:
    d = RecallStudy()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/recall")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128])
    p.add_argument("--heads", type=int, default=d.heads, help="standard heads (DIFF V1 gets half)")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--train-seq-lens", type=int, nargs="+", default=list(d.train_seq_lens))
    p.add_argument("--train-pairs", type=int, nargs="+", default=list(d.train_pairs))
    p.add_argument("--eval-seq-lens", type=int, nargs="+", default=list(d.eval_seq_lens))
    p.add_argument("--eval-pairs", type=int, nargs="+", default=list(d.eval_pairs))
    p.add_argument("--noise", type=float, default=d.noise)
    p.add_argument("--steps", type=int, nargs="+", default=[d.steps], help="training steps, or one per width")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per batch (overrides --batch-size)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr", type=float, default=None, help="default lr / 10")
    p.add_argument("--warmup", type=int, default=None, help="default 5%% of the steps")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--examples", type=int, default=d.examples, help="evaluation sequences per setting")
    p.add_argument("--attention-examples", type=int, default=d.attention_examples)
    p.add_argument("--lambda-init", default=d.lambda_init, help="DIFF V1 lambda_init: depth (paper) or constant")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--aggregate-only", action="store_true", help="only aggregate the runs in OUT/runs")
    p.add_argument("--save-models", help="folder for each trained model (<run>.pt: model kwargs + state dict)")
    p.add_argument("--reevaluate", metavar="MODELS",
                   help="re-score the runs in OUT/runs with the models saved in MODELS (no training)")
    p.add_argument("--force", action="store_true", help="rerun runs whose JSON has different settings")
    p.add_argument("--docs", help="markdown file whose recall-comparison section is replaced by the tables")
    p.add_argument("--include", action="append", default=[], metavar="FOLDER=NAME",
                   help="also aggregate the runs of another --out FOLDER (e.g. an ablation) as model NAME")
    return p.parse_args(argv)


def study_of(a: argparse.Namespace) -> RecallStudy:
    return RecallStudy(variants=tuple(a.variants), widths=tuple(a.widths), heads=a.heads, layers=a.layers,
                       vocab=a.vocab, train_seq_lens=tuple(a.train_seq_lens), train_pairs=tuple(a.train_pairs),
                       eval_seq_lens=tuple(a.eval_seq_lens), eval_pairs=tuple(a.eval_pairs), noise=a.noise,
                       steps=a.steps[0], steps_per_width=tuple(a.steps) if len(a.steps) > 1 else None,
                       batch_size=a.batch_size, batch_tokens=a.batch_tokens, lr=a.lr,
                       min_lr=a.min_lr if a.min_lr is not None else a.lr / 10,
                       warmup=a.warmup if a.warmup is not None else max(1, min(a.steps) // 20),
                       weight_decay=a.weight_decay, examples=a.examples, attention_examples=a.attention_examples,
                       lambda_init=a.lambda_init)


def _run_settings(study: RecallStudy) -> dict:
    """The settings a run record must match to be reused (everything but the compared lists)."""
    d = study.to_dict()
    for k in ("variants", "widths"):
        d.pop(k)
    if d.get("lambda_init") == "depth":  # the default; absent from records written before the option existed
        d.pop("lambda_init")
    return json.loads(json.dumps(d))


def _write_json(path: str, obj) -> None:
    from diffmm.eval.common import write_json

    write_json(path, obj)


def load_runs(folder: str) -> list[dict]:
    runs = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                runs.append(json.load(f))
    return runs


def run_all(a: argparse.Namespace, study: RecallStudy) -> None:
    runs_dir = os.path.join(a.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    settings = _run_settings(study)
    todo = [(s, w, v) for s in a.seeds for w in study.widths for v in study.variants]
    t0 = time.perf_counter()
    for k, (seed, width, variant) in enumerate(todo, 1):
        path = os.path.join(runs_dir, f"{variant}-w{width}-s{seed}.json")
        if os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
            if old.get("settings") == settings:
                print(f"[{k}/{len(todo)}] {os.path.basename(path)}: done, skipped", flush=True)
                continue
            if not a.force:
                sys.exit(f"{path} exists with other settings; use another --out, delete it or pass --force")
        print(f"[{k}/{len(todo)}] {variant} width {width} seed {seed} (elapsed {(time.perf_counter() - t0) / 60:.1f} "
              f"min, load {os.getloadavg()[0]:.1f})", flush=True)
        save = os.path.join(a.save_models, os.path.basename(path)[:-len(".json")] + ".pt") if a.save_models else None
        rec = run_one(study, variant, width, seed, save_model=save)
        rec["settings"] = settings
        rec["load_average"] = [round(x, 1) for x in os.getloadavg()]
        rec["torch_threads"] = torch.get_num_threads()
        _write_json(path, rec)
        ev = rec["eval"]
        print(f"    accuracy {ev['accuracy']:.3f}  answer share {ev['attention'].get('answer', float('nan')):.3f}  "
              f"train {rec['train']['seconds']:.0f} s  -> {path}", flush=True)


def reevaluate(a: argparse.Namespace, study: RecallStudy) -> None:
    """Replace the ``eval`` part of every run record by a fresh evaluation of its saved model."""
    from diffmm.demo.recall import evaluate_one, load_saved_model

    runs_dir = os.path.join(a.out, "runs")
    for name in sorted(os.listdir(runs_dir)):
        if not name.endswith(".json"):
            continue
        path, model_path = os.path.join(runs_dir, name), os.path.join(a.reevaluate, name[:-len(".json")] + ".pt")
        if not os.path.exists(model_path):
            sys.exit(f"{model_path}: no saved model for {path}")
        with open(path) as f:
            rec = json.load(f)
        rec["eval"] = evaluate_one(study, load_saved_model(model_path), int(rec["seed"]))
        _write_json(path, rec)
        print(f"re-evaluated {name}: accuracy {rec['eval']['accuracy']:.3f}", flush=True)


def write_outputs(a: argparse.Namespace, study: RecallStudy) -> dict:
    from diffmm.eval.recall import plot_recall

    runs = load_runs(os.path.join(a.out, "runs"))
    if not runs:
        sys.exit(f"no runs under {os.path.join(a.out, 'runs')}")
    for spec in a.include:
        folder, _, name = spec.rpartition("=")
        extra = load_runs(os.path.join(folder, "runs"))
        if not folder or not name or not extra:
            sys.exit(f"--include {spec}: expected FOLDER=NAME with runs under FOLDER/runs")
        runs += [dict(r, variant=name, included_from=folder) for r in extra]
    agg = aggregate(runs, baseline=study.variants[0] if "standard" not in study.variants else "standard")
    agg["study"] = runs[0].get("settings", {})
    agg["runs"] = len(runs)
    _write_json(os.path.join(a.out, "aggregate.json"), agg)
    md = recall_markdown(agg)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(md)
    for w in agg["widths"]:
        plot_recall(plot_input(agg, w, runs), os.path.join(a.out, f"recall_w{w}.png"),
                    title=f"MQAR, width {w}: mean over seeds (error bars: std)")
    print(md)
    if a.docs:
        with open(a.docs) as f:
            text = f.read()
        if BEGIN not in text or END not in text:
            sys.exit(f"{a.docs}: no {BEGIN} ... {END} section to replace")
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        with open(a.docs, "w") as f:
            f.write(head + BEGIN + "\n" + md.rstrip() + "\n" + END + tail)
        print(f"updated {a.docs}")
    return agg


def main(argv=None) -> int:
    a = parse(argv)
    if len(a.steps) not in (1, len(a.widths)):
        sys.exit(f"--steps: give one value or one per width ({len(a.widths)})")
    torch.set_num_threads(a.threads)
    study = study_of(a)
    if a.reevaluate:
        reevaluate(a, study)
    elif not a.aggregate_only:
        run_all(a, study)
    write_outputs(a, study)
    return 0


if __name__ == "__main__":
    sys.exit(main())
