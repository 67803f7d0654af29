"""Part 1 of ``scripts/gpu_check.py``: the compiled ``triton`` (and ``flash``) backends against ``reference``.

Every case runs forward and backward and compares the output and the gradients of q, k, v, lambda and the norm
weight with the ``reference`` backend run in fp32 on the same (rounded) inputs: max abs error <= tol * max abs
reference value, with the tolerances of the CPU tests (``tests/ops/test_triton_diff.py``: fp32 2e-5, fp16 1e-2;
bf16, which the interpreter cannot run, 3e-2 as that file's CUDA test). Rows that see no key (a fully padded
sequence, causal with S < N) must give exactly 0 output and 0 query gradient, padded keys exactly 0 key and value
gradients. For 16-bit dtypes the error of the ``sdpa`` backend in the same dtype is recorded as the noise floor.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from gpu_check_lib import DTYPE_NAMES, Ctx, PartBudgetExceeded, err_line, fmt, free_memory

TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}
NAMES = ("y", "dq", "dk", "dv", "dlam", "dnorm_weight")


@dataclass(frozen=True)
class Case:
    """One call: sizes, masks and epilogue (``norm``: 'weight', 'plain' (no weight) or None (no norm))."""

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


# Five cases cover: odd lengths crossing many tiles, d = 64 and 128, GQA 1/2/4, S < N (rows that see no key) and
# S > N (KV cache, cross attention), key padding with a fully padded sequence (fully masked rows), causal and not,
# norm with weight / without weight / no norm. They need only four compiled variants per dtype (d, causal,
# padding, norm; causal-gqa2 and S<N share one), because every Triton compile costs seconds on the GPU machine.
GPU_CASES = [
    Case("pad-gqa2-odd-d64", 2, 1000, 1000, 4, 2, 64, False, True),
    Case("causal-gqa2-odd-d64", 1, 1237, 1237, 4, 2, 64, True, False),
    Case("causal-S<N-emptyrows-d64", 1, 777, 333, 4, 2, 64, True, False, "plain"),
    Case("causal-kvcache-S>N-pad-gqa4-d128", 2, 301, 1237, 8, 2, 128, True, True),
    Case("cross-S>N-odd-nonorm-d128", 1, 519, 1031, 4, 4, 128, False, False, None),
]
# Dry run: the same cases at interpreter-friendly sizes (16 x 16 tiles there, so still several tiles per row).
DRY_CASES = [
    Case("pad-gqa2-odd-d64", 2, 33, 33, 4, 2, 64, False, True),
    Case("causal-gqa2-odd-d64", 1, 35, 35, 4, 2, 64, True, False),
    Case("causal-S<N-emptyrows-d64", 1, 33, 17, 4, 2, 64, True, False, "plain"),
    Case("causal-kvcache-S>N-pad-gqa4-d128", 2, 9, 35, 4, 1, 128, True, True),
    Case("cross-S>N-odd-nonorm-d128", 1, 17, 33, 2, 2, 128, False, False, None),
]


def make_inputs(c: Case, dtype: torch.dtype, device: torch.device, seed: int = 0):
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
    import diffmm.ops as ops

    xs = [t.detach().clone().requires_grad_() for t in (q, k, v, lam, w)]
    y = ops.diff_attention(xs[0], xs[1], xs[2], xs[3], causal=c.causal, attn_mask=km,
                           norm_weight=xs[4] if c.norm == "weight" else None,
                           lambda_init=0.2 if c.norm else None, backend=backend)
    y.backward(dy)
    return [y.detach()] + [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]


def compare(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> tuple[bool, dict]:
    """Max abs error of each tensor relative to the reference's max abs value (floor 1e-3); ok if all <= tol."""
    errs, ok = {}, True
    for name, a, b in zip(NAMES, got, want):
        a, b = a.double(), b.double()
        if a.shape != b.shape or not torch.isfinite(a).all():
            errs[name] = float("inf")
            ok = False
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
    if empty.any():
        if (y[empty] != 0).any():
            bad.append("output of rows without keys")
        if (dq[empty] != 0).any():
            bad.append("dq of rows without keys")
    if km is not None and (~km).any():
        if (dk[~km] != 0).any() or (dv[~km] != 0).any():
            bad.append("dk/dv of padded keys")
    return ", ".join(bad) + " not exactly 0" if bad else None


def _unsupported(backend: str, c: Case, q, km) -> Optional[str]:
    from diffmm.ops import AttentionCall, get_backend

    return get_backend(backend).unsupported(AttentionCall("diff", q, km, c.causal, c.d, 2 * c.d))


def run_case(ctx: Ctx, backend: str, c: Case, dtype: torch.dtype) -> dict:
    row = {"backend": backend, "dtype": DTYPE_NAMES[dtype], "case": c.name, **asdict(c), "tol": TOL[dtype]}
    inputs = make_inputs(c, dtype, ctx.device)
    q, km = inputs[0], inputs[5]
    reason = _unsupported(backend, c, q, km)
    if reason is not None:
        row.update(status="unsupported", reason=reason)
        return row
    f32 = [t.float() if t is not None and t.is_floating_point() else t for t in inputs]
    want = run_backend("reference", c, *f32)
    got = [t.float() for t in run_backend(backend, c, *inputs)]
    ok, errs = compare(got, want, TOL[dtype])
    zero = exact_zero_checks(c, got, km)
    row.update(errs=errs, status="pass" if ok and zero is None else "FAIL")
    if zero:
        row["zero_check"] = zero
    if dtype != torch.float32 and _unsupported("sdpa", c, q, km) is None:  # the noise floor of this dtype
        row["sdpa_errs"] = compare([t.float() for t in run_backend("sdpa", c, *inputs)], want, TOL[dtype])[1]
    return row


