"""One prepared command for a lent GPU: correctness, speed and training of the fused kernel, results as it goes.

    PYTHONPATH=. python scripts/gpu_check.py                       # CUDA; writes results/gpu/<date>-<gpu>.{json,md}
    PYTHONPATH=. timeout 540 python scripts/gpu_check.py --out $OUT/gpu      # on the device machine
    PYTHONPATH=. python scripts/gpu_check.py --dry-run             # CPU rehearsal: toy sizes, TRITON_INTERPRET=1

Parts, in this order (``--parts 1,3`` or ``--parts correctness,diff_v2`` selects some):

1. ``correctness``: ``backend="triton"`` (and ``flash`` when flash-attn imports) against ``reference`` in
   bf16 / fp16 / fp32, forward and the gradients of q, k, v, lambda and the norm weight; causal and not, key
   padding, GQA, S != N, d = 64 and 128, odd lengths, fully masked rows (``scripts/gpu_check_correctness.py``).
2. ``speed``: fused vs unfused paths vs standard attention of equal width, N = 1k/4k/16k, fwd and fwd+bwd,
   bf16, TFLOP/s of SPEC section 4 and peak memory; autotuned tiles checked at N <= 4k (``gpu_check_speed.py``).
3. ``diff_v2``: DIFF V1 and V2 layers against standard: prefill, training step, decode (``gpu_check_models.py``).
4. ``train``: one bf16 training step of DiffCLIP-ViT-B/16 and of 4 layers of the 830M / 1.4B DIFF LM shapes,
   ``triton`` vs ``sdpa`` (equal first-step losses), samples or tokens per second (``gpu_check_models.py``).

Each part gets a share of ``--budget-s`` (default 480 s; unused time passes on); a part out of time skips its
remaining cases and says so, and once the budget is gone the remaining parts are skipped with the reason. Every
part runs in try/except, so one failure is recorded and the rest continue. The JSON and the markdown summary are
rewritten after every case, so a run cut off by ``timeout`` still leaves what it measured.

Needs torch (and triton) only: open_clip, webdataset, jsonargparse and Lightning are never imported.
Exit code: 0 all checks passed; 1 a correctness check failed (kernel vs reference, tuned tiles, fully masked
rows, train-step losses) or the correctness part crashed; 2 usage (no CUDA without ``--dry-run``); 3 another
part crashed.
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

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("correctness", "speed", "diff_v2", "train")
TITLES = {"correctness": "1. Correctness: triton (and flash) vs reference",
          "speed": "2. Attention speed, TFLOP/s and memory (bf16)",
          "diff_v2": "3. DIFF V1 / V2 vs standard: prefill, training step, decode",
          "train": "4. Training step: DiffCLIP-ViT-B/16 and DIFF LM layer stacks, triton vs sdpa"}
SHARE = {"correctness": 0.15, "speed": 0.45, "diff_v2": 0.12, "train": 0.28}  # of what the pre-compile leaves
PREWARM_SHARE = 0.25  # at most this part of the budget for the parallel pre-compile
OPTIONAL = ("open_clip", "webdataset", "jsonargparse", "lightning", "pytorch_lightning")


def parse_parts(spec: str | None) -> list[str]:
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


def _versions(torch) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for mod in ("triton", "flash_attn"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001  (not installed, or a broken build)
            out[mod] = None
    return out


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _command(argv: list[str]) -> str:
    """The command line with the output folder left out (it names a path of the machine that ran it)."""
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            args.append("--out DIR")
        elif a.startswith("--out="):
            args.append("--out DIR")
        else:
            args.append(a)
    return " ".join(["python scripts/gpu_check.py", *args])


def _kernel_stats(S) -> list:
    try:
        return S.kernel_stats()
    except Exception as e:  # noqa: BLE001  (bookkeeping must never stop the run)
        return [{"kernel": "?", "error": f"{type(e).__name__}: {e}"[:200]}]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        parts = parse_parts(args.parts)
    except ValueError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    # Triton decides interpretation when it is imported: set (or clear) the flag before anything imports it.
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    forced_backend = os.environ.pop("DIFFMM_ATTN_BACKEND", None)  # measure automatic dispatch
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    t0 = time.time()

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    import diffmm.ops  # noqa: F401  (registers the backends, the fused kernel among them when triton imports)

    if args.dry_run:
        try:
            from diffmm.ops import triton_diff
            interp = triton_diff._interpreting()
        except ImportError:
            interp = False
        if not interp:
            print("gpu_check --dry-run: the Triton kernels are not interpreted (triton missing, or imported before "
                  "TRITON_INTERPRET=1 could be set)", file=sys.stderr)
            return 2

    import gpu_check_correctness as C
    import gpu_check_models as M
    import gpu_check_speed as S
    import gpu_check_warm as W
    from gpu_check_lib import Ctx, Recorder, err_line

    if args._warm:
        return W.worker(args._warm, args.dry_run, parts)

    device = torch.device("cpu" if args.dry_run else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be exact (16-bit paths unaffected)
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(device)
    slug = "cpu-dryrun" if args.dry_run else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    date = time.strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="gpu_check_")) if args.dry_run
                                            else ROOT / "results" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": date, "t0": t0, "device_name": name, "dry_run": args.dry_run, "budget_s": args.budget_s,
            "parts": parts, "command": _command(argv), "git_commit": _git_commit(), **_versions(torch),
            "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
            "ignored_env": {"DIFFMM_ATTN_BACKEND": forced_backend} if forced_backend else {}}
    rec = Recorder(str(out / f"{date}-{slug}.json"), str(out / f"{date}-{slug}.md"), meta,
                   {"correctness": C.markdown, "speed": S.markdown, "diff_v2": M.layers_markdown,
                    "train": M.train_markdown, "kernels": S.kernels_markdown})
    runners = {"correctness": C.run_part, "speed": S.run_part, "diff_v2": M.run_layers, "train": M.run_train}
    ctx = Ctx(device=device, dry=args.dry_run, t0=t0, deadline=t0 + args.budget_s, rec=rec)
    print(f"# gpu_check: {name}, torch {meta['torch']}, triton {meta['triton']}, flash-attn {meta['flash_attn']}, "
          f"parts {', '.join(parts)}, budget {args.budget_s:.0f} s -> {rec.json_path}", flush=True)
    for p in parts:
        rec.part(p)["title"] = TITLES[p]
    rec.save()

    jobs = args.jobs if args.jobs is not None else (0 if args.dry_run else max(1, min(12, (os.cpu_count() or 4) - 2)))
    if jobs > 0 and time.time() < ctx.deadline:
        try:
            meta["prewarm"] = W.prewarm(ctx, str(Path(__file__).resolve()), jobs, parts, PREWARM_SHARE * args.budget_s)
        except Exception as e:  # noqa: BLE001  (without it the parts compile as they go)
            meta["prewarm"] = {"error": err_line(e)}
            ctx.progress("0/prewarm", f"failed: {err_line(e)}")
        rec.save()

    crashed = []
    t_parts = time.time()
    total_share, used_share = sum(SHARE[p] for p in parts), 0.0
    for p in parts:
        part = rec.part(p)
        used_share += SHARE[p]  # unused time passes to later parts
        ctx.part_deadline = t_parts + (ctx.deadline - t_parts) * used_share / total_share
        if time.time() >= ctx.deadline:
            part.update(status="skipped", reason=f"global budget of {args.budget_s:.0f} s used up")
            print(f"# part {p}: skipped ({part['reason']})", flush=True)
            rec.save()
            continue
        part["status"] = "running"
        n_fail = len(ctx.failures)
        t_part = time.time()
        print(f"# part {p}: until {ctx.part_deadline - t0:.0f} s", flush=True)
        rec.save()
        try:
            runners[p](ctx, part)
            budget_cut = any("budget" in s.get("reason", "") for s in part.get("skipped", []))
            part["status"] = "partial" if budget_cut else "ok"
        except Exception as e:  # noqa: BLE001  (record, run the other parts)
            part.update(status="error", reason=err_line(e), traceback=traceback.format_exc()[-4000:])
            traceback.print_exc()
            crashed.append(p)
            if p == "correctness":
                ctx.failures.append(f"correctness part crashed: {err_line(e)}")
        if len(ctx.failures) > n_fail:
            part["status"] += f", {len(ctx.failures) - n_fail} check(s) FAILED"
        part["wall_s"] = round(time.time() - t_part, 1)
        rec.result["failures"] = ctx.failures
        rec.result["kernels"] = _kernel_stats(S)
        rec.save()

    meta["optional_modules_imported"] = [m for m in OPTIONAL if m in sys.modules]
    rec.result["kernels"] = _kernel_stats(S)  # registers / spills of every compiled variant
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
