"""``python -m diffmm_demo run``: for each part, seed and model, ``diffmm fit`` with the model's config file and the
part's overrides, then the part's evaluations on the checkpoint loaded with ``load_pretrained``; then the plots and the
report. Every piece is a step: a failure is recorded (traceback in ``OUT/demo.log``), the steps that need its
result are skipped, the rest still runs, and the report is rewritten after every step.
"""
from __future__ import annotations

import datetime
import functools
import inspect
import json
import os
import platform
import resource
import shlex
import shutil
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Literal, Optional

import numpy as np
import torch
from matplotlib.figure import Figure

from diffmm import __version__, load_pretrained
from diffmm.eval.plots import plot_loss_curves, read_metrics_csv
from diffmm.train.cli import run_cli
from diffmm.train import clear_image_caches
from diffmm.train.monitor import lambda_layers, lambda_values

from diffmm_demo.datasets import STYLES, build_emoji, build_fashion_mnist, build_python_docs
from diffmm_demo.evals import ICONS
from diffmm_demo.imageset import STAMPS, build_icons, build_stamps
from diffmm_demo.parts import Part, build_parts
from diffmm_demo.report import write_report

PARTS = ("lit", "dinov2", "clip", "lm", "recall")
#: what runs unless ``parts`` says otherwise: the LiT comparisons (the from-scratch ones are in docs/results.md)
DEFAULT_PARTS = ("lit", "dinov2")
#: the repository's ``configs/``: the demo trains with the config files a user runs
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
STEPS = {"lit": 220, "dinov2": 100, "clip": 200, "lm": 200, "recall": 150}
QUICK_STEPS = {"lit": 60, "dinov2": 40, "clip": 60, "lm": 60, "recall": 80}
DATASETS = {"emoji": [f"emoji/{s}" for s in STYLES], "fashion-mnist": ["fashion-mnist/test"],
            "python-docs": ["python-docs/train", "python-docs/val"], "icons": [ICONS], "stamps": [STAMPS]}


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (DataLoader workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def ensure_data(data: str, needs: tuple[str, ...]) -> list[str]:
    """Build the datasets ``needs`` whose shards are missing under ``data`` (a missing source stops with one line
    naming its package); returns the shard folders built."""
    builders = {"emoji": build_emoji, "fashion-mnist": build_fashion_mnist, "python-docs": build_python_docs,
                "icons": build_icons, "stamps": build_stamps}
    built = []
    for need in needs:
        marker = "classes.json" if need in ("icons", "stamps") else "sizes.json"  # an image folder, not shards
        missing = [f for f in DATASETS[need] if not os.path.isfile(os.path.join(data, f, marker))]
        if missing:
            builders[need](data, *([[f.split("/")[1] for f in missing]] if need == "emoji" else []))
        built += missing
    return built


def torch_threads(threads: int, cores: int) -> int:
    """The torch CPU threads of a run: ``threads``, or with 0 every core, or 1 when the load average already
    reaches the core count (spinning threads then cost more than they give), which is said on the console."""
    load = os.getloadavg()[0]
    if threads or load < cores or cores == 1:
        return threads or cores
    print(f"diffmm demo: the load average ({load:.1f}) already reaches the {cores} cores, so training uses 1 torch "
          f"thread (--threads {cores} uses every core)", file=sys.stderr, flush=True)
    return 1


class Demo:
    """One run: the results (``results.json``), the step log, training through ``diffmm fit``."""

    def __init__(self, out: str, total: int, results: dict) -> None:
        self.out, self.total, self.results, self.steps = out, total, results, results["steps"]
        self.t0, self.c0 = time.perf_counter(), cpu_seconds()

    def save(self) -> None:
        self.results.update(wall_seconds=time.perf_counter() - self.t0, cpu_seconds=cpu_seconds() - self.c0)
        write_report(self.results, self.out)

    def step(self, name: str, fn: Callable[[], Any], needs: tuple = (), into: Optional[tuple[dict, str]] = None):
        """Run ``fn()`` as step ``name``; return its result, also stored at ``into`` = (dict, key). None when it
        failed, or when a result it ``needs`` is None (skipped)."""
        rec, result = {"name": name, "status": "skipped", "seconds": 0.0, "cpu_seconds": 0.0, "error": None}, None
        t, c = time.perf_counter(), cpu_seconds()
        if any(n is None for n in needs):
            rec["error"] = "an earlier step it needs failed or was skipped"
        else:
            print(f"\n=== [{len(self.steps) + 1}/{self.total}] {name}  (demo time {(t - self.t0) / 60:.1f} min)",
                  file=sys.stderr, flush=True)
            try:
                result = fn()
                rec["status"] = "ok"
                if into is not None:
                    into[0][into[1]] = result
            except Exception as e:  # a failed step must not end the demo: it is reported and sets the exit status
                rec.update(status="failed", error=(str(e).strip() or type(e).__name__).splitlines()[0])
                with open(os.path.join(self.out, "demo.log"), "a") as f:
                    f.write(f"step {name!r} failed:\n{traceback.format_exc()}\n")
            rec.update(seconds=time.perf_counter() - t, cpu_seconds=cpu_seconds() - c)
        print(f"=== {rec['status']}: {name} ({rec['seconds']:.1f} s){': ' + rec['error'] if rec['error'] else ''}",
              file=sys.stderr, flush=True)
        self.steps.append(rec)
        self.save()
        return result

    def train(self, part: Part, label: str, config: str, seed: int, res: dict, first: bool = False):
        """``diffmm fit`` of one model and seed; its checkpoint goes to ``OUT/checkpoints/<model>-seed<k>.ckpt`` and is
        loaded back; ``res["train"]`` gets the loss, throughput and lambdas of the CSV log (``first``: the part's
        first run, see :attr:`Part.fills_cache`)."""
        slug = f"{label.replace(' ', '-')}-seed{seed}"
        run_dir, ckpt = os.path.join(self.out, "runs", slug), os.path.join(self.out, "checkpoints", slug + ".ckpt")
        shutil.rmtree(run_dir, ignore_errors=True)
        logger = {"class_path": "pytorch_lightning.loggers.CSVLogger",
                  "init_args": {"save_dir": run_dir, "name": "csv", "version": ""}}
        argv = ["fit", "--config", os.path.relpath(config), *part.overrides, f"--seed_everything={seed}",
                f"--data.init_args.seed={seed}",
                f"--trainer.max_steps={part.steps}", f"--trainer.log_every_n_steps={min(5, part.steps)}",
                f"--trainer.default_root_dir={run_dir}", f"--trainer.logger={json.dumps(logger)}",
                f"--trainer.enable_progress_bar={str(sys.stderr.isatty()).lower()}",
                "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=0",
                f"--checkpoint.every_n_train_steps={part.steps}", "--checkpoint.save_top_k=0",
                "--checkpoint.save_weights_only=true"]
        self.results["parts"][part.key]["commands"][label] = "diffmm " + shlex.join(argv)
        t = time.perf_counter()
        with warnings.catch_warnings():  # Lightning's notes on in-process CLI args and iterable datasets' __len__
            warnings.filterwarnings("ignore",
                                    message=r".*(args parameter|`__len__` defined|LeafSpec|in eval mode at the start)")
            steps = run_cli(argv).trainer.global_step
        seconds = time.perf_counter() - t
        if steps != part.steps:
            raise RuntimeError(f"{label} seed {seed}: training stopped at step {steps} of {part.steps}")
        os.makedirs(os.path.dirname(ckpt), exist_ok=True)
        os.replace(os.path.join(run_dir, "checkpoints", "last.ckpt"), ckpt)
        os.rmdir(os.path.join(run_dir, "checkpoints"))
        model, csv = load_pretrained(ckpt), os.path.join(run_dir, "csv", "metrics.csv")
        cols = {k: v[~np.isnan(v)] for k, v in read_metrics_csv(csv).items()}
        loss, layers, n = cols["train/loss"], lambda_layers(model), part.loss_classes or model.config.vocab_size
        rate = [v.mean() for k, v in cols.items() if k.startswith("train/") and k.endswith("_per_s") and len(v)]
        res["train"] = {
            "steps": steps, "seconds": seconds, "final_train_loss": float(loss[-max(1, len(loss) // 10):].mean()),
            "throughput": float(rate[0]) if rate else None, "chance_loss": f"ln {n} = {np.log(n):.2f}",
            "params": sum(p.numel() for p in model.parameters()), "checkpoint": os.path.relpath(ckpt, self.out),
            "metrics_csv": os.path.relpath(csv, self.out),
            "lambdas": {k[7:]: v for k, v in lambda_values(layers).items() if k.startswith("lambda/")},
            "lambda_first_logged": {k[7:]: float(v[0]) for k, v in cols.items() if k.startswith("lambda/") and len(v)},
            "lambda_init": {name: float(getattr(m, "lambda_init", np.nan)) for name, m in layers.items()}}
        if part.fills_cache:
            res["train"]["throughput_warm_cache"] = None if first else res["train"]["throughput"]
        if not np.isfinite(res["train"]["final_train_loss"]):
            raise FloatingPointError(f"{label} seed {seed}: the training loss is not finite")
        return model

    def run_part(self, part: Part, seeds: list[int], data: str) -> None:
        """Data; per seed and model: train, then each evaluation; then the loss curves and the part's own plot."""
        res = self.results["parts"][part.key]
        ready = self.step(f"data ({part.key}): build what is missing", lambda: ensure_data(data, part.needs_data),
                          into=(res, "data built")) if part.needs_data else []
        for seed in seeds:
            for label, config in part.models:
                if label in part.first_seed_only and seed != seeds[0]:
                    continue
                run = res["runs"][label].setdefault(seed, {})
                first = seed == seeds[0] and label == part.models[0][0]
                model = self.step(f"train {label} seed {seed} ({part.steps} steps)",
                                  functools.partial(self.train, part, label, config, seed, run, first), needs=(ready,))
                for name, fn in part.evals.items():
                    self.step(f"eval {name} {label} seed {seed}", functools.partial(fn, model, seed), (model,),
                              (run, name))
                model = None  # free the weights before the next run
        csvs = {f"{x} seed {s}": os.path.join(self.out, r["train"]["metrics_csv"])
                for x, rs in res["runs"].items() for s, r in rs.items() if "train" in r}
        self.step(f"plot loss curves ({part.key})", lambda: os.path.basename(plot_loss_curves(
            csvs, os.path.join(self.out, f"{part.key}_loss_curves.png"), metrics=["train/loss"], title=part.title)),
            (csvs or None,), (res["plots"], "loss curves"))
        evaluated = all({"train", *part.evals} <= set(r) for rs in res["runs"].values() for r in rs.values()) or None
        self.step(f"plot {part.plot[0]} ({part.key})", lambda: part.plot[1](res, self.out), (evaluated,),
                  (res["plots"], part.plot[0]))
        clear_image_caches()  # the part's cached image tokens (DINOv2's locked blocks) are not needed after it


def _layer_label(name: str) -> str:
    """``visual.transformer.resblocks.3.attn`` -> ``vision 3``, ``transformer.resblocks.0.attn`` and
    ``text.transformer.encoder.layer.0.attention.self`` -> ``text 0``, ``blocks.2.attn`` -> ``layer 2``."""
    parts = name.split(".")
    tower = {"visual": "vision", "transformer": "text", "text": "text"}.get(parts[0], "layer")
    return f"{tower} {next((p for p in parts if p.isdigit()), '?')}"


def plot_lambdas(parts: dict, out: str) -> str:
    """lambda of every differential layer: lambda_init, at the first logged step and after training (mean ± std
    over seeds), one panel per model with differential layers."""
    panels = [(x, [r["train"] for r in rs.values() if r.get("train", {}).get("lambdas")])
              for p in parts.values() for x, rs in p["runs"].items()]
    panels = [(x, trains) for x, trains in panels if trains]
    if not panels:
        raise ValueError("no model with differential attention layers was trained")
    fig = Figure(figsize=(5 * len(panels), 3.6))
    for ax, (label, trains) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        layers = list(trains[0]["lambdas"])
        x = np.arange(len(layers))
        for key, style, name in (("lambda_first_logged", "s:", "first logged step"), ("lambdas", "o-", "trained")):
            vals = np.array([[t[key].get(n, np.nan) for n in layers] for t in trains])  # (seeds, layers)
            ax.errorbar(x, vals.mean(0), yerr=vals.std(0, ddof=1) if len(vals) > 1 else None, fmt=style, capsize=3,
                        label=f"{name} ({len(vals)} seeds)")
        ax.plot(x, [trains[0]["lambda_init"].get(n, np.nan) for n in layers], "x--", color="gray", label="lambda_init")
        ax.set_xticks(x, [_layer_label(n) for n in layers], rotation=60, fontsize=6)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Differential attention: lambda per layer", fontsize=10)
    fig.savefig(os.path.join(out, "lambda_per_layer.png"), dpi=110, bbox_inches="tight")
    return "lambda_per_layer.png"


def run_demo(out: str = "report", quick: bool = False, seeds: Optional[list[int]] = None,
             parts: Optional[list[Literal["lit", "dinov2", "clip", "lm", "recall"]]] = None, data: str = "data",
             lit_steps: Optional[int] = None, dinov2_steps: Optional[int] = None, clip_steps: Optional[int] = None,
             lm_steps: Optional[int] = None, recall_steps: Optional[int] = None, holdout: str = "twitter",
             threads: int = 0, workers: int = 1, configs: Optional[str] = None) -> int:
    """Train tiny models with standard and differential attention on CPU, compare them and write the report.

    Args:
        out: report folder: ``report.md``, ``results.json``, plots, ``checkpoints/<model>-seed<k>.ckpt`` (for
            ``diffmm eval``, ``diffmm classify``, ``diffmm.load_pretrained``), ``runs/`` (the CSV logs), ``demo.log``.
        quick: the few-minute preset: seed 0, 60 training steps per model (dinov2: 40, recall: 80), smaller
            evaluation sets.
        seeds: one training run per model and seed (default 0, 1, 2; quick: 0).
        parts: what runs, a subset of ``lit`` (LiT: standard vs differential tiny ViT against the pretrained
            MiniLM text tower, locked, and the upcycled differential MiniLM unlocked; needs ``diffmm[pretrained]``),
            ``dinov2`` (LiT on the pretrained DINOv2 ViT-S/14, standard vs upcycled differential last block, against
            the locked MiniLM; needs ``diffmm[pretrained]``), ``clip`` (CLIP-Tiny vs DiffCLIP-Tiny, both towers
            from scratch), ``lm`` (Transformer vs DIFF LM),
            ``recall`` (associative recall: Transformer vs DIFF V1 vs DIFF V2); default ``lit`` and ``dinov2``.
        data: the demo data folder; missing datasets are built there first (their packages: ``make demo-data``).
        lit_steps: training steps per LiT run (default 220; quick: 60).
        dinov2_steps: training steps per DINOv2 LiT run (default 100; quick: 40).
        clip_steps: training steps per from-scratch CLIP run (default 200; quick: 60).
        lm_steps: training steps per LM run (default 200; quick: 60).
        recall_steps: training steps per recall run (default 150; quick: 80).
        holdout: the emoji art style held out of CLIP training for zero-shot and retrieval (``twitter``,
            ``openmoji``; ``google`` is Noto's art).
        threads: torch CPU threads; 0 = all cores, or 1 (said on the console) when the load average already
            reaches the core count.
        workers: DataLoader workers of each training run.
        configs: the folder of the config files the models train with (default: the repository's ``configs/``).

    Returns:
        0 when every step succeeded, 1 when some failed (the report is written either way).
    """
    given = {k: v for k, v in locals().items() if v != inspect.signature(run_demo).parameters[k].default}
    command = " ".join(["python -m diffmm_demo run"] + [f"--{k} " + (shlex.quote(v) if isinstance(v, str) else str(
        v).lower().replace(" ", "").replace("'", "")) for k, v in given.items()])
    parts, defaults = list(parts or DEFAULT_PARTS), (QUICK_STEPS if quick else STEPS)
    seeds = list(seeds if seeds is not None else ([0] if quick else [0, 1, 2]))
    if set(parts) - set(PARTS) or not seeds or len(set(seeds)) != len(seeds) or holdout not in STYLES:
        raise ValueError(f"parts {parts} (a subset of {list(PARTS)}), seeds {seeds} (distinct, at least "
                         f"one) or holdout {holdout!r} (one of {list(STYLES)}) is not valid")
    steps = {k: v or defaults[k] for k, v in (("lit", lit_steps), ("dinov2", dinov2_steps), ("clip", clip_steps),
                                              ("lm", lm_steps), ("recall", recall_steps))}
    custom = (steps != defaults or seeds != ([0] if quick else [0, 1, 2]) or holdout != "twitter"
              or parts != list(DEFAULT_PARTS))
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(torch_threads(threads, cores))
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "demo.log"), "w").close()
    todo = build_parts(parts, data, steps, workers, holdout, quick, configs or CONFIGS)
    results = {"command": command, "started": datetime.datetime.now().isoformat(timespec="seconds"),
               "status": "running", "config": {"out": out, "data": data, "quick": quick, "preset": "custom" if custom
                                               else "quick" if quick else "full", "seeds": seeds, "parts": parts,
                                               "steps": steps, "holdout": holdout, "threads": threads},
               "environment": {"diffmm": __version__, "torch": torch.__version__, "python": platform.python_version(),
                               "platform": platform.platform(), "cores": cores,
                               "torch_threads": torch.get_num_threads(),
                               "load_start": [round(x, 1) for x in os.getloadavg()]},
               "plots": {}, "steps": [], "parts": {p.key: {
                   "name": p.name, "title": p.title, "about": p.about, "budget": p.budget, "metrics": p.metrics,
                   "paper": p.paper, "models": [x for x, _ in p.models], "runs": {x: {} for x, _ in p.models},
                   "commands": {}, "plots": {}} for p in todo}}
    runs = [len(seeds) * len(p.models) - (len(seeds) - 1) * len(p.first_seed_only) for p in todo]
    demo = Demo(out, sum(bool(p.needs_data) + n * (1 + len(p.evals)) + 2 for p, n in zip(todo, runs)) + 1, results)
    try:
        for p in todo:
            demo.run_part(p, seeds, data)
        demo.step("plot lambda per layer", lambda: plot_lambdas(results["parts"], out),
                  into=(results["plots"], "lambda"))
    finally:
        failed = [s for s in demo.steps if s["status"] == "failed"]
        results["environment"]["load_end"] = [round(x, 1) for x in os.getloadavg()]
        results.update(status="failed" if failed else "ok",
                       finished=datetime.datetime.now().isoformat(timespec="seconds"))
        demo.save()
    print(f"\n{'=' * 70}\ndiffmm demo {'FINISHED WITH FAILURES' if failed else 'finished'} in "
          f"{results['wall_seconds'] / 60:.1f} min: {os.path.join(out, 'report.md')}", file=sys.stderr)
    for s in failed:
        print(f"  failed: {s['name']}: {s['error']}", file=sys.stderr)
    return 1 if failed else 0
