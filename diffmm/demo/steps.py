"""Run the demo as named steps: a header per step, wall/CPU time, and failures recorded instead of raised.

A failed step is logged with its traceback (``<out>/demo.log``) and shown in the report; steps
that need its result are skipped with the reason. The demo exits non-zero when any step failed.
"""
from __future__ import annotations

import logging
import os
import resource
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

log = logging.getLogger("diffmm.demo")

OK, FAILED, SKIPPED = "ok", "failed", "skipped"


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (DataLoader workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


@dataclass
class StepRecord:
    """Outcome of one step."""

    name: str
    status: str
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    error: Optional[str] = None
    started: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)


class StepRunner:
    """Runs callables as steps and keeps their records.

    Args:
        total: number of steps announced in the headers (``[k/total]``); 0 = unknown.
        on_change: called after every step (e.g. to rewrite ``results.json``).
        stream: where headers go (default stderr, next to the progress bars).
    """

    def __init__(self, total: int = 0, on_change: Optional[Callable[[], None]] = None, stream=None) -> None:
        self.total, self.on_change = total, on_change
        self.stream = stream or sys.stderr
        self.records: list[StepRecord] = []
        self.t0 = time.perf_counter()

    def _header(self, name: str) -> None:
        k = len(self.records) + 1
        where = f"[{k}/{self.total}]" if self.total else f"[{k}]"
        elapsed = time.perf_counter() - self.t0
        print(f"\n=== {where} {name}  (demo time {elapsed / 60:.1f} min) ===", file=self.stream, flush=True)

    def run(self, name: str, fn: Callable[[], Any], *, needs: tuple[Any, ...] = (),
            store: Optional[Callable[[Any], None]] = None) -> Any:
        """Run ``fn()`` as step ``name``; return its result, or None if it failed or was skipped.

        ``needs``: results of earlier steps; if any is None the step is skipped.
        ``store``: called with the result before the step is recorded (so ``on_change`` sees it).
        """
        if any(n is None for n in needs):
            self._add(StepRecord(name, SKIPPED, error="an earlier step it needs failed or was skipped"))
            print(f"=== skipped {name}: an earlier step it needs failed or was skipped", file=self.stream)
            return None
        self._header(name)
        t, c = time.perf_counter(), cpu_seconds()
        try:
            result = fn()
        except KeyboardInterrupt:
            raise
        except Exception as e:  # a step failure must not end the demo; it is reported and sets the exit status
            msg = f"{type(e).__name__}: {e}".strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.error("step %r failed: %s\n%s", name, msg, traceback.format_exc())
            print(f"=== FAILED {name}: {msg}", file=self.stream, flush=True)
            self._add(StepRecord(name, FAILED, time.perf_counter() - t, cpu_seconds() - c, msg))
            return None
        dt = time.perf_counter() - t
        print(f"=== done {name} in {dt:.1f} s", file=self.stream, flush=True)
        if store is not None:
            store(result)
        self._add(StepRecord(name, OK, dt, cpu_seconds() - c))
        return result

    def _add(self, rec: StepRecord) -> None:
        self.records.append(rec)
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # writing the partial results must not end the run either
                log.exception("could not write the partial results")

    @property
    def failed(self) -> list[StepRecord]:
        return [r for r in self.records if r.status == FAILED]

    @property
    def skipped(self) -> list[StepRecord]:
        return [r for r in self.records if r.status == SKIPPED]


def setup_logging(out: str) -> logging.Handler:
    """Log diffmm messages (tracebacks of failed steps included) to ``<out>/demo.log``; returns the handler."""
    os.makedirs(out, exist_ok=True)
    handler = logging.FileHandler(os.path.join(out, "demo.log"), mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("diffmm")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler
