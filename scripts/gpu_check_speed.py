"""Part 2 of ``scripts/gpu_check.py``: speed, TFLOP/s (SPEC section 4) and peak memory of the attention paths.

Paths (inputs and closures from ``scripts/bench_attention.py``): the fused ``triton`` kernel, the SDPA ``pair``
and ``split`` layouts, the official flashdiff_2-style four SDPA calls, diffmm's ``flash`` backend and standard
attention of equal width (2h heads of d; SDPA, and flash-attn when installed). bf16, 16k tokens per batch at
width 2048 (B = 16k / N), N in {1k, 4k, 16k}, d in {64, 128}, causal and not; forward and forward+backward.
The fused kernel is autotuned here, so its tuned tiles are checked against the fp32 reference at N <= 4k (the
reference needs N x N memory): the same max-error metric and bf16 tolerance as part 1.
"""
from __future__ import annotations

import torch

import bench_attention as BA
from gpu_check_correctness import TOL, autotuning, compare
from gpu_check_lib import DTYPE_NAMES, Ctx, err_line, fmt, free_memory, peak_mib, time_ms

IMPLS = ["fused-triton", "sdpa-pair", "sdpa-split", "official-4call", "flash-diff", "standard-sdpa", "flash-standard"]
UNFUSED = ("sdpa-pair", "sdpa-split", "official-4call", "flash-diff")
STANDARD = ("standard-sdpa", "flash-standard")
TARGETS = {"speedup": 1.5, "fwd_tflops_d128": 450.0, "ratio": 1.7}  # issue 16, H200, bf16, N >= 4k

GPU = dict(width=2048, tokens=16384, Ns=[4096, 16384, 1024], dims=[128, 64], check_max_n=4096, dtype=torch.bfloat16)
DRY = dict(width=256, tokens=48, Ns=[48], dims=[64], check_max_n=48, dtype=torch.float32)


def make_case(impl: str, B: int, N: int, h: int, d: int, causal: bool, dtype, device):
    """(leaf tensors, forward closure) of one path; standard paths use 2h heads of d."""
    if impl in ("flash-diff", "flash-standard"):
        from diffmm.ops import attention, diff_attention

        mk = lambda *s: torch.randn(*s, device=device, dtype=dtype).requires_grad_()  # noqa: E731
        if impl == "flash-standard":
            q, k, v = mk(B, N, 2 * h, d), mk(B, N, 2 * h, d), mk(B, N, 2 * h, d)
            return [q, k, v], lambda: attention(q, k, v, causal=causal, backend="flash")
        q, k, v = mk(B, N, 2 * h, d), mk(B, N, 2 * h, d), mk(B, N, h, 2 * d)
        lam = torch.tensor(0.3, device=device, requires_grad=True)
        w = torch.ones(2 * d, device=device, requires_grad=True)
        return [q, k, v, lam, w], lambda: diff_attention(q, k, v, lam, causal=causal, norm_weight=w, lambda_init=0.2,
                                                         backend="flash")
    return BA._cuda_case(impl, B, N, h, d, causal, dtype, device=device)


def flops(impl: str, B: int, h: int, N: int, d: int, causal: bool, bwd: bool) -> float:
    if impl in STANDARD:
        return BA.std_flops(B, 2 * h, N, N, d, causal, bwd)
    return BA.diff_flops(B, h, N, N, d, causal, bwd)


def tuned_tile_check(leaves, fwd, dy, causal: bool, dtype) -> tuple[bool, dict]:
    """The fused kernel's output and gradients (tuned tiles) against the fp32 reference on the same inputs."""
    import diffmm.ops as ops

    q, k, v, lam, w = leaves
    for t in leaves:
        t.grad = None
    y = fwd()
    y.backward(dy)
    got = [y.detach().float()] + [t.grad.float() for t in leaves]
    xs = [t.detach().float().requires_grad_() for t in leaves]
    ref = ops.diff_attention(*xs[:4], causal=causal, norm_weight=xs[4], lambda_init=0.2, backend="reference")
    ref.backward(dy.float())
    want = [ref.detach()] + [x.grad for x in xs]
    for t in leaves:
        t.grad = None
    return compare(got, want, TOL[dtype])


