"""The main job: ``diffmm demo`` (``make demo``) trains tiny CLIP vs DiffCLIP and Transformer vs DIFF LMs
on the demo data over several seeds on CPU, evaluates them through ``diffmm.eval`` and writes ``report/``.

    from diffmm.demo import QUICK, run_demo
    run_demo(QUICK.replace(out="report-quick"))

Modules: ``config`` (budgets), ``datasets`` (the demo dataset builders), ``montage``, ``data`` (build / find shards), ``train`` (Lightning runs), ``evaluate``
(zero-shot, retrieval, LM metrics), ``summary`` (mean ± std, paired differences), ``plots``, ``report``,
``steps`` (failure-tolerant step runner), ``pipeline`` (the order of it all), ``cli``.
"""
from __future__ import annotations

from diffmm.demo.config import FULL, PRESETS, QUICK, DemoConfig

__all__ = ["DemoConfig", "FULL", "QUICK", "PRESETS", "run_demo"]


def run_demo(cfg: DemoConfig, command: str | None = None) -> int:
    """Run the demo (see :func:`diffmm.demo.pipeline.run_demo`)."""
    from diffmm.demo.pipeline import run_demo as _run

    return _run(cfg, command)
