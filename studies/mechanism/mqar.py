"""The mechanism on MQAR: is it lambda_init or the epilogue's output scale that decides when a 2-layer width-64
DIFF LM leaves the plateau? Each run is ``diffmm fit --config configs/recall_{diff,transformer}_tiny.yaml`` with the
cell's ``model_kwargs`` (attention type, lambda_init) as a command-line override, on Zoology's sampling (the data
on which DIFF left the plateau in results/zoology_mqar; on diffmm's it did not in 700 steps).

    PYTHONPATH=. nice -n 19 python studies/mechanism/mqar.py --seeds 0 1 2 3 4 5 6 7 8 9 --jobs 2

Cells (lambda_init x epilogue scale; "depth" = 0.8 - 0.6 exp(-0.3 layer): lambda 0.2, 0.356; scale 0.8, 0.644):

    diff_Ldepth_Sdepth   diff               lambda depth, scale 1 - lambda_init (the paper's LM)
    diff_L0.8_Sfixed     diff               lambda 0.8,   scale 0.2
    diff_Ldepth_Sfixed   diff_scale_fixed   lambda depth, scale 0.2
    diff_L0.8_Sdepth     diff_scale_depth   lambda 0.8,   scale depth
    diff_Ldepth_Snone    diff_scale_none    lambda depth, scale 1
    diff_L0.8_Snone      diff_scale_none    lambda 0.8,   scale 1
    std_epilogue         standard_epilogue  standard attention + per-head RMSNorm + scale depth
    transformer          standard           the plain Transformer (reference)

Validation every 20 steps on 128 fresh sequences per setting (16 tokens, 2 and 4 pairs, the run's sampler).
Escape step (results/zoology_mqar's "left the plateau") = the first validation step whose answer accuracy is at
least 2/3 (twice the pooled chance 1/3); None when no validation step reached it (censored at max_steps). A run
stops once validation accuracy exceeds ``--stop-at`` (0.8: clearly escaped; EarlyStopping with a patience no run
reaches). The cosine schedule still spans ``--steps``, so stopping early changes nothing before the stop.

One JSON per run, ``results/mechanism/mqar/<cell>-s<seed>.json``; a finished run is not redone. After the runs
(or with ``--summarize`` alone): ``summary.json``, ``table.md`` and ``survival.png`` in the same folder.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

MODEL = {"vocab_size": 64, "layers": 2, "width": 64, "heads": 4, "context_length": 512}  # both configs' widths
DIFF, STANDARD = "configs/recall_diff_tiny.yaml", "configs/recall_transformer_tiny.yaml"
CELLS = {  # cell: (config, attn_type, lambda_init, scale)
    "diff_Ldepth_Sdepth": (DIFF, "diff", "depth", "depth"),
    "diff_L0.8_Sfixed": (DIFF, "diff", 0.8, "fixed"),
    "diff_Ldepth_Sfixed": (DIFF, "diff_scale_fixed", "depth", "fixed"),
    "diff_L0.8_Sdepth": (DIFF, "diff_scale_depth", 0.8, "depth"),
    "diff_Ldepth_Snone": (DIFF, "diff_scale_none", "depth", "none"),
    "diff_L0.8_Snone": (DIFF, "diff_scale_none", 0.8, "none"),
    "std_epilogue": (STANDARD, "standard_epilogue", "depth", "depth"),
    "transformer": (STANDARD, "standard", None, None),
}
REFERENCE = "diff_Ldepth_Sdepth"
VAL_EVERY, VAL_EXAMPLES = 20, 128
THRESHOLD = 2 * (2 * 0.5 + 4 * 0.25) / 6  # twice the chance of the answers pooled over 2- and 4-pair sequences


def fit_argv(cell: str, seed: int, steps: int, run_dir: str, stop_at: float, sampler: str) -> list[str]:
    """The ``diffmm fit`` command line of one cell and seed."""
    config, attn_type, lambda_init, _ = CELLS[cell]
    model_kwargs = {**MODEL, "attn_type": attn_type}  # a dict override replaces the config's whole dict
    if lambda_init is not None:
        model_kwargs["lambda_init"] = lambda_init
    logger = {"class_path": "pytorch_lightning.loggers.CSVLogger",
              "init_args": {"save_dir": run_dir, "name": "csv", "version": ""}}
    stop = {"class_path": "pytorch_lightning.callbacks.EarlyStopping",
            "init_args": {"monitor": "val/accuracy", "mode": "max", "stopping_threshold": stop_at,
                          "patience": 10 ** 6}}
    return [os.path.join(os.path.dirname(sys.executable), "diffmm"), "fit", "--config", config,
            f"--seed_everything={seed}", f"--data.init_args.seed={seed}", f"--data.init_args.sampler={sampler}",
            "--data.init_args.val_seq_lens=[16]", "--data.init_args.val_num_pairs=[2,4]",
            f"--data.init_args.val_examples={VAL_EXAMPLES}",
            f"--model.init_args.model_kwargs={json.dumps(model_kwargs)}",
            f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={VAL_EVERY}",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={run_dir}", f"--trainer.logger={json.dumps(logger)}",
            f"--trainer.callbacks+={json.dumps(stop)}", f"--checkpoint.every_n_train_steps={steps}"]


def val_curve(metrics_csv: str) -> list[list[float]]:
    """[step, val accuracy, val loss] per validation (steps on the 20-step grid, as results/zoology_mqar)."""
    with open(metrics_csv) as f:
        return [[int(r["step"]) + 1, float(r["val/accuracy"]), float(r["val/loss"])]
                for r in csv.DictReader(f) if r.get("val/accuracy")]


def last_lambdas(metrics_csv: str) -> dict[str, float]:
    """The last logged lambda of each differential layer (``lambda/<module>`` columns); empty for other types."""
    out: dict[str, float] = {}
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            out.update({k.split("/", 1)[1]: float(v) for k, v in row.items() if k.startswith("lambda/") and v})
    return out


def escape_step(curve: list[list[float]]) -> int | None:
    """The first validation step with accuracy >= 2/3; None when there is none."""
    return next((int(s) for s, acc, _ in curve if acc >= THRESHOLD), None)


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")


def save_json(obj: dict, path: str) -> None:
    """Write JSON atomically (a temporary file, then os.replace)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def run_one(cell: str, seed: int, args) -> str:
    """Train one cell and seed (skipped when its JSON exists); returns a line for the console."""
    out = os.path.join(args.out, f"{cell}-s{seed}.json")
    if os.path.exists(out):
        return f"{cell} seed {seed}: done before"
    run_dir = os.path.join(args.runs, f"{cell}-s{seed}")
    argv = fit_argv(cell, seed, args.steps, run_dir, args.stop_at, args.sampler)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    with open(run_dir + ".log", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own CPU time, whatever else runs
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cell} seed {seed}: diffmm fit failed, see {run_dir}.log")
    train_s = time.perf_counter() - t0
    metrics = os.path.join(run_dir, "csv", "metrics.csv")
    curve = val_curve(metrics)
    esc = escape_step(curve)
    _, attn_type, lambda_init, scale = CELLS[cell]
    result = {"cell": cell, "seed": seed, "attn_type": attn_type, "lambda_init": lambda_init, "scale": scale,
              "sampler": args.sampler, "escape_step": esc, "threshold": THRESHOLD, "stop_at": args.stop_at,
              "max_steps": args.steps, "steps_run": int(curve[-1][0]) if curve else 0,
              "val_every": VAL_EVERY, "val_examples": VAL_EXAMPLES, "val_curve": curve,
              "lambda_end": last_lambdas(metrics), "command": shlex.join(["diffmm", *argv[1:]]),
              "train_seconds": train_s, "cpu_seconds": usage.ru_utime + usage.ru_stime, "torch_threads": args.threads,
              "cpu": cpu_model(), "load_end": os.getloadavg()}
    save_json(result, out)
    return (f"{cell} seed {seed}: escaped at {esc if esc is not None else f'- (censored at {args.steps})'}, "
            f"ran {result['steps_run']} steps in {train_s:.0f} s ({result['cpu_seconds']:.0f} CPU s), "
            f"load {result['load_end'][0]:.1f}")


