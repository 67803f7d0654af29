"""Shared pieces of ``scripts/gpu_check.py``: the run context (device, sizes, deadlines), timing, peak memory,
and the recorder that rewrites the JSON and markdown results after every case.

Imported only after ``gpu_check.py`` has set ``TRITON_INTERPRET`` (dry run), so importing torch here is safe.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class PartBudgetExceeded(Exception):
    """Raised by :meth:`Ctx.check_time` when the part's (or the whole run's) deadline has passed."""


@dataclass
class Ctx:
    """What every part needs: where it runs, how big, until when, and where results go.

    Attributes:
        device: ``cuda`` or, for ``--dry-run``, ``cpu`` (kernels under ``TRITON_INTERPRET=1``).
        dry: toy sizes on CPU.
        t0 / deadline: start of the run and the global deadline (``time.time()`` seconds).
        part_deadline: deadline of the part now running (at most ``deadline``).
        rec: the recorder.
        failures: one line per failed correctness check (any part); non-empty -> exit code 1.
    """

    device: torch.device
    dry: bool
    t0: float
    deadline: float
    rec: "Recorder"
    part_deadline: float = 0.0
    failures: list = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.time() - self.t0

    def time_left(self) -> float:
        return min(self.deadline, self.part_deadline or self.deadline) - time.time()

    def check_time(self, what: str) -> None:
        """Raise :class:`PartBudgetExceeded` naming ``what`` when no time is left for it."""
        now = time.time()
        if now >= self.deadline:
            raise PartBudgetExceeded(f"global budget used up after {now - self.t0:.0f} s; {what} not run")
        if self.part_deadline and now >= self.part_deadline:
            raise PartBudgetExceeded(f"part budget used up at {now - self.t0:.0f} s; {what} not run")

    def out_of_time(self, part: dict, what: str, left: int, noun: str) -> bool:
        """True when no time is left for ``what``; then the ``left`` items from it on go to ``part["skipped"]``."""
        try:
            self.check_time(what)
        except PartBudgetExceeded as e:
            part["skipped"].append({"what": f"{left} {noun} from {what} on", "reason": str(e)})
            return True
        return False

    def progress(self, part: str, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s {part}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, reps: Optional[int] = None, warmup: int = 1,
            grad_to_none=(), target_ms: float = 150.0, max_reps: int = 20) -> float:
    """Median milliseconds of ``fn``: CUDA events on GPU, ``perf_counter`` on CPU.

    ``warmup`` untimed calls first (compilation, autotuning), then ``reps`` timed ones; by default as many as
    fit in ``target_ms`` judged from the first timed call, between 3 and ``max_reps``. ``grad_to_none``
    tensors get ``.grad = None`` before every call, so gradient accumulation adds no extra kernel.
    """
    def call():
        for t in grad_to_none:
            t.grad = None
        fn()

    for _ in range(warmup):
        call()
    sync(device)
    times: list[float] = []

    def timed_once() -> float:
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for t in grad_to_none:
                t.grad = None
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t = time.perf_counter()
        call()
        return (time.perf_counter() - t) * 1e3

    times.append(timed_once())
    if reps is None:
        reps = int(max(3, min(max_reps, target_ms // max(times[0], 1e-3))))
    for _ in range(reps - 1):
        times.append(timed_once())
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
    if device.type == "cuda":
        torch.cuda.empty_cache()


def err_line(e: BaseException, limit: int = 200) -> str:
    """One line describing an exception."""
    msg = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {msg}"[:limit]


def fmt(v, spec: str = ".3g", none: str = "-") -> str:
    if v is None:
        return none
    if isinstance(v, float) and v != v:
        return none
    return format(v, spec)


class Recorder:
    """Holds the results and rewrites ``<stem>.json`` and ``<stem>.md`` (atomically) on every :meth:`save`.

    Args:
        json_path / md_path: the two output files.
        meta: run description (device, versions, budget, ...).
        renderers: part name -> function(part dict) -> list of markdown lines.
    """

    def __init__(self, json_path: str, md_path: str, meta: dict, renderers: dict[str, Callable]):
        self.json_path, self.md_path, self.renderers = json_path, md_path, renderers
        self.result = {"meta": meta, "parts": {}, "failures": []}

    def part(self, name: str) -> dict:
        return self.result["parts"].setdefault(name, {"status": "pending"})

    def save(self) -> None:
        self.result["meta"]["wall_s"] = round(time.time() - self.result["meta"]["t0"], 1)
        _atomic_write(self.json_path, json.dumps(self.result, indent=1, default=str) + "\n")
        _atomic_write(self.md_path, "\n".join(self.markdown()) + "\n")

    def markdown(self) -> list[str]:
        m = self.result["meta"]
        lines = [f"# GPU check: {m['device_name']} ({m['date']})", "",
                 f"torch {m['torch']}, triton {m['triton']}, flash-attn {m['flash_attn'] or 'not installed'}, "
                 f"{'DRY RUN (CPU, TRITON_INTERPRET=1, toy sizes; no figure here means anything)' if m['dry_run'] else 'CUDA'}; "
                 f"budget {m['budget_s']} s, wall {m.get('wall_s', '?')} s; command `{m['command']}`", ""]
        fails = self.result["failures"]
        lines.append(f"**Correctness failures: {len(fails)}**" + ("" if not fails else ":"))
        lines += [f"- {f}" for f in fails[:50]]
        for name, part in self.result["parts"].items():
            lines += ["", f"## {part.get('title', name)}", "",
                      f"status: **{part['status']}**" + (f" ({part['reason']})" if part.get("reason") else "") +
                      (f", {part['wall_s']} s" if "wall_s" in part else "")]
            if part.get("notes"):
                lines += [""] + [f"- {n}" for n in part["notes"]]
            render = self.renderers.get(name)
            if render is not None:
                try:
                    lines += [""] + render(part)
                except Exception as e:  # noqa: BLE001  (a rendering bug must not lose the JSON)
                    lines += ["", f"(markdown rendering failed: {err_line(e)})"]
        if "kernels" in self.result and "kernels" in self.renderers:
            lines += ["", "## Compiled kernels: registers and spills", ""]
            try:
                lines += self.renderers["kernels"](self.result["kernels"])
            except Exception as e:  # noqa: BLE001
                lines.append(f"(markdown rendering failed: {err_line(e)})")
        return lines


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
