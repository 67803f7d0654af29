"""Shared helpers of the evaluations: the error type, devices, precision and markdown tables."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

import torch


class EvalError(ValueError):
    """Bad evaluation input; the message is one line naming the file/field and what was expected."""


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None``/``"auto"`` -> cuda if available else cpu."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def autocast(device: torch.device, precision: str = "auto"):
    """Autocast context for ``precision``: ``auto`` (bf16/fp16 AMP on CUDA, fp32 elsewhere), ``amp``,
    ``bf16``, ``fp16`` or ``fp32``."""
    if precision not in ("auto", "amp", "bf16", "fp16", "fp32"):
        raise EvalError(f"precision {precision!r} is unknown; expected auto, amp, bf16, fp16 or fp32")
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return contextlib.nullcontext()
    if precision in ("auto", "amp"):
        dtype = torch.bfloat16 if device.type != "cuda" or torch.cuda.is_bf16_supported() else torch.float16
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], floatfmt: str = ".2f") -> str:
    """A GitHub markdown table; floats are formatted with ``floatfmt``."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return format(v, floatfmt) if math.isfinite(v) else "n/a"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def model_device(model: torch.nn.Module) -> torch.device:
    """Device of the model's first parameter or buffer (cpu if it has none)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")
