"""Attention backends by name, and the dispatcher that picks one per call.

A backend implements the differential op, the standard op, or both. Choosing one:

1. the ``backend=`` argument (set per module), else
2. the ``DIFFMM_ATTN_BACKEND`` environment variable, else
3. automatic: the first backend in ``AUTO_ORDER`` that is available and can run the call
   (device, dtype, head dim, mask). Skipped backends are logged at debug level with the reason.

Forcing a backend that cannot run a call is a one-line error saying why.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

log = logging.getLogger("diffmm.ops")

ENV_VAR = "DIFFMM_ATTN_BACKEND"
AUTO = "auto"


@dataclass(frozen=True)
class AttentionCall:
    """What the dispatcher knows about one call."""

    op: str  # "diff" or "standard"
    q: torch.Tensor  # backends read only its device, dtype and shape
    attn_mask: Optional[torch.Tensor]
    causal: bool
    head_dim: int
    value_dim: int


@dataclass(frozen=True)
class AttentionBackend:
    """One backend.

    Attributes:
        name: registry key, e.g. ``"sdpa"``.
        diff: implementation of :func:`diffmm.ops.diff_attention` (same signature), or None.
        standard: implementation of :func:`diffmm.ops.attention`, or None.
        unsupported: returns None when the backend can run the call, else the reason (one line).
        description: one line saying what the backend is.
    """

    name: str
    diff: Optional[Callable]
    standard: Optional[Callable]
    unsupported: Callable[[AttentionCall], Optional[str]]
    description: str = ""


_BACKENDS: dict[str, AttentionBackend] = {}
# Automatic dispatch tries these in order; a backend registered later (e.g. "triton") is placed by name.
AUTO_ORDER: list[str] = ["triton", "flash", "sdpa"]


def register_backend(backend: AttentionBackend, *, replace: bool = False) -> None:
    """Add a backend to the registry."""
    if backend.name in _BACKENDS and not replace:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    if backend.name == AUTO:
        raise ValueError(f"{AUTO!r} is reserved for automatic dispatch")
    _BACKENDS[backend.name] = backend


def get_backend(name: str) -> AttentionBackend:
    """Look a backend up by name; an unknown name is an error listing the registered ones."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join([AUTO, *sorted(_BACKENDS)])}") from None


def list_backends(op: str | None = None) -> list[str]:
    """Names of registered backends (that implement ``op`` if given)."""
    return sorted(n for n, b in _BACKENDS.items() if op is None or getattr(b, op) is not None)


def select_backend(call: AttentionCall, backend: str | None = None) -> AttentionBackend:
    """Pick the backend for ``call``: explicit name, then ``DIFFMM_ATTN_BACKEND``, then automatic."""
    name = backend or os.environ.get(ENV_VAR) or AUTO
    if name != AUTO:
        b = get_backend(name)
        if getattr(b, call.op) is None:
            raise ValueError(f"attention backend {name!r} has no {call.op} attention; "
                             f"backends that do: {', '.join(list_backends(call.op))}")
        reason = b.unsupported(call)
        if reason is not None:
            raise RuntimeError(f"attention backend {name!r} cannot run this call: {reason}")
        return b
    for cand in AUTO_ORDER:
        b = _BACKENDS.get(cand)
        if b is None or getattr(b, call.op) is None:
            continue
        reason = b.unsupported(call)
        if reason is None:
            return b
        if not torch.compiler.is_compiling():  # a logging call would break a torch.compile graph
            log.debug("attention backend %s skipped: %s", cand, reason)
    return _BACKENDS["reference"]
