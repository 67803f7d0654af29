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
   ``triton`` vs ``sdpa`` from the same weights and batch (equal first-step losses), and the standard twins.

Each part gets a share of ``--budget-s`` (default 480 s; time a part does not use passes on); a part out of time
skips its remaining cases and says so, and once the budget is gone the remaining parts are recorded as skipped.
After each part the JSON's ``kernels`` records each autotuner's pick per key and every binary compiled (tile,
warps, stages, shared memory, the device's ``n_regs`` / ``n_spills``). One failing case or part is recorded and
the rest continue. The JSON and the markdown are rewritten after every case, so a run cut off still leaves them.

Needs torch and triton, and imports only ``diffmm.ops``, ``diffmm.nn`` and the model classes (never open_clip,
webdataset, jsonargparse or Lightning, which the device machine does not have). Exit code: 0 all checks passed;
1 a correctness check failed (kernel vs reference, tuned tiles, fully masked rows, train-step losses) or the
correctness part crashed; 2 usage (no CUDA without ``--dry-run``); 3 another part crashed.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

if __name__ == "__main__":  # Triton decides on interpretation when first imported (by diffmm.ops below)
    if "--dry-run" in sys.argv[1:]:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)

import diffmm.ops as ops  # noqa: E402
from diffmm.models.clip.config import CLIPConfig, load_config_file  # noqa: E402
from diffmm.models.clip.model import DiffCLIP  # noqa: E402
from diffmm.models.lm import DiffLM, LMConfig  # noqa: E402
from diffmm.nn import KVCache, create_attention  # noqa: E402
from diffmm.ops import AttentionCall, flash, get_backend, select_backend, triton_diff_fwd, triton_targets  # noqa: E402
from diffmm.ops import triton_tiles  # noqa: E402
from diffmm.ops.epilogue import diff_epilogue  # noqa: E402
from diffmm.ops.sdpa import LAYOUTS, diff_attention_sdpa  # noqa: E402
from diffmm.ops.triton_diff import HEAD_DIMS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("correctness", "speed", "diff_v2", "train")
TITLES = {"correctness": "1. Correctness: triton (and flash) vs reference",
          "speed": "2. Attention speed, TFLOP/s and memory (bf16)",
          "diff_v2": "3. DIFF V1 / V2 vs standard: prefill, training step, decode",
          "train": "4. Training step: DiffCLIP-ViT-B/16 and DIFF LM layer stacks, triton vs sdpa"}
SHARE = {"correctness": 0.15, "speed": 0.45, "diff_v2": 0.12, "train": 0.28}  # of what the pre-compile leaves
PREWARM_SHARE = 0.25  # at most this part of the budget for the parallel pre-compile
OPTIONAL = ("open_clip", "webdataset", "jsonargparse", "lightning", "pytorch_lightning")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# Part 1. Tolerances of the CPU tests (tests/ops/test_triton_diff.py: fp32 2e-5, fp16 1e-2; bf16 3e-2 as its
# CUDA test) on max abs error / max abs fp32 reference value.
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}
GRAD_NAMES = ("y", "dq", "dk", "dv", "dlam", "dnorm_weight")


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

# Part 3.
LAYER_TYPES = ("standard", "diff", "diff_v2")
MODES = ("fwd", "fwdbwd", "decode")
DECODE_INNER = 20  # decode steps per timed call
LAYER_GPU = [dict(name="E512-H8-B1", dim=512, heads=8, batch=1, seqs=[1024, 4096, 8192]),
             dict(name="E2048-H16-B4", dim=2048, heads=16, batch=4, seqs=[1024, 4096])]
LAYER_DRY = [dict(name="E128-H4-B1", dim=128, heads=4, batch=1, seqs=[20])]

