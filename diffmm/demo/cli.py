"""``diffmm demo``: the main job. Builds the demo data if missing, trains tiny CLIP and DiffCLIP (and a tiny
Transformer and DIFF LM) with identical budgets over several seeds on CPU, evaluates them and writes
``report/`` (``report.md``, ``results.json``, plots).

    diffmm demo                      # the full run: 3 seeds, <= 30 min on 2 CPU cores
    diffmm demo --quick              # 1 seed, fewer steps: <= 5 min
    diffmm demo --parts clip --seeds 0,1 --clip-steps 100 --out report-clip
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from diffmm.demo.config import PARTS, PRESETS


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return vals


def _parts(text: str) -> tuple[str, ...]:
    vals = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [v for v in vals if v not in PARTS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"parts {text!r}: expected a comma-separated subset of {','.join(PARTS)}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diffmm demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 5-minute variant (1 seed, fewer steps)")
    p.add_argument("--out", default="report", help="report folder (default: report)")
    p.add_argument("--data", default="data", help="demo data folder; built there when missing (default: data)")
    p.add_argument("--parts", type=_parts, help=f"what to run, subset of {','.join(PARTS)} (default: all)")
    p.add_argument("--seeds", type=_ints, help="comma-separated seeds (full: 0,1,2; quick: 0)")
    p.add_argument("--clip-steps", type=int, help="CLIP training steps per run")
    p.add_argument("--lm-steps", type=int, help="LM training steps per run")
    p.add_argument("--holdout", help="emoji art style held out for zero-shot and retrieval (default: twitter)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default 0: all cores, 1 if the machine is busy)")
    p.add_argument("--num-workers", type=int, help="DataLoader workers of the training streams (default 1)")
    p.add_argument("--render-only", action="store_true", help="only rewrite OUT/report.md from OUT/results.json")
    return p


def config_from_args(args: argparse.Namespace):
    """The :class:`~diffmm.demo.config.DemoConfig` of the parsed arguments."""
    cfg = PRESETS["quick" if args.quick else "full"]
    changes = {"out": args.out, "data": args.data}
    for arg, key in (("parts", "parts"), ("seeds", "seeds"), ("clip_steps", "clip_steps"), ("lm_steps", "lm_steps"),
                     ("threads", "threads"), ("num_workers", "num_workers")):
        if getattr(args, arg) is not None:
            changes[key] = getattr(args, arg)
    if args.holdout:
        styles = tuple(s for s in ("noto", "google", "twitter", "openmoji") if s != args.holdout)
        changes.update(holdout_style=args.holdout, train_styles=styles)
    for steps, warmup in (("clip_steps", "clip_warmup"), ("lm_steps", "lm_warmup")):
        if steps in changes:  # warmup: at most 10% of a shortened run
            changes[warmup] = min(getattr(cfg, warmup), max(1, changes[steps] // 10))
    return cfg.replace(**changes)


def render_only(out: str) -> int:
    """Rewrite ``out/report.md`` from ``out/results.json`` (e.g. after changing the report layout)."""
    import json
    import os

    from diffmm.demo.report import render_markdown

    path = os.path.join(out, "results.json")
    if not os.path.isfile(path):
        print(f"diffmm demo: error: {path} not found; run the demo first", file=sys.stderr)
        return 2
    with open(path) as f:
        results = json.load(f)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_markdown(results, out))
    print(f"wrote {os.path.join(out, 'report.md')}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``diffmm demo``; returns 0 when every step succeeded."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.render_only:
        return render_only(args.out)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"diffmm demo: error: {e}", file=sys.stderr)
        return 2
    from diffmm.demo.pipeline import run_demo

    return run_demo(cfg, command="diffmm demo " + " ".join(argv))
