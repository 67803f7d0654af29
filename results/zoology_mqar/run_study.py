"""MQAR, the field's way: the width-64 recall configs trained on Zoology's sampling vs diffmm's, seeds paired.

Each run is ``diffmm fit --config configs/recall_{transformer,diff}_tiny.yaml`` with only the data sampler (and
optionally the noise) changed, validated every 20 steps on fresh sequences of the training settings (16 tokens,
2 and 4 pairs) of its own sampler; then ``diffmm eval recall`` scores the final checkpoint on both samplers' data.
"Left chance" = the first validation step whose answer accuracy is at least twice chance (2/3: the pooled chance
of the 2- and 4-pair settings is 1/3; above the 0.45 that answering by query rank alone scores on Zoology's
order); None when no validation step reached it. "Plateau": the mean validation accuracy from step 60 until 60
steps before the run left (to the end if it never did).

    PYTHONPATH=. nice -n 10 python results/zoology_mqar/run_study.py --out results/zoology_mqar --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from diffmm.data.recall import RecallTask, query_order_stats

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODELS = {"transformer": "configs/recall_transformer_tiny.yaml", "diff": "configs/recall_diff_tiny.yaml",
          "diff_v2": "configs/recall_diff_v2_tiny.yaml"}
VAL_EVERY, VAL_EXAMPLES = 20, 128
CHANCE = (2 * 0.5 + 4 * 0.25) / 6  # pooled over the answers of 2- and 4-pair sequences (equal sequence counts)
THRESHOLD = 2 * CHANCE
EVAL_ARGS = ["--seq_len", "[16,32,64,128,256,512]", "--pairs", "[2,4,8]", "--examples", "64", "--attention", "false"]


def machine() -> dict:
    with open("/proc/cpuinfo") as f:
        models = sorted({line.split(":", 1)[1].strip() for line in f if line.startswith("model name")})
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    return {"cpu_model": models, "cpus": os.cpu_count(), "uptime": uptime, "python": platform.python_version(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def save(obj: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def diffmm_cmd() -> list[str]:
    return [sys.executable, "-c", "import sys; from diffmm.cli import main; sys.exit(main())"]


def read_curves(root: str) -> tuple[list, list]:
    with open(max(glob.glob(os.path.join(root, "csv", "version_*", "metrics.csv")))) as f:
        rows = list(csv.DictReader(f))
    val = [(int(r["step"]) + 1, float(r["val/accuracy"]), float(r["val/loss"])) for r in rows if r.get("val/accuracy")]
    train = [(int(r["step"]) + 1, float(r["train/accuracy"]), float(r["train/loss"])) for r in rows
             if r.get("train/accuracy")]
    return val, train


def one_run(model: str, sampler: str, noise: float, seed: int, steps: int, work: str, out: str) -> dict:
    name = f"{model}-{sampler}-noise{noise:g}-s{seed}"
    path = os.path.join(out, "runs", f"{name}.json")
    if os.path.exists(path):
        return load(path)
    root = os.path.join(work, name)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=ROOT)
    fit = diffmm_cmd() + [
        "fit", "--config", os.path.join(ROOT, MODELS[model]), "--seed_everything", str(seed),
        "--data.init_args.seed", str(seed), "--data.init_args.sampler", sampler, "--data.init_args.noise", str(noise),
        "--data.init_args.val_seq_lens", "[16]", "--data.init_args.val_num_pairs", "[2,4]",
        "--data.init_args.val_examples", str(VAL_EXAMPLES), "--trainer.max_steps", str(steps),
        "--trainer.val_check_interval", str(VAL_EVERY), "--trainer.default_root_dir", root,
        "--trainer.enable_progress_bar", "false", "--checkpoint.every_n_train_steps", str(steps)]
    t0 = time.perf_counter()
    with open(root + ".log", "w") as log:
        subprocess.run(fit, env=env, check=True, stdout=subprocess.DEVNULL, stderr=log)
    train_s = time.perf_counter() - t0
    val, train = read_curves(root)
    left = next((s for s, acc, _ in val if acc >= THRESHOLD), None)
    evals = {}
    for eval_sampler in ("diffmm", "zoology"):
        js = os.path.join(work, f"{name}-eval-{eval_sampler}.json")
        subprocess.run(diffmm_cmd() + ["eval", "recall", "--lm", os.path.join(root, "checkpoints", "last.ckpt"),
                                       "--noise", str(noise), "--sampler", eval_sampler, "--seed", str(seed),
                                       "--progress", "false", "--device", "cpu", "--out", js] + EVAL_ARGS,
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        d = load(js)
        evals[eval_sampler] = {k: d[k] for k in ("accuracy", "chance", "rank_chance", "accuracy_by_task",
                                                 "accuracy_by_pairs", "accuracy_by_seq_len")}
    res = {"model": model, "config": MODELS[model], "sampler": sampler, "noise": noise, "seed": seed, "steps": steps,
           "left_chance_step": left, "threshold": THRESHOLD, "val_every": VAL_EVERY, "val_examples": VAL_EXAMPLES,
           "final_val_accuracy": val[-1][1] if val else None, "max_val_accuracy": max(a for _, a, _ in val),
           "val_curve": val, "train_curve": train, "eval": evals, "train_seconds": train_s, "machine": machine()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save(res, path)
    print(f"{name}: left chance at {left}, final val {res['final_val_accuracy']:.3f}, eval diffmm "
          f"{evals['diffmm']['accuracy']:.3f} zoology {evals['zoology']['accuracy']:.3f} ({train_s:.0f} s)", flush=True)
    return res


def plateau(run: dict) -> float:
    """Mean validation accuracy from step 60 until 60 steps before the run left chance (to the end if it never did)."""
    end = run["steps"] if run["left_chance_step"] is None else run["left_chance_step"] - 60
    return float(np.mean([a for st, a, _ in run["val_curve"] if 60 <= st <= end]))


def aggregate(runs: list[dict]) -> dict:
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(f"{r['model']}|{r['sampler']}|{r['noise']:g}", []).append(r)
    out = {}
    for key, rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        left = [r["left_chance_step"] for r in rs]
        hit = [s for s in left if s is not None]

        def ms(xs):
            return {"mean": float(np.mean(xs)), "std": float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0,
                    "values": [float(x) for x in xs]}

        out[key] = {"seeds": [r["seed"] for r in rs], "steps": rs[0]["steps"], "left_chance_step": left,
                    "left_on": f"{len(hit)}/{len(rs)}", "left_chance_step_stats": ms(hit) if hit else None,
                    "final_val_accuracy": ms([r["final_val_accuracy"] for r in rs]),
                    "plateau_val_accuracy": ms([plateau(r) for r in rs]),
                    "eval_on_diffmm_data": ms([r["eval"]["diffmm"]["accuracy"] for r in rs]),
                    "eval_on_zoology_data": ms([r["eval"]["zoology"]["accuracy"] for r in rs]),
                    "eval_chance": rs[0]["eval"]["diffmm"]["chance"],
                    "eval_rank_chance": {s: ms([r["eval"][s]["rank_chance"] for r in rs]) for s in ("diffmm", "zoology")}}
    return out


def table(groups: dict) -> str:
    """Markdown: one row per model x sampler (x noise), steps of leaving the plateau and accuracies, mean ± std."""
    def pm(d, pct=True):
        k = 100 if pct else 1
        return f"{k * d['mean']:.1f} ± {k * d['std']:.1f}" if pct else f"{d['mean']:.0f} ± {d['std']:.0f}"

    rows = [("| model | training data | seeds | left the plateau at step (per seed) | mean ± std | plateau val "
             "accuracy % | final val accuracy % | eval on diffmm data % | eval on Zoology data % |"),
            "|---|---|---|---|---|---|---|---|---|"]
    for key, g in groups.items():
        model, sampler, noise = key.split("|")
        steps = ", ".join("-" if s is None else str(s) for s in g["left_chance_step"])
        mean = pm(g["left_chance_step_stats"], pct=False) if g["left_chance_step_stats"] else "never"
        rows.append(f"| {model} | {sampler}, noise {noise}, {g['steps']} steps | {len(g['seeds'])} | {steps} "
                    f"({g['left_on']}) | {mean} | {pm(g['plateau_val_accuracy'])} | {pm(g['final_val_accuracy'])} | "
                    f"{pm(g['eval_on_diffmm_data'])} | {pm(g['eval_on_zoology_data'])} |")
    return "\n".join(rows) + "\n"


def val_rank_chance(sampler: str, noise: float) -> float:
    """What answering by query rank alone scores on the validation settings (answers pooled, as val/accuracy)."""
    stats = [(n, query_order_stats(RecallTask(vocab_size=64, seq_len=16, num_pairs=n, noise=noise, sampler=sampler),
                                   8192, seed=0)["rank_chance"]) for n in (2, 4)]
    return sum(n * c for n, c in stats) / sum(n for n, _ in stats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "results", "zoology_mqar"))
    p.add_argument("--work", default="runs/zoology_mqar")
    p.add_argument("--models", nargs="+", default=["transformer", "diff"])
    p.add_argument("--samplers", nargs="+", default=["diffmm", "zoology"])
    p.add_argument("--noise", type=float, nargs="+", default=[0.25])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    jobs = [(m, s, n, seed) for seed in a.seeds for n in a.noise for s in a.samplers for m in a.models]
    start = machine()
    with ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(lambda j: one_run(*j, a.steps, a.work, a.out), jobs))
    runs = [load(f) for f in sorted(glob.glob(os.path.join(a.out, "runs", "*.json")))]
    save({"threshold": THRESHOLD, "chance": CHANCE, "definition": __doc__.split("\n\n")[1],
          "val_rank_chance": {f"{s}|{n:g}": val_rank_chance(s, n) for s in a.samplers for n in a.noise},
          "groups": aggregate(runs), "machine_at_start": start, "machine_at_end": machine()},
         os.path.join(a.out, "aggregate.json"))
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table(aggregate(runs)))


if __name__ == "__main__":
    main()
