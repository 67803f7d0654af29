"""Benchmark differential attention: diffmm backends, timm, the official 4-call path, standard attention.

Two modes, one script (run from the repo root with ``PYTHONPATH=.``):

``--device cpu``
    Whole attention *layers* (projections included, so diffmm and timm are compared like with
    like): diffmm ``nn.DiffAttention`` with each CPU backend (auto, sdpa combined / split / pair layouts,
    reference), timm ``DiffAttention`` (fused SDPA path, two calls) and a standard-attention layer
    of equal width (``diffmm.nn.Attention``, 2h heads of dim d, SDPA), fp32. Every case runs in a
    fresh subprocess; peak memory is the rise of the process's peak RSS (VmHWM, reset through
    /proc/self/clear_refs) over its RSS before the call.

``--device cuda``
    Attention *ops* in bf16. First correctness of the fused kernel against the fp32 reference
    (relative errors of the output and every gradient), then forward and forward+backward time
    (``triton.testing.do_bench``, median ms), model TFLOP/s (docs/kernels.md, section 3) and peak CUDA memory
    for: the fused ``triton`` kernel, the SDPA ``pair`` (two calls) and ``split`` layouts, the
    official flashdiff_2-style path (four SDPA calls with d-wide V halves) and standard SDPA
    attention of equal width; N in {1k, 4k, 16k}, d in {64, 128}, causal and not, 16k tokens per
    batch at width 2048. Results go to a markdown table and, incrementally, to ``--json``.

Examples::

    PYTHONPATH=. python scripts/bench_attention.py --device cpu --quick
    PYTHONPATH=. python scripts/bench_attention.py --device cuda --json bench_cuda.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CPU_IMPLS = ["diffmm-auto", "diffmm-sdpa-combined", "diffmm-sdpa-split", "diffmm-sdpa-pair", "diffmm-reference", "timm",
             "standard-sdpa"]
CUDA_IMPLS = ["fused-triton", "sdpa-pair", "sdpa-split", "sdpa-combined", "official-4call", "standard-sdpa"]


# ----------------------------------------------------------------------------------------------- FLOPs


def diff_flops(B: int, h: int, N: int, S: int, d: int, causal: bool, bwd: bool) -> float:
    """Model FLOPs (docs/kernels.md, section 3): forward 12*N*S*d per differential head, backward 20*N*S*d;
    halved when causal."""
    f = (12 + (20 if bwd else 0)) * B * h * N * S * d
    return f / 2 if causal else f


def std_flops(B: int, H: int, N: int, S: int, d: int, causal: bool, bwd: bool) -> float:
    """Standard attention, H heads of dim d: forward 4*N*S*d per head, backward 2.5x that."""
    f = (4 + (10 if bwd else 0)) * B * H * N * S * d
    return f / 2 if causal else f


# ----------------------------------------------------------------------------------------------- CPU


def _mem_status() -> dict:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmHWM", "VmRSS")):
                key, val = line.split(":")
                out[key] = int(val.split()[0]) / 1024.0  # MiB
    return out


def _peak_rise_mb(fn) -> float:
    """Run ``fn`` once; return how far the process's peak RSS rose above its RSS before the call."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    before = _mem_status()["VmRSS"]
    fn()
    return _mem_status()["VmHWM"] - before


def _cpu_layer(impl: str, dim: int, heads: int):
    """Build the layer for ``impl`` (fp32, eval mode: no dropout)."""
    if impl == "timm":
        from timm.layers.diff_attention import DiffAttention as TimmDiff
        return TimmDiff(dim, num_heads=heads).eval(), {"is_causal": None}
    if impl == "standard-sdpa":
        from diffmm.nn import Attention
        return Attention(dim, 2 * heads, backend="sdpa").eval(), {}
    from diffmm.nn import DiffAttention
    backend = {"diffmm-auto": None, "diffmm-reference": "reference"}.get(impl, "sdpa")
    if impl.startswith("diffmm-sdpa-"):
        os.environ["DIFFMM_SDPA_LAYOUT"] = impl.rsplit("-", 1)[1]
    return DiffAttention(dim, heads, backend=backend).eval(), {}


