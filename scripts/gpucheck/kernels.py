"""Parts 1 and 2 of the GPU check (``scripts/gpu_check.py``): correctness of the fused kernel against the reference,
and attention speed, TFLOP/s and memory."""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import diffmm.ops as ops
from diffmm.ops import AttentionCall, flash, get_backend, triton_targets, triton_tiles
from diffmm.ops.epilogue import diff_epilogue
from diffmm.ops.sdpa import LAYOUTS, diff_attention_sdpa
from gpucheck.record import DTYPE_NAMES, GRAD_NAMES, Ctx, peak_mib, run_cases, time_ms

# Part 1. Tolerances of the CPU tests (tests/ops/test_triton_diff.py: fp32 2e-5, fp16 1e-2; bf16 3e-2 as its
# CUDA test) on max abs error / max abs fp32 reference value.
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    """One correctness call: sizes, masks and epilogue (``norm``: 'weight', 'plain' (no weight) or None)."""

    name: str
    B: int
    N: int
    S: int
    h: int
    h_kv: int
    d: int
    causal: bool
    pad: bool
    norm: Optional[str] = "weight"


# Odd lengths crossing many tiles, d = 64 and 128, GQA 1/2/4, S < N (rows that see no key) and S > N (KV cache,
# cross attention), a fully padded sequence, causal and not, norm with / without weight / none; only four compiled
# variants per dtype (d, causal, padding, norm), since every Triton compile costs seconds.
CASES = [  # name, (B, N, S, h, h_kv) on the GPU and in the dry run (16 x 16 tiles in the interpreter), the rest
    ("pad-gqa2-odd-d64", (2, 1000, 1000, 4, 2), (2, 33, 33, 4, 2), 64, False, True),
    ("causal-gqa2-odd-d64", (1, 1237, 1237, 4, 2), (1, 35, 35, 4, 2), 64, True, False),
    ("causal-S<N-emptyrows-d64", (1, 777, 333, 4, 2), (1, 33, 17, 4, 2), 64, True, False, "plain"),
    ("causal-kvcache-S>N-pad-gqa4-d128", (2, 301, 1237, 8, 2), (2, 9, 35, 4, 1), 128, True, True),
    ("cross-S>N-odd-nonorm-d128", (1, 519, 1031, 4, 4), (1, 17, 33, 2, 2), 128, False, False, None)]
GPU_CASES = [Case(name, *gpu, *rest) for name, gpu, _, *rest in CASES]
DRY_CASES = [Case(name, *dry, *rest) for name, _, dry, *rest in CASES]

# Part 2. 16k tokens per batch (B = tokens / N) at width 2048 (h = width / 2d); the targets of issue 16.
SPEED_GPU = dict(width=2048, tokens=16384, Ns=[4096, 16384, 1024], dims=[128, 64], check_max_n=4096,
                 dtype=torch.bfloat16)
SPEED_DRY = dict(width=256, tokens=48, Ns=[48], dims=[64], check_max_n=48, dtype=torch.float32)
UNFUSED = tuple(f"sdpa-{layout}" for layout in ("pair", "split") if layout in LAYOUTS) + ("official-4call",
                                                                                          "flash-diff")
STANDARD = ("standard-sdpa", "flash-standard")
IMPLS = ("fused-triton",) + UNFUSED + STANDARD
TARGETS = {"speedup": 1.5, "fwd_tflops_d128": 450.0, "ratio": 1.7}  # H200, bf16, N >= 4k


# ------------------------------------------------------------------------------------------ 1. correctness


