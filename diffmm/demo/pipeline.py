"""The demo from start to end: data, training, evaluation, plots, report. Every piece is a step that
may fail on its own; the report says what failed and :func:`run_demo` returns 1 if anything did.
"""
from __future__ import annotations

import datetime
import logging
import os
import platform
import shlex
import sys
import time
from typing import Any, Callable, Optional

from diffmm.demo.config import DemoConfig
from diffmm.demo.steps import StepRunner, cpu_seconds, setup_logging
from diffmm.demo.summary import CLIP_METRICS, LM_METRICS, paired, summarize

log = logging.getLogger("diffmm.demo")

CLIP_EVALS = ("zs_group", "zs_subgroup", "zs_fmnist", "retrieval")
LM_EVALS = ("val", "needle", "outliers")


def _setter(d: dict, key: str, relative_to: Optional[str] = None) -> Callable[[Any], None]:
    """A function that stores its argument as ``d[key]`` (for :meth:`StepRunner.run`'s ``store``);
    with ``relative_to``, file paths (a path or a list of them) are stored relative to that folder."""
    def store(value: Any) -> None:
        if relative_to is not None:
            value = ([os.path.relpath(v, relative_to) for v in value] if isinstance(value, list)
                     else os.path.relpath(value, relative_to))
        d[key] = value

    return store


def planned_steps(cfg: DemoConfig) -> int:
    """How many steps the run will announce (for the ``[k/N]`` headers)."""
    s = len(cfg.seeds)
    n = 1 if "clip" in cfg.parts or "lm" in cfg.parts else 0  # the lambda plot
    if "clip" in cfg.parts:
        n += 1 + s * 2 * (1 + len(CLIP_EVALS)) + 2
    if "lm" in cfg.parts:
        n += 2 + s * 2 * (1 + len(LM_EVALS)) + 2
    if "recall" in cfg.parts:
        from diffmm.demo.recall import demo_steps

        n += demo_steps(cfg)
    return n


def environment(threads: int) -> dict[str, Any]:
    import torch

    import diffmm

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"diffmm": diffmm.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cores": cores, "torch_threads": threads,
            "load_start": [round(x, 1) for x in load] if load else None}


def _part(models: tuple[str, str]) -> dict[str, Any]:
    return {"models": {"baseline": models[0], "differential": models[1]}, "runs": {m: {} for m in models},
            "summary": {}, "paired": {}}


def _aggregate(part: dict, metrics) -> None:
    base, diff = part["models"]["baseline"], part["models"]["differential"]
    part["summary"] = {m: summarize(part["runs"][m], metrics) for m in (base, diff)}
    part["paired"] = paired(part["runs"][base], part["runs"][diff], metrics)