def run_one(ctx: Ctx, impl: str, B: int, N: int, h: int, d: int, causal: bool, dtype, check: bool) -> dict:
    row = {"impl": impl, "d": d, "N": N, "B": B, "h": h, "causal": causal, "dtype": DTYPE_NAMES[dtype]}
    from diffmm.ops import flash as _flash

    if impl.startswith("flash") and not _flash.is_available():
        row.update(status="unsupported", reason=_flash.unsupported_reason(torch.empty(0)) or "flash-attn unavailable")
        return row
    leaves, fwd = make_case(impl, B, N, h, d, causal, dtype, ctx.device)
    dy = torch.randn_like(fwd())  # first call: compiles / autotunes the forward

    def fwd_bwd():
        fwd().backward(dy)

    reps, warmup = (1, 0) if ctx.dry else (None, 1)  # dry run: the code path, not a measurement
    row["fwd_ms"] = time_ms(fwd, ctx.device, reps=reps, warmup=warmup, grad_to_none=leaves)
    row["fwdbwd_ms"] = time_ms(fwd_bwd, ctx.device, reps=reps, warmup=warmup, grad_to_none=leaves)
    for t in leaves:
        t.grad = None
    row["fwdbwd_peak_mib"] = peak_mib(fwd_bwd, ctx.device)
    row["fwd_tflops"] = flops(impl, B, h, N, d, causal, False) / row["fwd_ms"] / 1e9
    row["fwdbwd_tflops"] = flops(impl, B, h, N, d, causal, True) / row["fwdbwd_ms"] / 1e9
    row["status"] = "ok"
    if check and impl == "fused-triton":
        ok, errs = tuned_tile_check(leaves, fwd, dy, causal, dtype)
        row["check"] = {"ok": ok, "errs": errs, "tol": TOL[dtype]}
        if not ok:
            k = max(errs, key=errs.get)
            ctx.failures.append(f"tuned-tile check fused-triton d={d} N={N} causal={causal}: {k} error "
                                f"{errs[k]:.2e} > tol {TOL[dtype]:.0e}")
    return row


def summary(rows: list[dict]) -> list[dict]:
    """Per (d, N, causal): fused fwd TFLOP/s, fwd+bwd speedup over the best unfused path, DIFF/standard ratios."""
    out = []
    for key in sorted({(r["d"], r["N"], r["causal"]) for r in rows}):
        by = {r["impl"]: r for r in rows if (r["d"], r["N"], r["causal"]) == key and r.get("status") == "ok"}
        if "fused-triton" not in by:
            continue
        f = by["fused-triton"]
        s = {"d": key[0], "N": key[1], "causal": key[2], "fused_fwd_tflops": f["fwd_tflops"],
             "fused_fwdbwd_tflops": f["fwdbwd_tflops"]}
        unfused = {k: by[k]["fwdbwd_ms"] for k in UNFUSED if k in by}
        if unfused:
            best = min(unfused, key=unfused.get)
            s.update(best_unfused=best, fwdbwd_speedup_vs_best_unfused=unfused[best] / f["fwdbwd_ms"])
        std = {k: by[k] for k in STANDARD if k in by}
        if std:
            best = min(std, key=lambda k: std[k]["fwdbwd_ms"])
            s.update(best_standard=best, fwd_ratio_vs_standard=f["fwd_ms"] / std[best]["fwd_ms"],
                     fwdbwd_ratio_vs_standard=f["fwdbwd_ms"] / std[best]["fwdbwd_ms"])
        out.append(s)
    return out


def autotune_choices() -> dict:
    """The tiles the autotuner picked, per kernel and key (empty under the interpreter)."""
    try:
        from diffmm.ops import triton_diff_bwd as B
        from diffmm.ops import triton_diff_fwd as F
    except ImportError:
        return {}
    out = {}
    for name, kern in (("fwd", getattr(F, "_fwd_kernel", None)), ("bwd_dkdv", getattr(B, "_dkdv_kernel", None)),
                       ("bwd_dq", getattr(B, "_dq_kernel", None))):
        cache = getattr(kern, "cache", None)
        if hasattr(kern, "configs") and isinstance(cache, dict):  # a triton Autotuner (not under the interpreter)
            out[name] = {str(k): str(v) for k, v in cache.items()}
    return out