def make_inputs(c: Case, dtype: torch.dtype, device: torch.device, seed: int = 0) -> list:
    """q, k, v, lam, norm weight, key mask, dy (as ``tests/ops/test_triton_diff.py``), drawn on CPU, moved."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(c.B, c.N, 2 * c.h, c.d, generator=g).to(dtype)
    k = torch.randn(c.B, c.S, 2 * c.h_kv, c.d, generator=g).to(dtype)
    v = torch.randn(c.B, c.S, c.h_kv, 2 * c.d, generator=g).to(dtype)
    lam = torch.tensor(0.37)
    w = torch.rand(2 * c.d, generator=g) + 0.5
    km = None
    if c.pad:
        km = torch.rand(c.B, c.S, generator=g) > 0.3
        km[0, -3:] = False  # padding at the end, as batching produces
        if c.B > 1:
            km[1, :] = False  # a sequence with no key at all: all its rows are fully masked
    dy = torch.randn(c.B, c.N, c.h, 2 * c.d, generator=g).to(dtype)
    return [t.to(device) if t is not None else None for t in (q, k, v, lam, w, km, dy)]


def run_backend(backend: str, c: Case, q, k, v, lam, w, km, dy) -> list[torch.Tensor]:
    """Forward + backward; the output and the gradients of q, k, v, lam, norm weight (zeros when unused)."""
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v, lam, w)]
    y = ops.diff_attention(xs[0], xs[1], xs[2], xs[3], causal=c.causal, attn_mask=km,
                           norm_weight=xs[4] if c.norm == "weight" else None,
                           lambda_init=0.2 if c.norm else None, backend=backend)
    y.backward(dy)
    return [y.detach()] + [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]


def compare(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> tuple[bool, dict]:
    """Max abs error of each tensor relative to the reference's max abs value (floor 1e-3); ok if all <= tol."""
    errs, ok = {}, True
    for name, a, b in zip(GRAD_NAMES, got, want):
        a, b = a.double(), b.double()
        if a.shape != b.shape or not torch.isfinite(a).all():
            errs[name], ok = float("inf"), False
            continue
        errs[name] = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-3)
        ok = ok and errs[name] <= tol
    return ok, errs


def empty_row_mask(c: Case, km, device) -> torch.Tensor:
    """(B, N) True for query rows that see no key."""
    keep = torch.ones(c.B, c.N, c.S, dtype=torch.bool, device=device)
    if km is not None:
        keep &= km[:, None, :]
    if c.causal:
        keep &= torch.ones(c.N, c.S, dtype=torch.bool, device=device).tril(c.S - c.N)
    return ~keep.any(-1)


def exact_zero_checks(c: Case, got: list[torch.Tensor], km) -> Optional[str]:
    """None if fully masked rows and padded keys got exact zeros, else what was not zero."""
    y, dq, dk, dv = got[:4]
    empty = empty_row_mask(c, km, y.device)
    bad = []
    if empty.any() and (y[empty] != 0).any():
        bad.append("output of rows without keys")
    if empty.any() and (dq[empty] != 0).any():
        bad.append("dq of rows without keys")
    if km is not None and ((dk[~km] != 0).any() or (dv[~km] != 0).any()):
        bad.append("dk/dv of padded keys")
    return ", ".join(bad) + " not exactly 0" if bad else None


def unsupported(backend: str, c: Case, q, km) -> Optional[str]:
    return get_backend(backend).unsupported(AttentionCall("diff", q, km, c.causal, c.d, 2 * c.d))


def correctness_case(ctx: Ctx, item: tuple, row: dict) -> None:
    backend, dtype, c = item
    inputs = make_inputs(c, dtype, ctx.device)
    q, km = inputs[0], inputs[5]
    reason = unsupported(backend, c, q, km)
    if reason is not None:
        row.update(status="unsupported", reason=reason)
        return
    want = run_backend("reference", c, *[t.float() if t is not None and t.is_floating_point() else t for t in inputs])
    got = [t.float() for t in run_backend(backend, c, *inputs)]
    ok, row["errs"] = compare(got, want, TOL[dtype])
    zero = exact_zero_checks(c, got, km)
    row["status"] = "pass" if ok and zero is None else "FAIL"
    if zero:
        row["zero_check"] = zero
    if row["status"] == "FAIL":
        worst = max(row["errs"], key=row["errs"].get)
        why = zero or f"{worst} error {row['errs'][worst]:.2e} > tol {TOL[dtype]:.0e}"
        ctx.failures.append(f"correctness {backend} {DTYPE_NAMES[dtype]} {c.name}: {why}")
    if dtype != torch.float32 and unsupported("sdpa", c, q, km) is None:  # the noise floor of this dtype
        row["sdpa_errs"] = compare([t.float() for t in run_backend("sdpa", c, *inputs)], want, TOL[dtype])[1]


@contextlib.contextmanager
def autotuning(enabled: bool):
    """Switch the fused kernel's autotuning on or off (first fitting tile) inside the block.

    The tile pruning reads ``triton_tiles.AUTOTUNE`` at call time; a tuned choice is cached per autotune key
    (sequence lengths included), so the switch only affects shapes not seen before.
    """
    saved, triton_tiles.AUTOTUNE = triton_tiles.AUTOTUNE, enabled
    try:
        yield
    finally:
        triton_tiles.AUTOTUNE = saved