def cpu_child(impl: str, N: int, dim: int, heads: int, causal: bool, reps: int) -> dict:
    """One case in this (fresh) process: memory first, then timings."""
    torch.manual_seed(0)
    layer, extra = _cpu_layer(impl, dim, heads)
    kw = {"is_causal": causal} if "is_causal" in extra else {"causal": causal}
    x = torch.randn(1, N, dim, requires_grad=True)
    dy = torch.randn(1, N, dim)

    def fwd():
        with torch.no_grad():
            return layer(x, **kw)

    def fwd_bwd():
        layer(x, **kw).backward(dy)

    res = {"impl": impl, "N": N, "threads": torch.get_num_threads()}
    if impl == "diffmm-auto":
        from diffmm.ops import AttentionCall, select_backend
        q = torch.empty(1, N, 2 * heads, dim // (2 * heads))
        res["auto_backend"] = select_backend(AttentionCall("diff", q, None, causal, q.shape[-1], 2 * q.shape[-1])).name
        if res["auto_backend"] == "sdpa":
            from diffmm.ops.sdpa import _layout
            res["auto_backend"] += "/" + _layout(None, q.device, N)
    res["fwd_peak_mb"] = _peak_rise_mb(fwd)
    res["fwdbwd_peak_mb"] = _peak_rise_mb(fwd_bwd)
    for name, fn in (("fwd_ms", fwd), ("fwdbwd_ms", fwd_bwd)):  # the memory runs above were the warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        res[name] = statistics.median(times)
    res["loadavg_1m"] = os.getloadavg()[0]
    return res


def profile_cpu(args) -> int:
    """torch.profiler table (top ``args.profile`` ops by self CPU time) of a few forward+backward passes of each
    layer in ``--only`` (default: diffmm-auto and standard-sdpa) at each ``--n``, batch ``--batch``."""
    from torch.profiler import ProfilerActivity, profile
    impls = args.only.split(",") if args.only else ["diffmm-auto", "standard-sdpa"]
    for N in args.n or [1024]:
        for impl in impls:
            torch.manual_seed(0)
            layer, extra = _cpu_layer(impl, args.dim, args.heads)
            layer.train()
            kw = {"is_causal": args.causal} if "is_causal" in extra else {"causal": args.causal}
            x = torch.randn(args.batch, N, args.dim, requires_grad=True)
            dy = torch.randn(args.batch, N, args.dim)
            for _ in range(2):
                layer(x, **kw).backward(dy)
            reps = args.reps or 3
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(reps):
                    layer(x, **kw).backward(dy)
            print(f"\n### {impl}: B={args.batch} N={N} width {args.dim}, {args.heads} differential heads, "
                  f"{'causal' if args.causal else 'non-causal'}, {reps} x forward+backward, "
                  f"{torch.get_num_threads()} threads (load {os.getloadavg()[0]:.1f})\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile,
                                            max_name_column_width=40))
    return 0


def run_cpu(args) -> list[dict]:
    impls = args.only.split(",") if args.only else CPU_IMPLS
    Ns = args.n or ([1024, 2048] if args.quick else [1024, 2048, 4096])
    reps = args.reps or (2 if args.quick else 3)  # the median of these; 1-minute load average is recorded too
    rows = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)  # the interpreter is a test tool, not a CPU backend to time
    for N in Ns:
        for impl in impls:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--n", str(N), "--dim", str(args.dim),
                   "--heads", str(args.heads), "--reps", str(reps)] + (["--causal"] if args.causal else [])
            t0 = time.time()
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                err = (out.stderr.strip().splitlines() or ["?"])[-1]
                print(f"  {impl:18s} N={N}: FAILED ({err})", flush=True)
                rows.append({"impl": impl, "N": N, "error": err})
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"  {impl:18s} N={N}: fwd {row['fwd_ms']:.1f} ms, fwd+bwd {row['fwdbwd_ms']:.1f} ms, "
                  f"peak {row['fwdbwd_peak_mb']:.0f} MiB ({time.time() - t0:.0f} s)", flush=True)
    return rows


def _loads(rows: list[dict]) -> str:
    loads = [r["loadavg_1m"] for r in rows if "loadavg_1m" in r]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?"


def cpu_table(rows: list[dict], args) -> str:
    d = args.dim // (2 * args.heads)
    lines = [f"CPU, fp32, B=1, width {args.dim}, {args.heads} differential heads of d={d} "
             f"(standard: {2 * args.heads} heads of d={d}), {'causal' if args.causal else 'non-causal'}, "
             f"whole layers incl. projections, {rows[0].get('threads', '?') if rows else '?'} threads, "
             f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
             f"1-min load average during the runs {_loads(rows)} (the machine is shared)",
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
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- CUDA



def _bench_ms(fn, grad_to_none=None) -> float:
    """Median milliseconds of ``fn`` on CUDA (triton's do_bench, else CUDA events)."""
    try:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))
    except ImportError:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            for t in grad_to_none or []:
                t.grad = None
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]