def kernel_stats() -> list[dict]:
    """Registers and spills of every compiled variant of the fused kernels (empty under the interpreter).

    Read from Triton's per-device JIT caches after the kernels ran (``n_regs`` / ``n_spills`` are known once a
    binary is loaded); anything the installed Triton lays out differently is skipped, not fatal.
    """
    try:
        from diffmm.ops import triton_diff_bwd as B
        from diffmm.ops import triton_diff_fwd as F

        fns = [F._diff_fwd_kernel, B._bwd_pre_kernel, B._bwd_dkdv_kernel, B._bwd_dq_kernel]
    except (ImportError, AttributeError):
        return []
    out = []
    for fn in fns:
        caches = getattr(fn, "device_caches", None)
        for entry in list(caches.values()) if isinstance(caches, dict) else []:
            cache = entry[0] if isinstance(entry, tuple) else entry
            for kern in list(cache.values()) if isinstance(cache, dict) else []:
                try:
                    src, md = getattr(kern, "src", None), kern.metadata
                    consts = {}
                    for k, v in (getattr(src, "constants", None) or {}).items():
                        idx = k[0] if isinstance(k, tuple) else k
                        name = fn.arg_names[idx] if isinstance(idx, int) and idx < len(fn.arg_names) else str(idx)
                        if name.isupper() or name.startswith("BLOCK"):
                            consts[name] = v if isinstance(v, (int, float, bool, str)) else str(v)
                    out.append({"kernel": fn.__name__, **consts, "num_warps": md.num_warps,
                                "num_stages": md.num_stages, "shared": md.shared,
                                "n_regs": getattr(kern, "n_regs", None), "n_spills": getattr(kern, "n_spills", None)})
                except Exception:  # noqa: BLE001  (a Triton version with other internals: skip the entry)
                    continue
    return out