def run_correctness(ctx: Ctx, part: dict) -> None:
    """Every (backend, dtype, case), bf16 first (what training uses), with autotuning off (part 2 checks tiles)."""
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    if not ctx.cuda:
        part["skipped"].append({"what": "bf16", "reason": "the Triton interpreter computes bfloat16 wrongly; "
                                                          "bf16 runs on CUDA only"})
        dtypes.remove(torch.bfloat16)
    backends = ["triton"]
    if flash.is_available():
        backends.append("flash")
    else:
        part["skipped"].append({"what": "flash", "reason": flash.unsupported_reason(torch.empty(0)) or
                                "flash-attn unavailable"})
    todo = [(b, dt, c) for b in backends for dt in dtypes for c in (DRY_CASES if ctx.dry else GPU_CASES)]
    part["notes"] = ["errors: max abs error / max abs fp32 reference, against the tolerance of the dtype; sdpa = the "
                     "sdpa backend's error in the same dtype, the noise floor"]

    def describe(item):
        b, dt, c = item
        return {"label": f"{b} {DTYPE_NAMES[dt]} {c.name}", "backend": b, "dtype": DTYPE_NAMES[dt], "case": c.name,
                **asdict(c), "tol": TOL[dt]}

    with autotuning(False):
        run_cases(ctx, part, "1/correctness", todo, describe, lambda item, row: correctness_case(ctx, item, row),
                  errors_fail=True)


# ------------------------------------------------------------------------------------------------ 2. speed


def four_call(q, k, v, lam, w, causal: bool) -> torch.Tensor:
    """The official flashdiff_2-style path: four attention calls with d-wide V halves, then the epilogue."""
    d = q.shape[-1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, 2h, N, d) (B, 2h, S, d) (B, h, S, 2d)
    q1, q2, k1, k2 = qt[:, 0::2], qt[:, 1::2], kt[:, 0::2], kt[:, 1::2]  # (B, h, N, d)
    halves = vt[..., :d], vt[..., d:]  # (B, h, S, d)
    o1 = torch.cat([F.scaled_dot_product_attention(q1, k1, vh, is_causal=causal) for vh in halves], -1)  # (B, h, N, 2d)
    o2 = torch.cat([F.scaled_dot_product_attention(q2, k2, vh, is_causal=causal) for vh in halves], -1)
    return diff_epilogue(o1, o2, lam, norm_weight=w, lambda_init=0.2, out_dtype=q.dtype)


def speed_inputs(impl: str, B: int, N: int, h: int, d: int, causal: bool, dtype, device):
    """(leaf tensors, forward closure) of one path; standard attention has 2h heads of d."""
    mk = lambda *s: torch.randn(*s, device=device, dtype=dtype).requires_grad_()  # noqa: E731
    if impl in STANDARD:
        q, k, v = mk(B, N, 2 * h, d), mk(B, N, 2 * h, d), mk(B, N, 2 * h, d)
        backend = "flash" if impl == "flash-standard" else "sdpa"
        return [q, k, v], lambda: ops.attention(q, k, v, causal=causal, backend=backend)
    q, k, v = mk(B, N, 2 * h, d), mk(B, N, 2 * h, d), mk(B, N, h, 2 * d)
    lam = torch.tensor(0.3, device=device, requires_grad=True)
    w = torch.ones(2 * d, device=device, requires_grad=True)
    kw = dict(causal=causal, norm_weight=w, lambda_init=0.2)
    if impl == "official-4call":
        return [q, k, v, lam, w], lambda: four_call(q, k, v, lam, w, causal)
    if impl.startswith("sdpa-"):
        return [q, k, v, lam, w], lambda: diff_attention_sdpa(q, k, v, lam, layout=impl[len("sdpa-"):], **kw)
    backend = "flash" if impl == "flash-diff" else "triton"
    return [q, k, v, lam, w], lambda: ops.diff_attention(q, k, v, lam, backend=backend, **kw)


def model_flops(impl: str, B: int, h: int, N: int, d: int, causal: bool, bwd: bool) -> float:
    """docs/kernels.md section 3: per differential head 12 N S d forward, 20 N S d backward; standard attention
    (2h heads of d) 4 N S d per head forward, 10 backward; halved when causal."""
    f = (4 + 10 * bwd) * B * 2 * h * N * N * d if impl in STANDARD else (12 + 20 * bwd) * B * h * N * N * d
    return f / 2 if causal else f