def run_part(ctx: Ctx, part: dict) -> None:
    """Every (backend, dtype, case); rows appended to ``part['cases']`` and saved after each."""
    from diffmm.ops import flash as _flash

    cases = DRY_CASES if ctx.dry else GPU_CASES
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    part["cases"], part["skipped"] = [], []
    if not ctx.cuda:
        part["skipped"].append({"what": "bf16", "reason": "the Triton interpreter computes bfloat16 wrongly; "
                                                          "bf16 runs on CUDA only"})
        dtypes.remove(torch.bfloat16)
    backends = ["triton"]
    if _flash.is_available():
        backends.append("flash")
    else:
        part["skipped"].append({"what": "flash", "reason": _flash.unsupported_reason(torch.empty(0)) or
                                "flash-attn unavailable"})
    todo = [(b, dt, c) for b in backends for dt in dtypes for c in cases]  # bf16 first: what training uses
    with autotuning(False):  # one tile per kernel: correctness, not speed; part 2 checks the tuned tiles
        for i, (backend, dtype, c) in enumerate(todo):
            label = f"{backend} {DTYPE_NAMES[dtype]} {c.name}"
            try:
                ctx.check_time(label)
            except PartBudgetExceeded as e:
                part["skipped"] += [{"what": f"{b} {DTYPE_NAMES[dt]} {cc.name}", "reason": str(e)}
                                    for b, dt, cc in todo[i:]]
                break
            try:
                row = run_case(ctx, backend, c, dtype)
            except Exception as e:  # noqa: BLE001  (record, keep going)
                row = {"backend": backend, "dtype": DTYPE_NAMES[dtype], "case": c.name, "status": "ERROR",
                       "error": err_line(e)}
            if row["status"] in ("FAIL", "ERROR"):
                ctx.failures.append(f"correctness {label}: {row.get('error') or row.get('zero_check') or _worst(row)}")
            part["cases"].append(row)
            ctx.progress("1/correctness", f"{i + 1}/{len(todo)} {label}: {row['status']} " +
                         (" ".join(f"{k}={v:.1e}" for k, v in row["errs"].items()) if "errs" in row else
                          row.get("reason") or row.get("error", "")))
            free_memory(ctx.device)
            ctx.rec.save()


def _worst(row: dict) -> str:
    errs = row.get("errs", {})
    if not errs:
        return "?"
    k = max(errs, key=errs.get)
    return f"{k} error {errs[k]:.2e} > tol {row['tol']:.0e}"


@contextlib.contextmanager
def autotuning(enabled: bool):
    """Switch the fused kernel's autotuning off (first fitting tile) or on inside the block.

    The kernels' tile pruning reads the module flag ``AUTOTUNE`` at call time (``DIFFMM_TRITON_AUTOTUNE=0``
    sets it at import); a tuned choice is cached per autotune key (sequence lengths included), so the switch
    only affects shapes not seen before.
    """
    try:
        from diffmm.ops import triton_diff_bwd, triton_diff_fwd
        mods = [m for m in (triton_diff_fwd, triton_diff_bwd) if hasattr(m, "AUTOTUNE")]
    except ImportError:
        mods = []
    saved = [(m, m.AUTOTUNE) for m in mods]
    for m in mods:
        m.AUTOTUNE = enabled
    try:
        yield
    finally:
        for m, value in saved:
            m.AUTOTUNE = value


def markdown(part: dict) -> list[str]:
    rows = part.get("cases", [])
    lines = []
    if rows:
        n_pass = sum(r["status"] == "pass" for r in rows)
        lines += [f"{n_pass} of {len(rows)} cases pass (max abs error / max abs fp32 reference; tolerance per dtype; "
                  f"sdpa = the sdpa backend's error in the same dtype, the noise floor)", "",
                  "| backend | dtype | case | B | N | S | h/h_kv | d | causal | pad | norm | status | y | dq | dk | dv | "
                  "dlam | dnorm_w | tol | sdpa y / dq |",
                  "|---|---|---|---:|---:|---:|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            e = r.get("errs", {})
            s = r.get("sdpa_errs", {})
            status = r["status"] + (f": {r.get('reason') or r.get('error') or r.get('zero_check')}"
                                    if r["status"] != "pass" and any(k in r for k in ("reason", "error", "zero_check"))
                                    else "")
            lines.append(
                f"| {r['backend']} | {r['dtype']} | {r['case']} | {r.get('B', '')} | {r.get('N', '')} | "
                f"{r.get('S', '')} | {r.get('h', '')}/{r.get('h_kv', '')} | {r.get('d', '')} | {r.get('causal', '')} | "
                f"{r.get('pad', '')} | {r.get('norm', '')} | {status} | " +
                " | ".join(fmt(e.get(n), ".1e") for n in NAMES) +
                f" | {fmt(r.get('tol'), '.0e')} | {fmt(s.get('y'), '.1e')} / {fmt(s.get('dq'), '.1e')} |")
    for s in part.get("skipped", []):
        lines.append(f"- skipped {s['what']}: {s['reason']}")
    return lines