def kernels_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(none compiled: interpreter, or Triton internals not readable)"]
    keys = ["D", "CAUSAL", "HAS_PAD", "NORM", "PREC", "BLOCK_M", "BLOCK_N"]
    lines = ["| kernel | " + " | ".join(keys) + " | warps | stages | shared KiB | registers | spills |",
             "|---|" + "---|" * len(keys) + "---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["kernel"], str([r.get(k) for k in keys]), r["num_warps"])):
        lines.append(f"| {r['kernel']} | " + " | ".join(str(r.get(k, "")) for k in keys) +
                     f" | {r['num_warps']} | {r['num_stages']} | {r['shared'] / 1024:.0f} | {r['n_regs']} | "
                     f"{r['n_spills']} |")
    return lines


def run_part(ctx: Ctx, part: dict) -> None:
    cfg = DRY if ctx.dry else GPU
    dtype = cfg["dtype"]
    part.update(rows=[], skipped=[], width=cfg["width"], tokens=cfg["tokens"], dtype=DTYPE_NAMES[dtype])
    if ctx.dry:
        part["notes"] = ["dry run: fp32 instead of bf16 (the interpreter computes bf16 wrongly), toy sizes"]
    todo = [(d, N, causal, impl) for N in cfg["Ns"] for d in cfg["dims"] for causal in (False, True)
            for impl in IMPLS]  # N = 4k first: the issue's targets are at N >= 4k
    with autotuning(True):
        for i, (d, N, causal, impl) in enumerate(todo):
            B, h = max(1, cfg["tokens"] // N), max(1, cfg["width"] // (2 * d))
            label = f"d={d} N={N} causal={causal} {impl}"
            if ctx.out_of_time(part, label, len(todo) - i, "cases"):
                break
            try:
                row = run_one(ctx, impl, B, N, h, d, causal, dtype, check=N <= cfg["check_max_n"])
            except Exception as e:  # noqa: BLE001  (one failing path must not lose the others)
                row = {"impl": impl, "d": d, "N": N, "B": B, "h": h, "causal": causal, "status": "ERROR",
                       "error": err_line(e)}
            part["rows"].append(row)
            part["summary"] = summary(part["rows"])
            part["autotune"] = autotune_choices()
            msg = (f"fwd {row['fwd_ms']:.3f} ms ({row['fwd_tflops']:.1f} TF/s), fwd+bwd {row['fwdbwd_ms']:.3f} ms "
                   f"({row['fwdbwd_tflops']:.1f} TF/s), peak {fmt(row['fwdbwd_peak_mib'], '.0f')} MiB" +
                   (f", tuned-tile check {'pass' if row['check']['ok'] else 'FAIL'}" if "check" in row else "")
                   if row["status"] == "ok" else f"{row['status']}: {row.get('reason') or row.get('error')}")
            ctx.progress("2/speed", f"{i + 1}/{len(todo)} {label}: {msg}")
            free_memory(ctx.device)
            ctx.rec.save()


def markdown(part: dict) -> list[str]:
    rows = sorted(part.get("rows", []), key=lambda r: (r["d"], r["N"], r["causal"], IMPLS.index(r["impl"])))
    lines = [f"{part.get('dtype')}, {part.get('tokens')} tokens per batch (B = tokens / N), width "
             f"{part.get('width')} (h = width / 2d; standard: 2h heads of d); model FLOPs of SPEC 4; CUDA events, "
             "median", "",
             "| d | N | causal | path | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd peak MiB | "
             "tuned-tile check |", "|---:|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['d']} | {r['N']} | {r['causal']} | {r['impl']} | {r.get('status')}: "
                         f"{(r.get('reason') or r.get('error') or '')[:80]} | | | | | |")
            continue
        chk = r.get("check")
        chk_s = "-" if chk is None else ("pass" if chk["ok"] else "FAIL") + " (max " + \
            fmt(max(chk["errs"].values()), ".1e") + ")"
        lines.append(f"| {r['d']} | {r['N']} | {r['causal']} | {r['impl']} | {r['fwd_ms']:.3f} | "
                     f"{r['fwd_tflops']:.1f} | {r['fwdbwd_ms']:.3f} | {r['fwdbwd_tflops']:.1f} | "
                     f"{fmt(r['fwdbwd_peak_mib'], '.0f')} | {chk_s} |")
    s_rows = part.get("summary", [])
    if s_rows:
        t = TARGETS
        lines += ["", f"Targets (issue 16, H200, bf16, N >= 4k): fused fwd+bwd >= {t['speedup']}x the best unfused "
                      f"path; fused fwd >= {t['fwd_tflops_d128']:.0f} TFLOP/s at d = 128; DIFF / standard fwd+bwd "
                      f"time <= {t['ratio']}.", "",
                  "| d | N | causal | fused fwd TFLOP/s | fused fwd+bwd TFLOP/s | best unfused | fwd+bwd speedup | "
                  "DIFF/standard fwd | DIFF/standard fwd+bwd |", "|---:|---:|---|---:|---:|---|---:|---:|---:|"]
        for s in s_rows:
            lines.append(f"| {s['d']} | {s['N']} | {s['causal']} | {s['fused_fwd_tflops']:.1f} | "
                         f"{s['fused_fwdbwd_tflops']:.1f} | {s.get('best_unfused', '-')} | "
                         f"{fmt(s.get('fwdbwd_speedup_vs_best_unfused'), '.2f')}x | "
                         f"{fmt(s.get('fwd_ratio_vs_standard'), '.2f')} | {fmt(s.get('fwdbwd_ratio_vs_standard'), '.2f')} |")
    for name, cache in part.get("autotune", {}).items():
        lines += ["", f"autotune {name}: " + "; ".join(f"{k} -> {v}" for k, v in cache.items())]
    for s in part.get("skipped", []):
        lines.append(f"- skipped {s['what']}: {s['reason']}")
    return lines


__all__ = ["run_part", "markdown", "summary", "kernel_stats", "kernels_markdown"]