# Part 4. The LM shapes of the DIFF paper (830M: head dim 96, which the fused kernel does not take; 1.4B: 128).
LOSS_RTOL = 1e-2  # bf16 keeps ~3 significant digits; a mean loss over the batch differs far less than one ulp
CLIP_GPU = dict(batch=128, diff="DiffCLIP-ViT-B-16", standard="CLIP-ViT-B-16", overrides={})
CLIP_DRY = dict(batch=2, diff="DiffCLIP-Tiny", standard="CLIP-Tiny",
                overrides=dict(vision_cfg=dict(layers=1, image_size=32),
                               text_cfg=dict(layers=1, context_length=16, vocab_size=1000)))
LM_GPU = dict(batch=8, seq=2048, shapes={"830m": {"n_layer": 4}, "1.4b": {"n_layer": 4}})
LM_DRY = dict(batch=1, seq=16, shapes={  # toy widths with the paper shapes' head dims (96, 128)
    "830m": dict(n_layer=1, n_embd=192, n_head=2, vocab_size=512, block_size=16),
    "1.4b": dict(n_layer=1, n_embd=256, n_head=2, vocab_size=512, block_size=16)})


# ------------------------------------------------------------------------------------------- run and record


@dataclass
class Ctx:
    """What every part needs: where it runs, how big, until when, and where results go.

    Attributes:
        device: ``cuda`` or, for ``--dry-run``, ``cpu`` (kernels under ``TRITON_INTERPRET=1``).
        dry: toy sizes on CPU.
        t0 / deadline: start of the run and the global deadline (``time.time()`` seconds).
        rec: the recorder.
        part_deadline: deadline of the part now running (at most ``deadline``).
        failures: one line per failed correctness check (any part); non-empty -> exit code 1.
    """

    device: torch.device
    dry: bool
    t0: float
    deadline: float
    rec: Optional["Recorder"]
    part_deadline: float = 0.0
    failures: list = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def out_of_time(self, part: dict, what: str, left: int, noun: str) -> bool:
        """True when no time is left for ``what``; then the ``left`` items from it on go to ``part["skipped"]``."""
        now = time.time()
        if now >= self.deadline:
            reason = f"global budget used up after {now - self.t0:.0f} s; {what} not run"
        elif self.part_deadline and now >= self.part_deadline:
            reason = f"part budget used up at {now - self.t0:.0f} s; {what} not run"
        else:
            return False
        part["skipped"].append({"what": f"{left} {noun} from {what} on", "reason": reason})
        return True

    def progress(self, tag: str, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.1f}s {tag}] {msg}", flush=True)


