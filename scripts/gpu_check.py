"""One prepared command for a lent GPU: correctness, speed and training of the fused DIFF attention kernel.

On the device machine (device tool ``run`` with ``timeout_s=600``; what lands in ``$OUT/gpu`` comes back)::

    set -o pipefail; mkdir -p $OUT/gpu &&
      PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 540 python3 scripts/gpu_check.py --out $OUT/gpu 2>&1 |
      tee $OUT/gpu/log.txt

If a part fails, rerun it at once while the machine and Triton's cache are warm (``--parts 1 --budget-s 150``
under ``timeout 200``). Elsewhere::

    PYTHONPATH=. python scripts/gpu_check.py              # CUDA; writes results/gpu/<date>-<gpu>.{json,md}
    PYTHONPATH=. python scripts/gpu_check.py --dry-run    # CPU rehearsal: toy sizes, TRITON_INTERPRET=1

Parts, in this order (``--parts 1,3`` or ``--parts correctness,diff_v2`` selects some):

0. pre-compile (``--jobs``, on CUDA): a Triton compile of these kernels takes seconds and a full run needs over a
   hundred binaries, so worker processes first launch every kernel variant the run needs once at a tiny size
   (at most a quarter of the budget); Triton's disk cache is then full and the parts only load binaries.
1. ``correctness``: ``backend="triton"`` (and ``flash`` when flash-attn imports) against ``reference`` run in fp32
   on the same inputs, in bf16 / fp16 / fp32: output and gradients of q, k, v, lambda and the norm weight; causal
   and not, key padding, GQA, S != N, d = 64 and 128, odd lengths; fully masked rows must be exactly zero.
2. ``speed``: the fused kernel against the unfused SDPA layouts, the official four-call path, flash-attn and
   standard attention of equal width; bf16, N = 1k/4k/16k, forward and forward+backward: time, TFLOP/s (model
   FLOPs of docs/kernels.md, section 3) and peak memory. The autotuned tiles are checked at N <= 4k.
3. ``diff_v2``: one layer of DIFF V1 (arXiv 2410.05258), DIFF V2 and standard attention at equal width:
   prefill, training step and decoding, with each one's forward FLOPs relative to standard.
4. ``train``: one bf16 training step of DiffCLIP-ViT-B/16 and of 4 layers of the 830M / 1.4B DIFF LM shapes,
   ``triton`` vs ``sdpa`` from the same weights and batch (equal first-step losses), and the standard twins; the
   LMs train through the fused head loss, and the sdpa DIFF LM once more through the full logits (equal losses;
   time and peak memory of the two heads).

Each part gets a share of ``--budget-s`` (default 480 s; time a part does not use passes on); a part out of time
skips its remaining cases and says so, and once the budget is gone the remaining parts are recorded as skipped.
After each part the JSON's ``kernels`` records each autotuner's pick per key and every binary compiled (tile,
warps, stages, shared memory, the device's ``n_regs`` / ``n_spills``). One failing case or part is recorded and
the rest continue. The JSON and the markdown are rewritten after every case, so a run cut off still leaves them.

The parts live beside this file in ``scripts/gpucheck/`` (``record``: run context, timing and the recorder;
``kernels``: parts 1-2; ``models``: parts 3-4). Needs torch and triton, and imports only ``diffmm.ops``,
``diffmm.nn`` and the model classes (never open_clip, webdataset, jsonargparse or Lightning, which the device
machine does not have). Exit code: 0 all checks passed; 1 a correctness check failed (kernel vs reference, tuned
tiles, fully masked rows, train-step losses) or the correctness part crashed; 2 usage (no CUDA without
``--dry-run``); 3 another part crashed.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

if __name__ == "__main__":  # Triton decides on interpretation when first imported (by diffmm.ops below)
    if "--dry-run" in sys.argv[1:]:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
if str(Path(__file__).resolve().parent) not in sys.path:  # scripts/: the gpucheck package, also when run by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import diffmm.ops as ops  # noqa: E402
from diffmm.models.lm import LMConfig  # noqa: E402
from diffmm.ops import triton_diff_fwd, triton_targets  # noqa: E402
from diffmm.ops.triton_diff import HEAD_DIMS  # noqa: E402
from gpucheck.kernels import (DRY_CASES, GPU_CASES, SPEED_DRY, SPEED_GPU, Case, autotuning, make_inputs,  # noqa: E402
                              run_backend, run_correctness, run_speed)
from gpucheck.models import (CLIP_DRY, CLIP_GPU, LAYER_DRY, LAYER_GPU, LM_DRY, LM_GPU, clip_config,  # noqa: E402
                             run_layers, run_train)
from gpucheck.record import DTYPES, PARTS, Ctx, Recorder, err_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARE = {"correctness": 0.15, "speed": 0.45, "diff_v2": 0.12, "train": 0.28}  # of what the pre-compile leaves
PREWARM_SHARE = 0.25  # at most this part of the budget for the parallel pre-compile
OPTIONAL = ("open_clip", "webdataset", "jsonargparse", "lightning", "pytorch_lightning")

RUNNERS = {"correctness": run_correctness, "speed": run_speed, "diff_v2": run_layers, "train": run_train}


# ------------------------------------------------------------------------------------------ 0. pre-compile
# A kernel binary depends on the dtype, the constexprs (head dim, causal, padding, norm, tile) and on how the
# integer arguments specialise (== 1, divisible by 16): here the head count and the GQA ratio. Sequence lengths
# are not specialised, so a launch at a tiny size compiles the binary the measured sizes use. The cases are derived
# from the parts' own tables, so they stay in step with them.


def warm_cases(dry: bool, parts: list[str]) -> list[tuple[str, Case, bool]]:
    """(dtype, case, autotune) of every kernel variant the selected parts launch, heaviest first: each
    (d, h, h_kv, causal) of parts 2-4 with autotuning on (the autotuner compiles each candidate tile), then
    part 1's cases in each dtype with autotuning off."""
    variants = []
    if "speed" in parts:
        cfg = SPEED_DRY if dry else SPEED_GPU
        variants += [(d, cfg["width"] // (2 * d), cfg["width"] // (2 * d), causal) for d in cfg["dims"]
                     for causal in (False, True)]
    if "diff_v2" in parts:
        for c in LAYER_DRY if dry else LAYER_GPU:
            variants.append((c["dim"] // c["heads"], c["heads"] // 2, c["heads"] // 2, True))
    if "train" in parts:
        clip, lm = (CLIP_DRY, LM_DRY) if dry else (CLIP_GPU, LM_GPU)
        cfg = clip_config(clip["diff"], clip["overrides"])
        v, t = cfg.vision_cfg, cfg.text_cfg
        variants.append((v.head_width, v.heads // 2, v.heads // 2, False))  # the image tower is not causal
        variants.append((t.width // t.heads, t.heads // 2, t.heads // 2, True))
        for shape, over in lm["shapes"].items():
            c = LMConfig.from_name(f"diff-{shape}", **over)
            variants.append((c.head_dim, c.n_head // 2, c.n_kv_head // 2, True))
    tuned = "fp32" if dry else "bf16"
    cases = [(tuned, Case(f"tuned-d{d}-h{h}-kv{h_kv}-causal{int(causal)}", 1, 64, 64, h, h_kv, d, causal, False), True)
             for d, h, h_kv, causal in dict.fromkeys(variants) if d in HEAD_DIMS]
    if "correctness" in parts:
        cases += [(dt, c, False) for dt in (["fp16", "fp32"] if dry else ["bf16", "fp16", "fp32"])
                  for c in (DRY_CASES if dry else GPU_CASES)]
    return cases


def warm_worker(shard: str, dry: bool, parts: list[str]) -> int:
    """Run cases ``i::n`` of :func:`warm_cases` (``shard = 'i/n'``); one line each; exit 1 if any failed."""
    i, n = (int(x) for x in shard.split("/"))
    device, failed = torch.device("cpu" if dry else "cuda"), 0
    for dtype, case, tuned in warm_cases(dry, parts)[i::n]:
        start = time.time()
        try:
            with autotuning(tuned):
                run_backend("triton", case, *make_inputs(case, DTYPES[dtype], device))
            print(f"warm {dtype} {case.name}: {time.time() - start:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001  (the measured run will report it properly)
            failed += 1
            print(f"warm {dtype} {case.name}: FAILED {err_line(e)}", flush=True)
    return 1 if failed else 0


def prewarm(ctx: Ctx, jobs: int, parts: list[str], timeout_s: float) -> dict:
    """Run :func:`warm_cases` in ``jobs`` worker processes for at most ``timeout_s``; what happened, for the JSON."""
    n_cases = len(warm_cases(ctx.dry, parts))
    jobs = max(1, min(jobs, n_cases))
    start = time.time()
    ctx.progress("0/prewarm", f"{n_cases} kernel variants in {jobs} worker processes (at most {timeout_s:.0f} s)")
    argv = [sys.executable, str(Path(__file__).resolve()), "--parts", ",".join(parts)] + ["--dry-run"] * ctx.dry
    procs = [subprocess.Popen(argv + ["--_warm", f"{i}/{jobs}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")) for i in range(jobs)]
    logs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, start + timeout_s - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0] + "\n(killed: prewarm time limit)"
        codes.append(p.returncode)
        logs += out.strip().splitlines()
    failed = [line for line in logs if "FAILED" in line or "killed" in line or "Traceback" in line]
    times = [float(m.group(1)) for m in (re.search(r": ([0-9.]+) s$", line) for line in logs) if m]
    res = {"jobs": jobs, "tasks": n_cases, "done": len(times), "wall_s": round(time.time() - start, 1),
           "task_s_sum": round(sum(times), 1), "exit_codes": codes, "failed_lines": failed[:20]}
    ctx.progress("0/prewarm", f"{res['done']}/{n_cases} done in {res['wall_s']} s (compile + run {res['task_s_sum']}"
                              f" s summed over workers); worker exit codes {codes}" +
                 (f"; {len(failed)} problem line(s), first: {failed[0]}" if failed else ""))
    return res


# -------------------------------------------------------------------------------------------------- main


def parse_parts(spec: Optional[str]) -> list[str]:
    """``'1,3'`` or ``'correctness,diff_v2'`` -> part names in run order; a bad name is a one-line error."""
    if not spec:
        return list(PARTS)
    chosen = set()
    for item in spec.split(","):
        item = item.strip()
        name = PARTS[int(item) - 1] if item.isdigit() and 1 <= int(item) <= len(PARTS) else item
        if name not in PARTS:
            raise ValueError(f"--parts: unknown part {item!r}; expected 1-{len(PARTS)} or one of {', '.join(PARTS)}")
        chosen.add(name)
    return [p for p in PARTS if p in chosen]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="folder for <date>-<gpu>.json / .md (default results/gpu; dry run: a temp folder)")
    p.add_argument("--budget-s", type=float, default=480.0, help="global deadline in seconds (default 480)")
    p.add_argument("--parts", help="comma-separated parts to run: 1-4 or " + ", ".join(PARTS) + " (default all)")
    p.add_argument("--dry-run", action="store_true",
                   help="every part at toy sizes on CPU under TRITON_INTERPRET=1 (fp32/fp16; bf16 skipped)")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes that pre-compile the Triton kernels in parallel before the measured parts "
                        "(default: CPU cores - 2, at most 12, on CUDA; 0 in a dry run; 0 = compile as needed)")
    p.add_argument("--_warm", help=argparse.SUPPRESS)  # i/n: run as pre-compile worker i of n
    return p


def command_line(argv: list[str]) -> str:
    """The command line with the output folder left out (it names a path of the machine that ran it)."""
    args, words = [], iter(argv)
    for a in words:
        if a == "--out":
            next(words, None)  # the folder
        args.append("--out DIR" if a == "--out" or a.startswith("--out=") else a)
    return " ".join(["python scripts/gpu_check.py", *args])


def run_metadata(args, argv: list[str], parts: list[str], device: torch.device, t0: float) -> dict:
    """Device, versions, git commit and command of this run."""
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for mod in ("triton", "flash_attn"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001  (not installed, or a broken build)
            versions[mod] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:  # no git on the machine
        commit = None
    return {"date": time.strftime("%Y-%m-%d"), "t0": t0, "dry_run": args.dry_run, "budget_s": args.budget_s,
            "device_name": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(device),
            "parts": parts, "command": command_line(argv), "git_commit": commit, **versions,
            "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None}


def run_part(ctx: Ctx, part: dict, name: str) -> bool:
    """Run one part, recording its status; False when it crashed."""
    part.update(status="running", rows=[], skipped=[])
    n_fail, start = len(ctx.failures), time.time()
    print(f"# part {name}: until {ctx.part_deadline - ctx.t0:.0f} s", flush=True)
    ctx.rec.save()
    crashed = False
    try:
        RUNNERS[name](ctx, part)
        part["status"] = "partial" if any("budget" in s["reason"] for s in part["skipped"]) else "ok"
    except Exception as e:  # noqa: BLE001  (record it, run the other parts)
        part.update(status="error", reason=err_line(e), traceback=traceback.format_exc()[-4000:])
        traceback.print_exc()
        crashed = True
        if name == "correctness":
            ctx.failures.append(f"correctness part crashed: {err_line(e)}")
    if len(ctx.failures) > n_fail:
        part["status"] += f", {len(ctx.failures) - n_fail} check(s) FAILED"
    part["wall_s"] = round(time.time() - start, 1)
    return not crashed


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        parts = parse_parts(args.parts)
    except ValueError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    if args.dry_run and not triton_diff_fwd.INTERPRET:
        print("gpu_check --dry-run: the Triton kernels are not interpreted (TRITON_INTERPRET=1 was not set before "
              "diffmm.ops was imported)", file=sys.stderr)
        return 2
    forced_backend = os.environ.pop(ops.ENV_VAR, None)  # measure automatic dispatch
    if args._warm:
        return warm_worker(args._warm, args.dry_run, parts)

    t0 = time.time()
    device = torch.device("cpu" if args.dry_run else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be exact (16-bit paths unaffected)
    meta = run_metadata(args, argv, parts, device, t0)
    meta["ignored_env"] = {ops.ENV_VAR: forced_backend} if forced_backend else {}
    out = Path(args.out or (tempfile.mkdtemp(prefix="gpu_check_") if args.dry_run else ROOT / "results" / "gpu"))
    out.mkdir(parents=True, exist_ok=True)
    slug = "cpu-dryrun" if args.dry_run else re.sub(r"[^a-z0-9]+", "-", meta["device_name"].lower()).strip("-")
    rec = Recorder(out / f"{meta['date']}-{slug}.json", out / f"{meta['date']}-{slug}.md", meta)
    ctx = Ctx(device=device, dry=args.dry_run, t0=t0, deadline=t0 + args.budget_s, rec=rec)
    rec.result["failures"] = ctx.failures  # the same list: every save writes the failures so far
    print(f"# gpu_check: {meta['device_name']}, torch {meta['torch']}, triton {meta['triton']}, flash-attn "
          f"{meta['flash_attn']}, parts {', '.join(parts)}, budget {args.budget_s:.0f} s -> {rec.json_path}",
          flush=True)
    for p in parts:
        rec.part(p)
    rec.save()

    jobs = args.jobs if args.jobs is not None else (0 if args.dry_run else max(1, min(12, (os.cpu_count() or 4) - 2)))
    if jobs > 0 and time.time() < ctx.deadline:
        try:
            meta["prewarm"] = prewarm(ctx, jobs, parts, PREWARM_SHARE * args.budget_s)
        except Exception as e:  # noqa: BLE001  (without it the parts compile as they go)
            meta["prewarm"] = {"error": err_line(e)}
            ctx.progress("0/prewarm", f"failed: {err_line(e)}")
        rec.save()

    crashed = []
    t_parts, total_share, used_share = time.time(), sum(SHARE[p] for p in parts), 0.0
    for p in parts:
        used_share += SHARE[p]  # time a part does not use passes to the later ones
        ctx.part_deadline = t_parts + (ctx.deadline - t_parts) * used_share / total_share
        if time.time() >= ctx.deadline:
            rec.part(p).update(status="skipped", reason=f"global budget of {args.budget_s:.0f} s used up")
            print(f"# part {p}: skipped (global budget used up)", flush=True)
        elif not run_part(ctx, rec.part(p), p):
            crashed.append(p)
        try:  # tiles picked, n_regs / n_spills of each binary
            rec.result["kernels"] = triton_targets.process_report()
        except Exception as e:  # noqa: BLE001  (Triton internals of another version: record, go on)
            rec.result["kernels"] = {"error": err_line(e)}
        rec.save()

    meta["optional_modules_imported"] = [m for m in OPTIONAL if m in sys.modules]
    code = 1 if ctx.failures else (3 if crashed else 0)
    rec.result["exit_code"] = code
    rec.save()
    print(f"# done in {time.time() - t0:.0f} s: {len(ctx.failures)} failed check(s), crashed parts: "
          f"{', '.join(crashed) or 'none'}; exit {code}", flush=True)
    for f in ctx.failures:
        print(f"#   FAILED {f}", flush=True)
    print(f"# results: {rec.json_path}\n#          {rec.md_path}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