def write_summary(folder: str) -> str:
    """Survival summary of the run JSONs in ``folder``: summary.json, table.md, survival.png; returns the table."""
    from survival import load_runs, plot, summarize, table
    cells = load_runs(folder)
    summary = summarize({c: cells[c] for c in CELLS if c in cells}, REFERENCE)
    save_json(summary, os.path.join(folder, "summary.json"))
    text = table(summary)
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write(text)
    plot(summary, os.path.join(folder, "survival.png"))
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(range(10)))
    p.add_argument("--steps", type=int, default=700, help="max_steps: the schedule's length and the censoring step")
    p.add_argument("--stop-at", type=float, default=0.8, help="stop once validation accuracy exceeds this")
    p.add_argument("--sampler", default="zoology", choices=["zoology", "diffmm"])
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--out", default="results/mechanism/mqar")
    p.add_argument("--runs", default="runs/mechanism/mqar")
    p.add_argument("--summarize", action="store_true", help="only summarize the JSONs already in --out")
    args = p.parse_args()
    if args.stop_at < THRESHOLD:
        p.error(f"--stop-at must be at least the escape threshold {THRESHOLD:.3f} (a stopped run must have escaped)")
    if not args.summarize:
        os.makedirs(args.runs, exist_ok=True)
        os.makedirs(args.out, exist_ok=True)
        jobs = [(cell, seed) for seed in args.seeds for cell in args.cells]  # seed-major: every cell gets seed 0 first
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.jobs) as pool:
            for done in as_completed([pool.submit(run_one, *j, args) for j in jobs]):
                print(f"[{time.perf_counter() - t0:6.0f} s] {done.result()}", flush=True)
    print(write_summary(args.out), end="")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