def run_cases(ctx: Ctx, part: dict, tag: str, todo: list, describe: Callable, run_one: Callable,
              errors_fail: bool = False) -> None:
    """Run every item of ``todo`` until the part's time is up: one row each in ``part["rows"]``, saved after each.

    ``describe(item)`` gives the row's identifying fields (its ``label`` names it), ``run_one(item, row)`` fills in
    the measurements and ``status``; the progress line shows the measured columns of the part's table. An
    exception becomes an ``ERROR`` row (and a failure if ``errors_fail``); the other cases still run.
    """
    for i, item in enumerate(todo):
        row = describe(item)
        label = row.pop("label")
        measured = {h: k for h, k in TABLES[part["name"]]["rows"].items() if k.split(".")[0] not in row}
        if ctx.out_of_time(part, label, len(todo) - i, "cases"):
            break
        try:
            run_one(item, row)
        except Exception as e:  # noqa: BLE001  (record it, run the rest)
            row.update(status="ERROR", error=err_line(e))
            if errors_fail:
                ctx.failures.append(f"{part['name']} {label}: {row['error']}")
        part["rows"].append(row)
        shown = [f"{h} {cell(row, k)}" for h, k in measured.items() if k == "status" or cell(row, k) != "-"]
        ctx.progress(tag, f"{i + 1}/{len(todo)} {label}: " + ", ".join(shown))
        free_memory(ctx.device)
        ctx.rec.save()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, reps: Optional[int] = None, warmup: int = 1,
            grad_to_none=(), target_ms: float = 150.0, max_reps: int = 20) -> float:
    """Median milliseconds of ``fn``: CUDA events on GPU, ``perf_counter`` on CPU.

    ``warmup`` untimed calls first (compilation, autotuning), then ``reps`` timed ones; by default as many as fit
    in ``target_ms`` judged from the first timed call, between 3 and ``max_reps``. ``grad_to_none`` tensors get
    ``.grad = None`` before every call, so gradient accumulation adds no extra kernel.
    """
    def timed_once() -> float:
        for t in grad_to_none:
            t.grad = None
        if device.type != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    for _ in range(warmup):
        timed_once()
    sync(device)
    times = [timed_once()]
    if reps is None:
        reps = int(max(3, min(max_reps, target_ms // max(times[0], 1e-3))))
    times += [timed_once() for _ in range(reps - 1)]
    return statistics.median(times)


def peak_mib(fn: Callable[[], object], device: torch.device) -> Optional[float]:
    """Rise of the CUDA allocator's peak over what was allocated before one call of ``fn`` (None, no call, on CPU)."""
    if device.type != "cuda":
        return None
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def err_line(e: BaseException, limit: int = 200) -> str:
    """One line describing an exception."""
    msg = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {msg}"[:limit]


# The tables of the markdown summary: per part, the list of rows they show and each column's header -> row key
# (``a.b`` reads a nested dict).
TABLES = {
    "correctness": {"rows": {"backend": "backend", "dtype": "dtype", "case": "case", "B": "B", "N": "N", "S": "S",
                             "h": "h", "h_kv": "h_kv", "d": "d", "causal": "causal", "pad": "pad", "norm": "norm",
                             "status": "status", **{n: f"errs.{n}" for n in GRAD_NAMES}, "tol": "tol",
                             "sdpa y": "sdpa_errs.y", "sdpa dq": "sdpa_errs.dq"}},
    "speed": {"rows": {"d": "d", "N": "N", "causal": "causal", "path": "impl", "status": "status", "fwd ms": "fwd_ms",
                       "fwd TFLOP/s": "fwd_tflops", "fwd+bwd ms": "fwdbwd_ms", "fwd+bwd TFLOP/s": "fwdbwd_tflops",
                       "fwd+bwd peak MiB": "fwdbwd_peak_mib", "tuned tiles": "check.status"},
              "summary": {"d": "d", "N": "N", "causal": "causal", "fused fwd TFLOP/s": "fused_fwd_tflops",
                          "fused fwd+bwd TFLOP/s": "fused_fwdbwd_tflops", "best unfused": "best_unfused",
                          "fwd+bwd speedup": "fwdbwd_speedup_vs_best_unfused",
                          "DIFF/standard fwd": "fwd_ratio_vs_standard",
                          "DIFF/standard fwd+bwd": "fwdbwd_ratio_vs_standard"}},
    "diff_v2": {"rows": {"config": "config", "N": "N", "mode": "mode", "status": "status",
                         "V1 backend": "backends.diff", "standard ms": "standard_ms", "V1 ms": "diff_ms",
                         "V2 ms": "diff_v2_ms", "V1/std": "diff_vs_standard", "V2/std": "diff_v2_vs_standard",
                         "FLOPs V1/std": "diff_flops_ratio", "FLOPs V2/std": "diff_v2_flops_ratio",
                         "standard MiB": "standard_mib", "V1 MiB": "diff_mib", "V2 MiB": "diff_v2_mib"}},
    "train": {"rows": {"model": "model", "attention": "attention", "backend": "backend", "status": "status",
                       "params M": "params_m", "loss step 0": "loss0", "loss step 1": "loss1", "ms/step": "step_ms",
                       "throughput": "throughput", "per": "unit", "peak GiB": "peak_gib", "job s": "wall_s"},
              "checks": {"model": "model", "loss0 rel diff triton vs sdpa": "loss0_rel_diff", "tol": "tol",
                         "ok": "ok", "loss1 rel diff": "loss1_rel_diff", "grad-norm rel diff": "grad_norm0_rel_diff",
                         "triton speed / sdpa": "speed_triton_over_sdpa"}},
}


def cell(row: dict, key: str) -> str:
    """``row[key]`` as a table cell: numbers to 4 significant digits, a status with its reason."""
    value = row
    for k in key.split("."):
        value = value.get(k) if isinstance(value, dict) else None
    why = row.get("reason") or row.get("error") or row.get("zero_check")
    if key == "status" and why:
        return f"{value}: {why[:160]}"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 10000 else f"{value:.4g}"
    return "-" if value is None else str(value)


class Recorder:
    """Holds the results and rewrites ``<stem>.json`` and ``<stem>.md`` (atomically) on every :meth:`save`."""

    def __init__(self, json_path: Path, md_path: Path, meta: dict):
        self.json_path, self.md_path = json_path, md_path
        self.result = {"meta": meta, "parts": {}, "failures": []}

    def part(self, name: str) -> dict:
        return self.result["parts"].setdefault(name, {"name": name, "status": "pending"})

    def save(self) -> None:
        self.result["meta"]["wall_s"] = round(time.time() - self.result["meta"]["t0"], 1)
        self._write(self.json_path, json.dumps(self.result, indent=1, default=str))
        try:
            summary = "\n".join(self.markdown())
        except Exception as e:  # noqa: BLE001  (a rendering bug must not stop the run; the JSON holds everything)
            summary = f"(markdown rendering failed: {err_line(e)})"
        self._write(self.md_path, summary)

    @staticmethod
    def _write(path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, path)

    def markdown(self) -> list[str]:
        """The summary: run description, failed checks, then per part its status, notes, tables and skipped cases."""
        m, fails = self.result["meta"], self.result["failures"]
        kind = "DRY RUN (CPU, TRITON_INTERPRET=1, toy sizes; no figure here means anything)" if m["dry_run"] else "CUDA"
        lines = [f"# GPU check: {m['device_name']} ({m['date']})", "",
                 f"torch {m['torch']}, triton {m['triton']}, flash-attn {m['flash_attn'] or 'not installed'}, {kind}; "
                 f"budget {m['budget_s']} s, wall {m.get('wall_s', '?')} s; command `{m['command']}`", "",
                 f"**Correctness failures: {len(fails)}**" + (":" if fails else "")]
        lines += [f"- {f}" for f in fails[:50]]
        for name, part in self.result["parts"].items():
            lines += ["", f"## {TITLES[name]}", "",
                      f"status: **{part['status']}**" + (f" ({part['reason']})" if part.get("reason") else "") +
                      (f", {part['wall_s']} s" if "wall_s" in part else "")]
            if part.get("notes"):
                lines += [""] + [f"- {n}" for n in part["notes"]]
            for key, columns in TABLES[name].items():
                if part.get(key):
                    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                    lines += ["| " + " | ".join(cell(r, k) for k in columns.values()) + " |" for r in part[key]]
            if part.get("autotune") or part.get("skipped"):
                lines.append("")
            lines += [f"- autotune {k}: " + "; ".join(f"{a} -> {b}" for a, b in v.items())
                      for k, v in part.get("autotune", {}).items()]
            lines += [f"- skipped {s['what']}: {s['reason']}" for s in part.get("skipped", [])]
        cols = ("kernel", "D", "CAUSAL", "PREC", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "shared", "n_regs",
                "n_spills")
        bins = self.result.get("kernels", {}).get("binaries")
        if bins:
            lines += ["", "## Compiled kernels: registers and spills the device reports", "",
                      "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(str(b.get(c, "")) for c in cols) + " |" for b in bins]
        return lines


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


# ---------------------------------------------------------------------------------------------- 3. diff_v2


def layer_step(attn_type: str, mode: str, N: int, cfg: dict, device, dtype) -> Callable[[], None]:
    """One measured call of a causal layer (automatic backend) on x (B, N, E): ``fwd`` prefill under no_grad,
    ``fwdbwd`` a layer training step, ``decode`` ``DECODE_INNER`` single tokens over an N-position KV cache."""
    torch.manual_seed(0)
    m = create_attention(attn_type, cfg["dim"], cfg["heads"], causal=True).to(device=device, dtype=dtype)
    x = torch.randn(cfg["batch"], N, cfg["dim"], device=device, dtype=dtype)
    if mode == "fwdbwd":
        x.requires_grad_(True)

        def step():
            m.zero_grad(set_to_none=True)
            x.grad = None
            m(x).float().sum().backward()
        return step
    if mode == "fwd":
        @torch.no_grad()
        def prefill():
            m(x)
        return prefill
    cache, last = KVCache(N), x[:, N - 1:]
    with torch.no_grad():
        m(x[:, :N - 1], kv_cache=cache)  # prefill N - 1 positions

    @torch.no_grad()
    def decode():
        for _ in range(DECODE_INNER):
            cache.length = N - 1  # rewind, then attend 1 token over N keys
            m(last, kv_cache=cache)
    return decode


def forward_flops(attn_type: str, mode: str, N: int, cfg: dict) -> float:
    """Matmul FLOPs of one causal forward; ``diff`` counted as the fused kernel runs it (docs/kernels.md).

    fwd+bwd costs about 3x the forward for every type, so the ratios of the forward apply to it too.
    """
    E, H = cfg["dim"], cfg["heads"]
    d = E // H
    n_q = 1 if mode == "decode" else N
    pairs = N if mode == "decode" else N * (N + 1) / 2  # causal (query, key) pairs
    q_out = 2 * E if attn_type == "diff_v2" else E
    proj = 2 * n_q * E * (q_out + 2 * E + E + (H if attn_type == "diff_v2" else 0))
    return proj + {"standard": 4, "diff": 6, "diff_v2": 8}[attn_type] * pairs * d * H


def layer_case(ctx: Ctx, item: tuple, row: dict, dtype) -> None:
    """Every layer type at one size and mode; one type failing is recorded (status ``partial``), not the row."""
    cfg, N, mode = item
    d = cfg["dim"] // cfg["heads"]
    q = torch.empty(1, 1, cfg["heads"], d, device=ctx.device, dtype=dtype)
    row["backends"] = {"diff": select_backend(AttentionCall("diff", q, None, True, d, 2 * d)).name,
                       "standard": select_backend(AttentionCall("standard", q, None, True, d, d)).name}
    for t in LAYER_TYPES:
        try:
            step = layer_step(t, mode, N, cfg, ctx.device, dtype)
            ms = time_ms(step, ctx.device, reps=1 if ctx.dry else None, warmup=0 if ctx.dry else 2)
            row[f"{t}_ms"] = ms / (DECODE_INNER if mode == "decode" else 1)
            row[f"{t}_mib"] = peak_mib(step, ctx.device)
            row[f"{t}_flops_ratio"] = forward_flops(t, mode, N, cfg) / forward_flops("standard", mode, N, cfg)
            if "standard_ms" in row:
                row[f"{t}_vs_standard"] = row[f"{t}_ms"] / row["standard_ms"]
        except Exception as e:  # noqa: BLE001
            row[f"{t}_error"] = err_line(e)
        free_memory(ctx.device)
    errors = [f"{t}: {row[f'{t}_error']}" for t in LAYER_TYPES if f"{t}_error" in row]
    row["status"] = "partial" if errors else "ok"
    if errors:
        row["reason"] = "; ".join(errors)


def run_layers(ctx: Ctx, part: dict) -> None:
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    part["notes"] = [f"one layer per type at equal width (V1: half the heads, two components; V2: 2x query maps), "
                     f"causal, {DTYPE_NAMES[dtype]}, automatic backend; decode = ms per token over an N-position KV "
                     "cache; FLOPs = forward matmul FLOPs / standard's"]
    todo = [(cfg, N, mode) for cfg in (LAYER_DRY if ctx.dry else LAYER_GPU) for N in cfg["seqs"] for mode in MODES]

    def describe(item):
        cfg, N, mode = item
        return {"label": f"{cfg['name']} N={N} {mode}", "config": cfg["name"], "dim": cfg["dim"],
                "heads": cfg["heads"], "batch": cfg["batch"], "N": N, "mode": mode}

    run_cases(ctx, part, "3/diff-v2", todo, describe, lambda item, row: layer_case(ctx, item, row, dtype))


# ------------------------------------------------------------------------------------------------ 4. train


def clip_config(name: str, overrides: dict) -> CLIPConfig:
    """A named CLIP config (``diffmm/model_configs/NAME.json``) with ``overrides`` merged in."""
    return load_config_file(ROOT / "diffmm" / "model_configs" / f"{name}.json").replace(**overrides)


def clip_job(ctx: Ctx, spec: dict, name: str, backend: str):
    """A CLIP model by config name, and its symmetric InfoNCE loss on one batch of random images and captions."""
    cfg = clip_config(name, dict(spec["overrides"], attn_backend=backend))
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = DiffCLIP(cfg)
    v, t, B = cfg.vision_cfg, cfg.text_cfg, spec["batch"]
    g = torch.Generator().manual_seed(1)
    images = torch.randn(B, 3, v.image_size, v.image_size, generator=g).to(ctx.device)
    texts = torch.randint(1, t.vocab_size - 1, (B, t.context_length), generator=g)
    for i, end in enumerate(torch.randint(4, t.context_length, (B,), generator=g).tolist()):
        texts[i, end] = t.vocab_size - 1  # EOT (the largest id), then zero padding, as the CLIP tokenizer does
        texts[i, end + 1:] = 0
    texts, labels = texts.to(ctx.device), torch.arange(B, device=ctx.device)

    def loss_fn():
        img, txt, scale = model(images, texts, normalize=True)
        logits = scale * img @ txt.T
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    return model, loss_fn, B, "samples"


def lm_job(ctx: Ctx, spec: dict, shape: str, attention: str, backend: str):
    """The first layers of a DIFF LM paper shape (or its Transformer twin) and its next-token loss on one batch."""
    prefix = "diff" if attention == "diff" else "transformer"
    cfg = LMConfig.from_name(f"{prefix}-{shape}", attn_backend=backend, **spec["shapes"][shape])
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = DiffLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(cfg.vocab_size, (spec["batch"], spec["seq"] + 1), generator=g).to(ctx.device)
    return model, lambda: model(ids[:, :-1], ids[:, 1:])[1], spec["batch"] * spec["seq"], "tokens"


def train_steps(ctx: Ctx, model, loss_fn, row: dict) -> None:
    """Two untimed steps (their losses, the first one's grad norm), then the median of 3 timed steps (dry run: the
    second step is timed, the interpreter makes every step costly)."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1, fused=ctx.cuda)
    row["params_m"] = sum(p.numel() for p in params) / 1e6

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.cuda):
            loss = loss_fn()
        loss.backward()
        opt.step()
        return loss.detach()

    row["loss0"] = step().float().item()  # same weights and batch for every backend: comparable
    row["grad_norm0"] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float())
                                                              for p in params if p.grad is not None])).item()
    start = time.perf_counter()
    row["loss1"] = step().float().item()  # after one identical update
    row["step_ms"] = (time.perf_counter() - start) * 1e3
    if ctx.cuda:
        sync(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        row["step_ms"] = time_ms(step, ctx.device, reps=3, warmup=0)
        row["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30


def train_case(ctx: Ctx, part: dict, item: tuple, row: dict, clip: dict, lm: dict) -> None:
    kind, name, attention, backend = item
    start = time.time()
    try:
        model, loss_fn, per_step, unit = (clip_job(ctx, clip, name, backend) if kind == "clip" else
                                          lm_job(ctx, lm, name, attention, backend))
        train_steps(ctx, model, loss_fn, row)
        row.update(unit=unit, per_step=per_step, throughput=per_step / row["step_ms"] * 1e3, status="ok")
    except RuntimeError as e:  # a shape the backend does not take (830M: head dim 96) is recorded, not an error
        if f"attention backend '{backend}' cannot run this call" not in str(e):
            raise
        row.update(status="unsupported", reason=err_line(e))
    finally:
        row["wall_s"] = round(time.time() - start, 1)  # model build, compiles, all steps
    check_losses(ctx, part, row)


def check_losses(ctx: Ctx, part: dict, row: dict) -> None:
    """Once both backends of a DIFF model ran: their first-step losses must agree within ``LOSS_RTOL``."""
    pair = {r["backend"]: r for r in part["rows"] + [row]
            if r["group"] == row["group"] and r["attention"] == "diff" and r["status"] == "ok"}
    if row["attention"] != "diff" or set(pair) != {"triton", "sdpa"} or row["backend"] not in pair:
        return
    a, b = pair["triton"], pair["sdpa"]
    rel0 = abs(a["loss0"] - b["loss0"]) / max(abs(b["loss0"]), 1.0)
    chk = {"model": row["model"], "loss0_rel_diff": rel0, "tol": LOSS_RTOL, "ok": rel0 <= LOSS_RTOL,
           "loss1_rel_diff": abs(a["loss1"] - b["loss1"]) / max(abs(b["loss1"]), 1.0),
           "grad_norm0_rel_diff": abs(a["grad_norm0"] - b["grad_norm0"]) / max(b["grad_norm0"], 1e-12),
           "speed_triton_over_sdpa": b["step_ms"] / a["step_ms"]}
    part["checks"].append(chk)
    if not chk["ok"]:
        ctx.failures.append(f"train step {row['model']}: first-step loss triton {a['loss0']:.5f} vs sdpa "
                            f"{b['loss0']:.5f} (rel {rel0:.2e} > {LOSS_RTOL:.0e})")


def run_train(ctx: Ctx, part: dict) -> None:
    clip, lm = (CLIP_DRY, LM_DRY) if ctx.dry else (CLIP_GPU, LM_GPU)
    part.update(checks=[], amp="none (fp32 dry run)" if ctx.dry else "bf16 autocast",
                lm_layers={k: v["n_layer"] for k, v in lm["shapes"].items()}, lm_batch=[lm["batch"], lm["seq"]],
                clip_batch=clip["batch"], clip_models=[clip["diff"], clip["standard"]])
    part["notes"] = [f"{part['amp']}; AdamW (fused on CUDA); CLIP batch {clip['batch']}; LM batch x sequence "
                     f"{part['lm_batch']}, first layers of the DIFF paper shapes {part['lm_layers']}; median of the "
                     "timed steps after two untimed ones; job s = model build + compiles + all steps",
                     f"the first-step losses of triton and sdpa must agree within {LOSS_RTOL:.0%} (relative)"]
    todo = [("clip", clip["diff"], "diff", "triton"), ("clip", clip["diff"], "diff", "sdpa"),
            ("clip", clip["standard"], "standard", "sdpa")]
    for shape in lm["shapes"]:
        todo += [("lm", shape, "diff", "triton"), ("lm", shape, "diff", "sdpa"), ("lm", shape, "standard", "sdpa")]

    def describe(item):
        kind, name, attention, backend = item
        model = name if kind == "clip" else (f"{'diff' if attention == 'diff' else 'transformer'}-{name} "
                                             f"({lm['shapes'][name]['n_layer']} layers)")
        return {"label": f"{model} {backend}", "kind": kind, "group": name, "model": model, "attention": attention,
                "backend": backend}

    run_cases(ctx, part, "4/train", todo, describe, lambda item, row: train_case(ctx, part, item, row, clip, lm))


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