def speed_case(ctx: Ctx, item: tuple, row: dict, cfg: dict) -> None:
    d, N, causal, impl = item
    B, h, dtype = row["B"], row["h"], cfg["dtype"]
    if impl.startswith("flash") and not flash.is_available():
        row.update(status="unsupported", reason=flash.unsupported_reason(torch.empty(0)) or "flash-attn unavailable")
        return
    leaves, fwd = speed_inputs(impl, B, N, h, d, causal, dtype, ctx.device)
    dy = torch.randn_like(fwd())  # first call: compiles / autotunes the forward

    def fwd_bwd():
        fwd().backward(dy)

    reps, warmup = (1, 0) if ctx.dry else (None, 1)  # dry run: the code path, not a measurement
    row["fwd_ms"] = time_ms(fwd, ctx.device, reps=reps, warmup=warmup, grad_to_none=leaves)
    row["fwdbwd_ms"] = time_ms(fwd_bwd, ctx.device, reps=reps, warmup=warmup, grad_to_none=leaves)
    for t in leaves:
        t.grad = None
    row["fwdbwd_peak_mib"] = peak_mib(fwd_bwd, ctx.device)
    row["fwd_tflops"] = model_flops(impl, B, h, N, d, causal, False) / row["fwd_ms"] / 1e9
    row["fwdbwd_tflops"] = model_flops(impl, B, h, N, d, causal, True) / row["fwdbwd_ms"] / 1e9
    row["status"] = "ok"
    if impl == "fused-triton" and N <= cfg["check_max_n"]:  # the reference needs N x N memory
        c = Case(f"tuned tiles d={d} N={N} causal={causal}", B, N, N, h, h, d, causal, False)  # same autotune key
        row["check"] = {"tol": TOL[dtype]}
        correctness_case(ctx, ("triton", dtype, c), row["check"])  # part 1's check, on the tile the autotuner chose


def speed_summary(rows: list[dict]) -> list[dict]:
    """Per (d, N, causal): fused TFLOP/s, fwd+bwd speedup over the best unfused path, DIFF / standard time ratios."""
    out = []
    for key in sorted({(r["d"], r["N"], r["causal"]) for r in rows}):
        by = {r["impl"]: r for r in rows if (r["d"], r["N"], r["causal"]) == key and r["status"] == "ok"}
        if "fused-triton" not in by:
            continue
        f = by["fused-triton"]
        s = {"d": key[0], "N": key[1], "causal": key[2], "fused_fwd_tflops": f["fwd_tflops"],
             "fused_fwdbwd_tflops": f["fwdbwd_tflops"]}
        unfused, standard = (min((k for k in names if k in by), key=lambda k: by[k]["fwdbwd_ms"], default=None)
                             for names in (UNFUSED, STANDARD))  # the fastest path of each kind that ran
        if unfused:
            s.update(best_unfused=unfused, fwdbwd_speedup_vs_best_unfused=by[unfused]["fwdbwd_ms"] / f["fwdbwd_ms"])
        if standard:
            s.update(best_standard=standard, fwd_ratio_vs_standard=f["fwd_ms"] / by[standard]["fwd_ms"],
                     fwdbwd_ratio_vs_standard=f["fwdbwd_ms"] / by[standard]["fwdbwd_ms"])
        out.append(s)
    return out


def run_speed(ctx: Ctx, part: dict) -> None:
    cfg = SPEED_DRY if ctx.dry else SPEED_GPU
    part.update(width=cfg["width"], tokens=cfg["tokens"], dtype=DTYPE_NAMES[cfg["dtype"]])
    part["notes"] = [f"{part['dtype']}, {cfg['tokens']} tokens per batch (B = tokens / N), width {cfg['width']} (h = "
                     "width / 2d; standard attention: 2h heads of d); model FLOPs of docs/kernels.md; median time",
                     f"targets (H200, bf16, N >= 4k): fused fwd+bwd >= {TARGETS['speedup']}x the best unfused path; "
                     f"fused fwd >= {TARGETS['fwd_tflops_d128']:.0f} TFLOP/s at d = 128; DIFF / standard fwd+bwd time "
                     f"<= {TARGETS['ratio']}"]
    if ctx.dry:
        part["notes"].append("dry run: fp32 instead of bf16 (the interpreter computes bf16 wrongly), toy sizes")
    todo = [(d, N, causal, impl) for N in cfg["Ns"] for d in cfg["dims"] for causal in (False, True) for impl in IMPLS]

    def describe(item):
        d, N, causal, impl = item
        return {"label": f"d={d} N={N} causal={causal} {impl}", "impl": impl, "d": d, "N": N,
                "B": max(1, cfg["tokens"] // N), "h": max(1, cfg["width"] // (2 * d)), "causal": causal,
                "dtype": DTYPE_NAMES[cfg["dtype"]]}

    def run_one(item, row):
        speed_case(ctx, item, row, cfg)
        part["summary"] = speed_summary(part["rows"] + [row])
        part["autotune"] = triton_targets.process_report()["autotune"]

    with autotuning(True):
        run_cases(ctx, part, "2/speed", todo, describe, run_one)
