"""Running and recording the GPU check (``scripts/gpu_check.py``): the run context and deadlines, timing, and the
JSON / markdown recorder with the tables of every part."""
from __future__ import annotations

import gc
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

PARTS = ("correctness", "speed", "diff_v2", "train")
TITLES = {"correctness": "1. Correctness: triton (and flash) vs reference",
          "speed": "2. Attention speed, TFLOP/s and memory (bf16)",
          "diff_v2": "3. DIFF V1 / V2 vs standard: prefill, training step, decode",
          "train": "4. Training step: DiffCLIP-ViT-B/16 and DIFF LM layer stacks, triton vs sdpa"}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

GRAD_NAMES = ("y", "dq", "dk", "dv", "dlam", "dnorm_weight")


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
    "train": {"rows": {"model": "model", "attention": "attention", "backend": "backend", "head": "head",
                       "status": "status",
                       "params M": "params_m", "loss step 0": "loss0", "loss step 1": "loss1", "ms/step": "step_ms",
                       "throughput": "throughput", "per": "unit", "peak GiB": "peak_gib", "job s": "wall_s"},
              "checks": {"model": "model", "first vs second": "compared", "loss0 rel diff": "loss0_rel_diff",
                         "tol": "tol", "ok": "ok", "loss1 rel diff": "loss1_rel_diff",
                         "grad-norm rel diff": "grad_norm0_rel_diff", "speed first / second": "speed_first_over_second",
                         "peak GiB first / second": "peak_first_over_second"}},
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