def _four_call(q, k, v, lam, w, causal):
    """Official flashdiff_2-style path: four attention calls with d-wide V halves, then the epilogue."""
    import torch.nn.functional as F
    from diffmm.ops.epilogue import diff_epilogue
    d = q.shape[-1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, 2h, N, d) (B, 2h, S, d) (B, h, S, 2d)
    q1, q2, k1, k2 = qt[:, 0::2], qt[:, 1::2], kt[:, 0::2], kt[:, 1::2]  # (B, h, N, d)
    va, vb = vt[..., :d], vt[..., d:]  # (B, h, S, d)
    o1 = torch.cat([F.scaled_dot_product_attention(q1, k1, va, is_causal=causal),
                    F.scaled_dot_product_attention(q1, k1, vb, is_causal=causal)], dim=-1)  # (B, h, N, 2d)
    o2 = torch.cat([F.scaled_dot_product_attention(q2, k2, va, is_causal=causal),
                    F.scaled_dot_product_attention(q2, k2, vb, is_causal=causal)], dim=-1)
    return diff_epilogue(o1, o2, lam, norm_weight=w, lambda_init=0.2, out_dtype=q.dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cuda_correctness(dtype) -> list[dict]:
    """Fused kernel (and the SDPA pair path, for the bf16 noise floor) against the fp32 reference."""
    import diffmm.ops as ops
    rows = []
    # (B, N, S, h, h_kv, d, causal, pad): odd lengths, GQA, padding, S != N; few (d, causal, pad) combos
    # beyond the timed ones, so that little extra compiling is needed
    cases = [(2, 1000, 1000, 8, 4, 64, True, True), (2, 1000, 1000, 8, 8, 128, False, False),
             (2, 1000, 1000, 8, 2, 128, True, True), (1, 777, 1201, 4, 4, 64, True, False)]
    for B, N, S, h, h_kv, d, causal, pad in cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, N, 2 * h, d, device="cuda", generator=g).to(dtype)
        k = torch.randn(B, S, 2 * h_kv, d, device="cuda", generator=g).to(dtype)
        v = torch.randn(B, S, h_kv, 2 * d, device="cuda", generator=g).to(dtype)
        lam = torch.tensor(0.4, device="cuda")
        w = torch.rand(2 * d, device="cuda", generator=g) + 0.5
        dy = torch.randn(B, N, h, 2 * d, device="cuda", generator=g).to(dtype)
        km = (torch.rand(B, S, device="cuda", generator=g) > 0.1) if pad else None
        outs = {}
        for name, backend, ct in (("ref", "reference", torch.float32), ("triton", "triton", dtype),
                                  ("sdpa", "sdpa", dtype)):
            xs = [t.to(ct if t.dtype == dtype else t.dtype).detach().requires_grad_() for t in (q, k, v, lam, w)]
            try:
                y = ops.diff_attention(*xs[:4], causal=causal, attn_mask=km, norm_weight=xs[4], lambda_init=0.2,
                                       backend=backend)
                y.backward(dy.to(ct))
                outs[name] = [y] + [x.grad for x in xs]
            except Exception as e:  # noqa: BLE001  (report, keep going)
                outs[name] = str(e).splitlines()[0][:120]
        row = {"B": B, "N": N, "S": S, "h": h, "h_kv": h_kv, "d": d, "causal": causal, "pad": pad}
        for name in ("triton", "sdpa"):
            if isinstance(outs[name], str) or isinstance(outs["ref"], str):
                row[name] = outs[name] if isinstance(outs[name], str) else outs["ref"]
                continue
            row[name] = {k: _rel(a, b) for k, a, b in zip(("y", "dq", "dk", "dv", "dlam", "dw"), outs[name],
                                                            outs["ref"])}
        rows.append(row)
        t = row["triton"]
        print(f"  correctness N={N} S={S} d={d} h_kv={h_kv} causal={causal} pad={pad}: " +
              (t if isinstance(t, str) else " ".join(f"{k}={v:.1e}" for k, v in t.items())), flush=True)
    return rows


