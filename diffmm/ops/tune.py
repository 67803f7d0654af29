"""The measured CPU layout table of the ``sdpa`` backend: which layout is fastest for a call.

``scripts/bench_attention.py --tune`` times every layout of :mod:`diffmm.ops.sdpa` (``combined``, ``split``,
``pair``, ``halves``, ``flash2d``) on a grid of shapes, for each mask kind, grad mode, dtype and thread count,
and writes ``cpu_tune.json`` next to this file (it ships with the package). For a call the dispatcher takes the
entries of the same mask kind and grad mode (same dtype if measured, else float32; nearest thread count), then
the nearest shape in log space over (N, S, B*h, d); if even that one is more than 4x away in some size, or the
table is missing, unreadable or from another format version, the built-in default decides (``combined`` on
CPU). Calls with <= 16 queries (decoding) use ``pair`` before any table is consulted. A bad table is reported
once as a warning and never breaks a call.

``DIFFMM_CPU_TUNE=/path/to/table.json`` reads another table; ``DIFFMM_CPU_TUNE=off`` ignores every table.
``DIFFMM_SDPA_LAYOUT`` (or ``layout=``) still forces one layout.

Table format (version 1)::

    {"version": 1, "device": "cpu", "torch": "2.x", "cpu": "...", "created": "...", "clock": "wall",
     "entries": [{"dtype": "float32", "mask": "causal", "grad": true, "threads": 2,
                  "B": 4, "N": 512, "S": 512, "h": 8, "h_kv": 8, "d": 32,
                  "ms": {"combined": 12.1, "halves": 10.4, ...}, "best": "halves"}, ...]}
"""
from __future__ import annotations

import json
import logging
import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("diffmm.ops")

VERSION = 1
TABLE_PATH = Path(__file__).with_name("cpu_tune.json")
ENV_TABLE = "DIFFMM_CPU_TUNE"
MASK_KINDS = ("none", "causal", "padding", "additive")
#: An entry is used only if it is within this many octaves (log2 units) of the call in every size.
MAX_DISTANCE = 2.0
_REQUIRED = {"dtype": str, "mask": str, "grad": bool, "threads": int, "B": int, "N": int, "S": int, "h": int,
             "h_kv": int, "d": int, "best": str}


class TableError(ValueError):
    """A tune table that cannot be used (the message names the file and what is wrong)."""


def validate_table(data, source: str, layouts: tuple[str, ...]) -> list[dict]:
    """Check a parsed table and return its entries; a :class:`TableError` names the first problem."""
    if not isinstance(data, dict):
        raise TableError(f"{source}: expected a JSON object with 'version' and 'entries'")
    if data.get("version") != VERSION:
        raise TableError(f"{source}: format version {data.get('version')!r}; this diffmm reads version {VERSION}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise TableError(f"{source}: 'entries' must be a list")
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise TableError(f"{source}: entries[{i}] is not an object")
        for key, typ in _REQUIRED.items():
            if not isinstance(e.get(key), typ) or (typ is int and isinstance(e.get(key), bool)):
                raise TableError(f"{source}: entries[{i}].{key} is {e.get(key)!r}; expected {typ.__name__}")
        if e["best"] not in layouts:
            raise TableError(f"{source}: entries[{i}].best is {e['best']!r}; expected one of {', '.join(layouts)}")
        if e["mask"] not in MASK_KINDS:
            raise TableError(f"{source}: entries[{i}].mask is {e['mask']!r}; expected one of {', '.join(MASK_KINDS)}")
        for key in ("threads", "B", "N", "S", "h", "h_kv", "d"):
            if e[key] <= 0:
                raise TableError(f"{source}: entries[{i}].{key} is {e[key]}; expected a positive size")
    return entries


def table_path() -> Optional[Path]:
    """The table in use: ``DIFFMM_CPU_TUNE`` if set (None for ``off``), else the packaged one."""
    env = os.environ.get(ENV_TABLE)
    if env is not None and env.strip().lower() in ("off", "0", "none", ""):
        return None
    return Path(env) if env else TABLE_PATH


@lru_cache(maxsize=8)
def _load(path: Optional[str], layouts: tuple[str, ...]) -> tuple[dict, ...]:
    if path is None:
        return ()
    p = Path(path)
    try:
        with open(p) as fh:
            data = json.load(fh)
        return tuple(validate_table(data, str(p), layouts))
    except FileNotFoundError:
        if p != TABLE_PATH:
            log.warning("diffmm CPU tune table %s not found; using the built-in layout heuristics", p)
        return ()
    except (OSError, ValueError) as e:  # json.JSONDecodeError and TableError are ValueErrors
        log.warning("diffmm CPU tune table unusable (%s); using the built-in layout heuristics",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return ()


def load_entries(layouts: tuple[str, ...]) -> tuple[dict, ...]:
    """The valid entries of the table in use (empty when there is none or it is unusable)."""
    path = table_path()
    return _load(None if path is None else str(path), layouts)


def clear_cache() -> None:
    """Forget loaded tables and cached decisions (after rewriting a table, or in tests)."""
    _load.cache_clear()
    _choose.cache_clear()


def mask_kind(spec) -> str:
    """``none`` | ``causal`` (square, no other mask) | ``padding`` (a bool mask) | ``additive`` (a float mask)."""
    if spec.mask is None:
        return "causal" if spec.is_causal else "none"
    return "padding" if spec.mask.dtype == torch.bool else "additive"


def _distance(e: dict, N: int, S: int, bh: int, d: int) -> tuple[float, float]:
    diffs = [abs(math.log2(a / b)) for a, b in ((N, e["N"]), (S, e["S"]), (bh, e["B"] * e["h"]), (d, e["d"]))]
    return max(diffs), sum(diffs)


@lru_cache(maxsize=4096)
def _choose(path: Optional[str], layouts: tuple[str, ...], B: int, N: int, S: int, h: int, d: int, dtype: str,
            mask: str, grad: bool, threads: int) -> Optional[str]:
    entries = [e for e in _load(path, layouts) if e["mask"] == mask and e["grad"] == grad]
    if not entries:
        return None
    same_dtype = [e for e in entries if e["dtype"] == dtype]
    entries = same_dtype or [e for e in entries if e["dtype"] == "float32"]
    if not entries:
        return None
    t_best = min({e["threads"] for e in entries}, key=lambda t: (abs(math.log2(t / threads)), -t))
    entries = [e for e in entries if e["threads"] == t_best]
    best = min(entries, key=lambda e: _distance(e, N, S, B * h, d))
    if _distance(best, N, S, B * h, d)[0] > MAX_DISTANCE:
        return None
    return best["best"]


def choose_layout(layouts: tuple[str, ...], *, B: int, N: int, S: int, h: int, d: int, dtype: torch.dtype,
                  mask: str, grad: bool, threads: Optional[int] = None) -> Optional[str]:
    """The measured best layout for a CPU call, or None when the table has nothing close enough."""
    path = table_path()
    return _choose(None if path is None else str(path), layouts, B, N, S, h, d, str(dtype).replace("torch.", ""),
                   mask, bool(grad), threads or torch.get_num_threads())