class Demo:
    """State of one demo run (see :func:`run_demo`)."""

    def __init__(self, cfg: DemoConfig, command: str) -> None:
        self.cfg = cfg
        self.t0, self.c0 = time.perf_counter(), cpu_seconds()
        from diffmm.demo.train import set_threads

        self.threads = set_threads(cfg.threads)
        self.results: dict[str, Any] = {
            "command": command, "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "status": "running", "config": cfg.to_dict(), "environment": environment(self.threads),
            "data": {}, "plots": {}, "steps": []}
        if "clip" in cfg.parts:
            self.results["clip"] = _part(cfg.clip_models)
        if "lm" in cfg.parts:
            self.results["lm"] = _part(cfg.lm_models)
        self.runner = StepRunner(planned_steps(cfg), on_change=self.save)
        self.keep: dict[str, Any] = {}  # first-seed models, for the attention maps
        self.lambdas: dict[str, dict[int, dict[str, float]]] = {}  # model -> seed -> layer -> lambda after training
        self.lambda_start: dict[str, dict[int, dict[str, float]]] = {}  # ... at step 0
        self.lambda_init: dict[str, dict[str, float]] = {}  # model -> layer -> lambda_init

    # ----- results --------------------------------------------------------------------------
    def save(self) -> None:
        """Rewrite results.json and report.md with what is known now (also after every step)."""
        from diffmm.demo.report import write_report

        r = self.results
        r["steps"] = [s.to_dict() for s in self.runner.records]
        r["wall_seconds"] = time.perf_counter() - self.t0
        r["cpu_seconds"] = cpu_seconds() - self.c0
        if "clip" in r:
            _aggregate(r["clip"], CLIP_METRICS)
        if "lm" in r:
            _aggregate(r["lm"], LM_METRICS)
        write_report(r, self.cfg.out)

    def step(self, name: str, fn: Callable[[], Any], needs: tuple = (), store: Optional[Callable] = None) -> Any:
        return self.runner.run(name, fn, needs=needs, store=store)

    # ----- parts ----------------------------------------------------------------------------
    def data(self, part: str):
        from diffmm.demo.data import ensure_demo_data, locate

        cfg = self.cfg
        styles = tuple(cfg.train_styles) + (cfg.holdout_style,)

        def go():
            built = ensure_demo_data(cfg.data, (part,), styles)
            d = locate(cfg.data, (part,), tuple(cfg.train_styles), cfg.holdout_style)
            summary = {k: v for k, v in d.summary().items() if v}
            self.results["data"].update(summary)
            if built:
                self.results["data"][f"built_{part}"] = sorted(built)
            return d

        return self.step(f"data ({part}): build what is missing, find the shards", go)

    def clip(self) -> None:
        from diffmm.demo import evaluate as ev
        from diffmm.demo.train import train_clip

        cfg, part = self.cfg, self.results["clip"]
        data = self.data("clip")
        for seed in cfg.seeds:
            for name in cfg.clip_models:
                res = part["runs"][name].setdefault(seed, {})
                tr = self.step(f"train {name} seed {seed} ({cfg.clip_steps} steps x {cfg.clip_batch})",
                               lambda: train_clip(cfg, data, name, seed), needs=(data,),
                               store=lambda t: self._store_run(res, name, seed, t))
                model = tr.model if tr is not None else None
                if tr is not None and seed == cfg.seeds[0]:
                    self.keep[name] = model
                evals = {"zs_group": lambda: ev.zeroshot_emoji(model, cfg, data, "group"),
                         "zs_subgroup": lambda: ev.zeroshot_emoji(model, cfg, data, "subgroup"),
                         "zs_fmnist": lambda: ev.zeroshot_fashion(model, cfg, data),
                         "retrieval": lambda: ev.retrieval(model, cfg, data)}
                for key in CLIP_EVALS:
                    self.step(f"eval {key} {name} seed {seed}", evals[key], needs=(model,),
                              store=_setter(res, key))
                del tr, model
        self.clip_plots(data)

    def clip_plots(self, data) -> None:
        from diffmm.demo import plots

        cfg, part, out = self.cfg, self.results["clip"], self.cfg.out
        runs = {name: {s: r["train"]["metrics_csv"] for s, r in part["runs"][name].items() if "train" in r}
                for name in cfg.clip_models}
        runs = {k: v for k, v in runs.items() if v}
        self.step("plot CLIP loss curves", lambda: plots.loss_curves(
            runs, os.path.join(out, "clip_loss_curves.png"), "CLIP vs DiffCLIP: contrastive training loss"),
            needs=(runs or None,), store=_setter(self.results["plots"], "clip_loss", out))
        models = {n: self.keep[n] for n in cfg.clip_models if n in self.keep}
        self.step("plot attention maps (held-out images)", lambda: plots.attention_maps(
            models, plots.holdout_images(data.holdout_shards, cfg.attention_images), os.path.join(out, "attention")),
            needs=(data, models or None), store=_setter(self.results["plots"], "attention", out))

    def lm(self) -> None:
        from diffmm.demo import evaluate as ev
        from diffmm.demo.train import train_lm

        cfg, part = self.cfg, self.results["lm"]
        data = self.data("lm")
        def haystack():
            tok = ev.load_tokenizer(data)
            return ev.haystack_sentences(data, tok, max(8, cfg.needle_context // 8)), tok

        hay = self.step("needle haystack (validation pages) and tokenizer", haystack, needs=(data,))
        sentences, tok = hay if hay is not None else (None, None)
        for seed in cfg.seeds:
            for name in cfg.lm_models:
                res = part["runs"][name].setdefault(seed, {})
                tr = self.step(f"train {name} seed {seed} ({cfg.lm_steps} steps x {cfg.lm_batch} rows)",
                               lambda: train_lm(cfg, data, name, seed), needs=(data,),
                               store=lambda t: self._store_run(res, name, seed, t))
                model = tr.model if tr is not None else None
                evals = {"val": (lambda: ev.validation_loss(model, cfg, data, tok), (model, tok)),
                         "needle": (lambda: ev.needle(model, cfg, data, tok, sentences), (model, tok, sentences)),
                         "outliers": (lambda: ev.outliers(model, cfg, data, tok), (model, tok))}
                for key in LM_EVALS:
                    fn, needs = evals[key]
                    self.step(f"eval {key} {name} seed {seed}", fn, needs=needs,
                              store=_setter(res, key))
                del tr, model
        self.lm_plots()

    def lm_plots(self) -> None:
        from diffmm.demo import plots
        from diffmm.demo.summary import mean_std

        cfg, part, out = self.cfg, self.results["lm"], self.cfg.out
        runs = {name: {s: r["train"]["metrics_csv"] for s, r in part["runs"][name].items() if "train" in r}
                for name in cfg.lm_models}
        runs = {k: v for k, v in runs.items() if v}
        self.step("plot LM loss curves", lambda: plots.loss_curves(
            runs, os.path.join(out, "lm_loss_curves.png"), "DIFF vs Transformer LM: training loss"),
            needs=(runs or None,), store=_setter(self.results["plots"], "lm_loss", out))
        needle: dict[str, dict] = {}
        for name in cfg.lm_models:
            rs = [r["needle"] for r in part["runs"][name].values() if "needle" in r]
            if rs:
                needle[name] = {kind: {d: mean_std([r[f"{kind}_by_depth"][d] for r in rs])["mean"]
                                       for d in rs[0][f"{kind}_by_depth"]} for kind in ("attention", "accuracy")}
        self.step("plot needle retrieval", lambda: plots.needle_bars(needle, os.path.join(out, "needle.png")),
                  needs=(needle or None,), store=_setter(self.results["plots"], "needle", out))

    def _store_run(self, res: dict, name: str, seed: int, tr) -> None:
        res["train"] = tr.summary()
        if tr.lambdas:
            self.lambdas.setdefault(name, {})[seed] = tr.lambdas
            self.lambda_start.setdefault(name, {})[seed] = tr.lambda_start
            self.lambda_init[name] = tr.lambda_init

    def lambda_plot(self) -> None:
        from diffmm.demo import plots

        self.step("plot lambda per layer", lambda: plots.lambda_per_layer(
            self.lambdas, self.lambda_start, self.lambda_init, os.path.join(self.cfg.out, "lambda_per_layer.png")),
            needs=(self.lambdas or None,), store=_setter(self.results["plots"], "lambda", self.cfg.out))

    def run(self) -> int:
        try:
            if "clip" in self.cfg.parts:
                self.clip()
            if "lm" in self.cfg.parts:
                self.lm()
            if "clip" in self.cfg.parts or "lm" in self.cfg.parts:
                self.lambda_plot()
            if "recall" in self.cfg.parts:
                from diffmm.demo.recall import run_demo_part

                run_demo_part(self)
        finally:
            r = self.results
            load = os.getloadavg() if hasattr(os, "getloadavg") else None
            r["environment"]["load_end"] = [round(x, 1) for x in load] if load else None
            r["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
            r["status"] = "failed" if self.runner.failed else "ok"
            self.save()
        return 1 if self.runner.failed else 0


def run_demo(cfg: DemoConfig, command: Optional[str] = None) -> int:
    """Run the demo; returns 0 when every step succeeded, 1 otherwise (the report is written either way)."""
    os.makedirs(cfg.out, exist_ok=True)
    handler = setup_logging(cfg.out)
    command = command or "diffmm demo " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        demo = Demo(cfg, command)
        rc = demo.run()
    finally:
        logging.getLogger("diffmm").removeHandler(handler)
        handler.close()
    r = demo.results
    print(f"\n{'=' * 70}\ndiffmm demo {'finished' if rc == 0 else 'FINISHED WITH FAILURES'} in "
          f"{r['wall_seconds'] / 60:.1f} min: {os.path.join(cfg.out, 'report.md')}, "
          f"{os.path.join(cfg.out, 'results.json')}", flush=True)
    for s in demo.runner.failed:
        print(f"  failed: {s.name}: {s.error}", flush=True)
    if demo.runner.skipped:
        print(f"  skipped: {len(demo.runner.skipped)} step(s) that needed a failed one", flush=True)
    return rc