def _cuda_case(impl, B, N, h, d, causal, dtype, device="cuda"):
    """Inputs and a forward closure for one path (``device``: also used by scripts/gpu_check.py --dry-run)."""
    from diffmm.ops import diff_attention
    from diffmm.ops.sdpa import attention_sdpa, diff_attention_sdpa
    mk = lambda *s: torch.randn(*s, device=device, dtype=dtype).requires_grad_()  # noqa: E731
    if impl == "standard-sdpa":
        q, k, v = mk(B, N, 2 * h, d), mk(B, N, 2 * h, d), mk(B, N, 2 * h, d)
        return [q, k, v], lambda: attention_sdpa(q, k, v, causal=causal)
    q, k, v = mk(B, N, 2 * h, d), mk(B, N, 2 * h, d), mk(B, N, h, 2 * d)
    lam = torch.tensor(0.3, device=device, requires_grad=True)
    w = torch.ones(2 * d, device=device, requires_grad=True)
    leaves = [q, k, v, lam, w]
    kw = dict(causal=causal, norm_weight=w, lambda_init=0.2)
    if impl == "fused-triton":
        return leaves, lambda: diff_attention(q, k, v, lam, backend="triton", **kw)
    if impl in ("sdpa-pair", "sdpa-split", "sdpa-combined"):
        return leaves, lambda: diff_attention_sdpa(q, k, v, lam, layout=impl.split("-")[1], **kw)
    return leaves, lambda: _four_call(q, k, v, lam, w, causal)


