"""Benchmark attention layers on CPU at equal width: time and peak memory, fp32, whole layers (projections included).

Two comparisons (run from the repo root with ``PYTHONPATH=.``):

default: implementations of differential attention
    diffmm ``nn.DiffAttention`` with each CPU backend (auto, sdpa combined / split / pair layouts, reference),
    timm ``DiffAttention`` (fused SDPA path, two calls) and a standard-attention layer of equal width
    (``diffmm.nn.Attention``, 2h heads of dim d, SDPA); forward and forward+backward. Every case runs in a
    fresh subprocess: peak memory of one call of each first, then the median of ``--reps`` timed calls.

``--v2``: standard attention vs DIFF V1 vs DIFF V2
    One layer of each type built by ``create_attention(type, dim, 2 heads)`` (same width, same standard head
    count), causal, RoPE off, in three modes: ``fwd`` (prefill under ``torch.no_grad``), ``fwdbwd`` (forward +
    backward of ``out.sum()``, the layer's training step) and ``decode`` (one new token attending to a KV cache
    of N positions; time per token over a burst of decode steps). The three layers take turns in every
    repetition, so machine noise hits all alike; the peak memory of each cell is measured in a fresh
    subprocess after one call at N = 64. The table adds the forward matmul-FLOP ratio to standard
    (``forward_flops``), the arithmetic floor the measured ratio should be compared with: V2 runs twice the
    query maps, so its attention core costs 2x.

Peak memory is the rise of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) over its RSS
before the call. The JSON records the CPU model, torch version, threads and the 1-minute load average at start
and end. GPU figures (the fused Triton kernel, TFLOP/s, CUDA memory, the V2 rows in bf16) come from
``scripts/gpu_check.py``, the one prepared command for a lent GPU.

Examples::

    PYTHONPATH=. python scripts/bench_attention.py --device cpu --quick
    PYTHONPATH=. python scripts/bench_attention.py --device cpu --causal --n 1024 4096 --json bench.json
    PYTHONPATH=. python scripts/bench_attention.py --v2 --threads 2 --json bench_v2.json
    PYTHONPATH=. python scripts/bench_attention.py --profile 14 --only diffmm-auto,standard-sdpa --causal
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from timm.layers.diff_attention import DiffAttention as TimmDiffAttention

from bench_common import environment, interleaved_rounds, print_profile, warm_up, write_json
from diffmm.nn import Attention, DiffAttention
from diffmm.ops import AttentionCall, select_backend
from diffmm.ops.sdpa import _layout
from gpucheck.models import DECODE_INNER, forward_flops, layer_step

IMPLS = ["diffmm-auto", "diffmm-sdpa-combined", "diffmm-sdpa-split", "diffmm-sdpa-pair", "diffmm-reference", "timm",
         "standard-sdpa"]
V2_TYPES = ("standard", "diff", "diff_v2")


def status_mib(key: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of this process, MiB."""
    return int(re.search(rf"^{key}:\s*(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def peak_rise_mb(fn) -> float:
    """Run ``fn`` once; return how far the process's peak RSS rose above its RSS before the call."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    before = status_mib("VmRSS")
    fn()
    return status_mib("VmHWM") - before


def run_child(args, layer: str, N: int, *extra: str) -> dict:
    """One case in a fresh subprocess of this script: its JSON result, or ``{"error": its last stderr line}``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", layer, "--n", str(N), "--dim", str(args.dim),
           "--heads", str(args.heads), "--batch", str(args.batch), "--reps", str(args.reps), *extra]
    cmd += (["--causal"] if args.causal else []) + (["--threads", str(args.threads)] if args.threads else [])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a test tool, not a CPU backend to time
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------ implementations of differential attention


def make_layer(impl: str, dim: int, heads: int, causal: bool):
    """The layer of ``impl`` (fp32, eval mode: no dropout) and the keyword arguments of its call."""
    if impl == "timm":
        return TimmDiffAttention(dim, num_heads=heads).eval(), {"is_causal": causal}
    if impl == "standard-sdpa":
        return Attention(dim, 2 * heads, backend="sdpa").eval(), {"causal": causal}
    backend = {"diffmm-auto": None, "diffmm-reference": "reference"}.get(impl, "sdpa")
    if impl.startswith("diffmm-sdpa-"):
        os.environ["DIFFMM_SDPA_LAYOUT"] = impl.rsplit("-", 1)[1]
    return DiffAttention(dim, heads, backend=backend).eval(), {"causal": causal}


def impl_child(impl: str, N: int, args) -> dict:
    """One case in this (fresh) process: memory first, then timings."""
    torch.manual_seed(0)
    layer, kw = make_layer(impl, args.dim, args.heads, args.causal)
    x = torch.randn(args.batch, N, args.dim, requires_grad=True)
    dy = torch.randn(args.batch, N, args.dim)

    def fwd():
        with torch.no_grad():
            return layer(x, **kw)

    def fwd_bwd():
        layer(x, **kw).backward(dy)

    res = {"impl": impl, "N": N, "threads": torch.get_num_threads()}
    if impl == "diffmm-auto":
        q = torch.empty(1, N, 2 * args.heads, args.dim // (2 * args.heads))
        call = AttentionCall("diff", q, None, args.causal, q.shape[-1], 2 * q.shape[-1])
        res["auto_backend"] = select_backend(call).name
        if res["auto_backend"] == "sdpa":
            res["auto_backend"] += "/" + _layout(None, q.device, N)
    res["fwd_peak_mb"] = peak_rise_mb(fwd)
    res["fwdbwd_peak_mb"] = peak_rise_mb(fwd_bwd)
    # the memory runs above were the warm-up
    times, _ = interleaved_rounds({"fwd_ms": fwd, "fwdbwd_ms": fwd_bwd}, args.reps, 1, cpu_time=False)
    res.update({name: 1e3 * statistics.median(t) for name, t in times.items()})
    res["loadavg_1m"] = os.getloadavg()[0]
    return res


def profile_impls(args) -> int:
    """torch.profiler table (top ``args.profile`` ops by self CPU time) of a few forward+backward passes of each
    layer in ``--only`` (default: diffmm-auto and standard-sdpa) at each ``--n``, batch ``--batch``."""
    impls = args.only.split(",") if args.only else ["diffmm-auto", "standard-sdpa"]
    for N in args.n or [1024]:
        for impl in impls:
            torch.manual_seed(0)
            layer, kw = make_layer(impl, args.dim, args.heads, args.causal)
            layer.train()
            x = torch.randn(args.batch, N, args.dim, requires_grad=True)
            dy = torch.randn(args.batch, N, args.dim)
            for _ in range(2):
                layer(x, **kw).backward(dy)
            reps = args.reps or 3
            title = (f"{impl}: B={args.batch} N={N} width {args.dim}, {args.heads} differential heads, "
                     f"{'causal' if args.causal else 'non-causal'}, {reps} x forward+backward, "
                     f"{torch.get_num_threads()} threads")
            print_profile(title, lambda layer=layer, x=x, kw=kw, dy=dy, reps=reps:
                          [layer(x, **kw).backward(dy) for _ in range(reps)], args.profile)
    return 0


def run_impls(args) -> list[dict]:
    rows = []
    for N in args.n:
        for impl in args.only.split(",") if args.only else IMPLS:
            t0 = time.time()
            row = {"impl": impl, "N": N, **run_child(args, impl, N)}
            rows.append(row)
            if "error" in row:
                print(f"  {impl:18s} N={N}: FAILED ({row['error']})", flush=True)
                continue
            print(f"  {impl:18s} N={N}: fwd {row['fwd_ms']:.1f} ms, fwd+bwd {row['fwdbwd_ms']:.1f} ms, "
                  f"peak {row['fwdbwd_peak_mb']:.0f} MiB ({time.time() - t0:.0f} s)", flush=True)
    return rows


def impls_table(rows: list[dict], args) -> list[str]:
    d = args.dim // (2 * args.heads)
    lines = [f"B={args.batch}, width {args.dim}, {args.heads} differential heads of d={d} (standard: "
             f"{2 * args.heads} heads of d={d}), {'causal' if args.causal else 'non-causal'}, median of {args.reps}",
             "",
             "| layer | N | fwd ms | fwd+bwd ms | fwd peak MiB | fwd+bwd peak MiB | fwd+bwd vs timm |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    timm = {r["N"]: r for r in rows if r["impl"] == "timm" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['N']} | failed: {r['error'][:60]} | | | | |")
            continue
        name = r["impl"] + (f" (-> {r['auto_backend']})" if "auto_backend" in r else "")
        speed = f"{timm[r['N']]['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}x" if r["N"] in timm else "-"
        lines.append(f"| {name} | {r['N']} | {r['fwd_ms']:.1f} | {r['fwdbwd_ms']:.1f} | {r['fwd_peak_mb']:.0f} | "
                     f"{r['fwdbwd_peak_mb']:.0f} | {speed} |")
    return lines


# ---------------------------------------------------------------------- standard vs DIFF V1 vs DIFF V2 (--v2)


def v2_step(attn_type: str, mode: str, N: int, args):
    """A zero-argument callable running one measured call of a new causal layer of ``attn_type`` (fp32, CPU): the
    layers and steps of the GPU check's part 3 (``layer_step`` in scripts/gpucheck/models.py)."""
    return layer_step(attn_type, mode, N, v2_config(args), torch.device("cpu"), torch.float32)


def v2_config(args) -> dict:
    """The layer size of ``args`` as the GPU check's part 3 describes one: width, standard heads, batch."""
    return dict(dim=args.dim, heads=2 * args.heads, batch=args.batch)


def v2_child(attn_type: str, mode: str, N: int, args) -> dict:
    """In this (fresh) process: the rise of peak RSS during one call, after one call at N = 64."""
    v2_step(attn_type, mode, 64, args)()  # initialise thread pools / kernels on a tiny input
    return {"peak_mib": max(peak_rise_mb(v2_step(attn_type, mode, N, args)), 0.0)}


def run_v2(args) -> list[dict]:
    rows = []
    for N in args.n:
        for mode in args.modes:
            steps = {t: v2_step(t, mode, N, args) for t in V2_TYPES}
            warm_up(steps, 2)
            times, _ = interleaved_rounds(steps, args.reps, 1, cpu_time=False, tag=f"N={N} {mode} ")  # take turns
            del steps
            row = {"N": N, "mode": mode}
            for t in V2_TYPES:  # decode: per token
                row[f"{t}_ms"] = 1e3 * statistics.median(times[t]) / (DECODE_INNER if mode == "decode" else 1)
            for t in V2_TYPES:
                row[f"{t}_mib"] = run_child(args, t, N, "--v2", "--modes", mode).get("peak_mib")
            rows.append(row)
            print(f"  N={N} {mode}: " + ", ".join(f"{t} {row[f'{t}_ms']:.2f} ms" for t in V2_TYPES), flush=True)
    return rows


def v2_table(rows: list[dict], args) -> list[str]:
    lines = [f"B={args.batch}, width {args.dim}, {2 * args.heads} standard heads (d={args.dim // (2 * args.heads)}), "
             f"causal, automatic backend, median of {args.reps} interleaved repetitions; decode: ms per token", "",
             "| N | mode | standard ms | V1 ms | V2 ms | V1/std | V2/std | FLOPs V1/std | FLOPs V2/std | standard MiB "
             "| V1 MiB | V2 MiB |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        s, d1, d2 = r["standard_ms"], r["diff_ms"], r["diff_v2_ms"]
        f0, f1, f2 = (forward_flops(t, r["mode"], r["N"], v2_config(args)) for t in V2_TYPES)
        lines.append(f"| {r['N']} | {r['mode']} | {s:.2f} | {d1:.2f} | {d2:.2f} | {d1 / s:.2f}x | {d2 / s:.2f}x | "
                     f"{f1 / f0:.2f}x | {f2 / f0:.2f}x | {fmt(r['standard_mib'])} | {fmt(r['diff_mib'])} | "
                     f"{fmt(r['diff_v2_mib'])} |")
    return lines


# ------------------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu"], default="cpu", help="cpu only (GPU: scripts/gpu_check.py)")
    p.add_argument("--v2", action="store_true", help="compare standard attention, DIFF V1 and DIFF V2 layers")
    p.add_argument("--n", type=int, nargs="*", help="sequence lengths (default 1k 2k 4k; --v2: 1k 4k)")
    p.add_argument("--only", help="comma-separated layers: " + ",".join(IMPLS))
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd", "decode"], help="--v2: fwd, fwdbwd, decode")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--reps", type=int, help="timed repeats per case (median; default 3, --quick 2)")
    p.add_argument("--causal", action="store_true", help="causal masking (--v2: always)")
    p.add_argument("--dim", type=int, default=512, help="layer width")
    p.add_argument("--heads", type=int, default=4, help="differential heads (d = dim / (2 heads))")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="print torch.profiler's top K ops (self CPU time) of each --only layer, instead of timing")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        return profile_impls(args)
    if args.child:
        N = args.n[0]
        res = v2_child(args.child, args.modes[0], N, args) if args.v2 else impl_child(args.child, N, args)
        print(json.dumps(res))
        return 0

    args.causal = args.causal or args.v2
    args.n = args.n or ([1024, 4096] if args.v2 else [1024, 2048] if args.quick else [1024, 2048, 4096])
    args.reps = args.reps or (2 if args.quick else 3)
    env = environment()
    rows = run_v2(args) if args.v2 else run_impls(args)
    env["load_1m_end"] = os.getloadavg()[0]
    print(f"\nCPU ({env['cpu']}), fp32, torch {env['torch']}, {env['threads']} threads, whole layers incl. projections,"
          f" 1-min load average {env['load_1m_start']:.1f} at the start, {env['load_1m_end']:.1f} at the end (the "
          "machine may be shared)")
    print("\n".join(v2_table(rows, args) if args.v2 else impls_table(rows, args)))
    if args.json:
        write_json(args.json, {"device": "cpu", **env, "comparison": "v2" if args.v2 else "implementations",
                               "dim": args.dim, "heads": args.heads, "batch": args.batch, "causal": args.causal,
                               "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