def run_cuda(args) -> dict:
    dtype = torch.bfloat16
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bf16",
              "width": args.cuda_width, "tokens": args.tokens, "autotune": not args.no_autotune}
    t_start = time.time()
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    print(f"# {result['device']}, torch {torch.__version__}, triton {result['triton']}", flush=True)
    dump = (lambda: json.dump(result, open(args.json, "w"), indent=1)) if args.json else (lambda: None)
    if not args.skip_correctness:
        result["correctness"] = cuda_correctness(dtype)
        dump()
    impls = args.only.split(",") if args.only else CUDA_IMPLS
    Ns = args.n or ([1024, 4096] if args.quick else [1024, 4096, 16384])
    dims = [64] if args.quick else [64, 128]
    result["timings"] = []
    for d in dims:
        h = args.cuda_width // (2 * d)
        for N in Ns:
            B = max(1, args.tokens // N)
            for causal in (False, True):
                for impl in impls:
                    row = {"impl": impl, "d": d, "N": N, "B": B, "h": h, "causal": causal}
                    try:
                        leaves, fwd = _cuda_case(impl, B, N, h, d, causal, dtype)
                        dy = torch.randn_like(fwd())

                        def fwd_bwd():
                            fwd().backward(dy)
                        row["fwd_ms"] = _bench_ms(fwd)
                        row["fwdbwd_ms"] = _bench_ms(fwd_bwd, grad_to_none=leaves)
                        for t in leaves:
                            t.grad = None
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                        fwd_bwd()
                        torch.cuda.synchronize()
                        row["fwdbwd_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
                        fl = std_flops(B, 2 * h, N, N, d, causal, False) if impl == "standard-sdpa" else \
                            diff_flops(B, h, N, N, d, causal, False)
                        flb = std_flops(B, 2 * h, N, N, d, causal, True) if impl == "standard-sdpa" else \
                            diff_flops(B, h, N, N, d, causal, True)
                        row["fwd_tflops"] = fl / row["fwd_ms"] / 1e9
                        row["fwdbwd_tflops"] = flb / row["fwdbwd_ms"] / 1e9
                        print(f"  d={d} N={N} causal={causal} {impl:14s} fwd {row['fwd_ms']:.3f} ms "
                              f"({row['fwd_tflops']:.0f} TF/s)  fwd+bwd {row['fwdbwd_ms']:.3f} ms "
                              f"({row['fwdbwd_tflops']:.0f} TF/s)", flush=True)
                        del leaves, fwd, dy
                    except Exception as e:  # noqa: BLE001  (one failing path must not lose the others)
                        row["error"] = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                        print(f"  d={d} N={N} causal={causal} {impl:14s} FAILED: {row['error']}", flush=True)
                    result["timings"].append(row)
                    torch.cuda.empty_cache()
                    dump()
    result["summary"] = cuda_summary(result["timings"])
    result["wall_s"] = time.time() - t_start
    dump()
    return result


def cuda_summary(rows: list[dict]) -> list[dict]:
    """Per (d, N, causal): fused speedup over the best unfused diffmm path, DIFF/standard time ratios."""
    out = []
    keys = sorted({(r["d"], r["N"], r["causal"]) for r in rows})
    for key in keys:
        by = {r["impl"]: r for r in rows if (r["d"], r["N"], r["causal"]) == key and "error" not in r}
        if "fused-triton" not in by:
            continue
        f = by["fused-triton"]
        s = {"d": key[0], "N": key[1], "causal": key[2], "fused_fwd_tflops": f["fwd_tflops"]}
        unfused = [by[k]["fwdbwd_ms"] for k in ("sdpa-pair", "sdpa-split", "sdpa-combined") if k in by]
        if unfused:
            s["fwdbwd_speedup_vs_best_unfused"] = min(unfused) / f["fwdbwd_ms"]
        if "standard-sdpa" in by:
            s["fwd_ratio_vs_standard"] = f["fwd_ms"] / by["standard-sdpa"]["fwd_ms"]
            s["fwdbwd_ratio_vs_standard"] = f["fwdbwd_ms"] / by["standard-sdpa"]["fwdbwd_ms"]
        out.append(s)
    return out


def cuda_table(result: dict) -> str:
    lines = [f"{result['device']}, bf16, {result['tokens']} tokens per batch, width {result['width']}, "
             f"torch {result['torch']}, triton {result['triton']}; TFLOP/s from the model FLOPs of docs/kernels.md", "",
             "| d | N | causal | path | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd peak MiB |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in result["timings"]:
        if "error" in r:
            lines.append(f"| {r['d']} | {r['N']} | {r['causal']} | {r['impl']} | failed: {r['error'][:50]} | | | | |")
        else:
            lines.append(f"| {r['d']} | {r['N']} | {r['causal']} | {r['impl']} | {r['fwd_ms']:.3f} | "
                         f"{r['fwd_tflops']:.0f} | {r['fwdbwd_ms']:.3f} | {r['fwdbwd_tflops']:.0f} | "
                         f"{r['fwdbwd_peak_mb']:.0f} |")
    lines += ["", "| d | N | causal | fused fwd TFLOP/s | fused fwd+bwd speedup vs best unfused | "
                  "DIFF/standard fwd | DIFF/standard fwd+bwd |", "|---:|---:|---|---:|---:|---:|---:|"]
    for s in result.get("summary", []):
        lines.append(f"| {s['d']} | {s['N']} | {s['causal']} | {s['fused_fwd_tflops']:.0f} | "
                     f"{s.get('fwdbwd_speedup_vs_best_unfused', float('nan')):.2f}x | "
                     f"{s.get('fwd_ratio_vs_standard', float('nan')):.2f} | "
                     f"{s.get('fwdbwd_ratio_vs_standard', float('nan')):.2f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", type=int, nargs="*", help="sequence lengths (default cpu 1k 2k 4k; cuda 1k 4k 16k)")
    p.add_argument("--only", help="comma-separated paths; cpu: " + ",".join(CPU_IMPLS) + "; cuda: " +
                   ",".join(CUDA_IMPLS))
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--reps", type=int, help="timed repeats per CPU case (median)")
    p.add_argument("--causal", action="store_true", help="CPU mode: causal masking")
    p.add_argument("--dim", type=int, default=512, help="CPU layer width")
    p.add_argument("--heads", type=int, default=4, help="CPU differential heads (d = dim / (2 heads))")
    p.add_argument("--cuda-width", type=int, default=2048, help="CUDA width: h = width / (2 d)")
    p.add_argument("--tokens", type=int, default=16384, help="CUDA tokens per batch: B = tokens / N")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--no-autotune", action="store_true", help="CUDA: first fitting tile, no tuning (fast start)")
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="CPU: print torch.profiler's top K ops (self CPU time) of each --only layer, instead of timing")
    p.add_argument("--batch", type=int, default=1, help="CPU --profile: batch size")
    p.add_argument("--threads", type=int, help="CPU --profile: torch threads (default: current)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.profile:
        if args.threads:
            torch.set_num_threads(args.threads)
        return profile_cpu(args)
    if args.child:
        print(json.dumps(cpu_child(args.child, args.n[0], args.dim, args.heads, args.causal, args.reps)))
        return 0
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device here", file=sys.stderr)
            return 2
        if args.no_autotune:
            os.environ["DIFFMM_TRITON_AUTOTUNE"] = "0"  # read when diffmm.ops.triton_diff_fwd is imported
        result = run_cuda(args)
        print()
        print(cuda_table(result))
        return 0
    rows = run_cpu(args)
    print()
    print(cpu_table(rows, args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": "cpu", "torch": torch.__version__, "dim": args.dim, "heads": args.heads,
                       "causal": args.causal, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
