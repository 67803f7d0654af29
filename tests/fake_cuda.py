"""TEST-ONLY: a CUDA device without a GPU. ``fake_cuda()`` runs code under torch's ``FakeTensorMode`` with
``device="cuda"`` as the default device (tensors carry shapes, dtypes and devices, no data; a CPU tensor meeting
a CUDA one raises); ``to_fake_cuda(model, mode)`` moves a model there; ``one_gpu()`` has ``torch.cuda`` report one
sm_90 GPU so that backend dispatch takes the CUDA choices (``trusting_triton()``: the same for torch.compile's
tracing); ``backward(loss)`` runs the backward pass of fake CUDA tensors, which torch's C++ autograd engine cannot
without a CUDA context (pytorch/pytorch#92627); ``ops_called()`` records the names of the ops that run."""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from typing import Iterator
from unittest import mock

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import diffmm.ops as ops


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """Fake tensors with default device cuda:0."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode, torch.device("cuda:0"):
        yield mode


def to_fake_cuda(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """What ``model.to("cuda")`` does (parameters and buffers, ties kept), with fake CUDA tensors; inside ``mode``.
    (Models are built on the CPU: weight initialisation is data-dependent, and ``Module.to`` cannot swap fake
    parameters in place.)"""
    done: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            f = mode.from_tensor(t).to("cuda:0").detach()
            done[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        return done[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fake(t)
    return model


@contextlib.contextmanager
def one_gpu(capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """``torch.cuda`` answers as one GPU of ``capability`` (for backend dispatch and autocast; not for
    torch.compile, which then reaches for the driver: see :func:`trusting_triton`)."""
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.get_device_capability", return_value=capability), \
            mock.patch("torch.cuda.is_bf16_supported", return_value=capability >= (8, 0)):
        yield


@contextlib.contextmanager
def trusting_triton() -> Iterator[None]:
    """The ``triton`` backend takes every CUDA call, through diffmm's registry alone: for torch.compile, whose
    tracing reaches for the driver when ``torch.cuda`` is patched (:func:`one_gpu`). Use it with models whose every
    call the real dispatch gives to the fused kernel (the eager tests check which)."""
    pytest.importorskip("triton")
    backend = ops.get_backend("triton")

    def unsupported(call):
        return None if call.q.device.type == "cuda" else backend.unsupported(call)

    ops.register_backend(dataclasses.replace(backend, unsupported=unsupported), replace=True)
    try:
        yield
    finally:
        ops.register_backend(backend, replace=True)


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` for fake CUDA tensors: every node of the graph is called in topological order, as the
    engine calls it, with the engine's handling of each gradient (a device other than the input's is an error; a
    dtype other than the input's is cast, a broadcast shape summed) and its accumulation into the leaves'
    ``.grad``. Hooks do not run."""
    order, seen, stack = [], set(), [(loss.grad_fn, False)]
    while stack:  # post-order DFS
        fn, expanded = stack.pop()
        if expanded:
            order.append(fn)
        elif fn not in seen:
            seen.add(fn)
            stack.append((fn, True))
            stack.extend((nxt, False) for nxt, _ in fn.next_functions if nxt is not None and nxt not in seen)
    pending = {loss.grad_fn: [torch.ones_like(loss)]}
    for fn in reversed(order):
        grads = pending.pop(fn, None)
        if grads is None:
            continue
        if hasattr(fn, "variable"):  # AccumulateGrad
            leaf = fn.variable
            leaf.grad = grads[0] if leaf.grad is None else leaf.grad + grads[0]
            continue
        edges = fn.next_functions
        if hasattr(fn, "needs_input_grad"):  # an autograd.Function: grads of every forward input, edges of tensors
            grads = [torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g
                     for g, m in zip(grads, fn._input_metadata)]  # materialized, as the engine does
            outs = fn.apply(*grads)
            outs = outs if isinstance(outs, tuple) else (outs,)
            outs = [g for g, need in zip(outs, fn.needs_input_grad) if need]
            edges = [e for e in edges if e[0] is not None]
        else:
            outs = fn(*grads)
            outs = outs if isinstance(outs, tuple) else (outs,)
        for (nxt, slot), g in zip(edges, outs):
            if nxt is None or g is None:
                continue
            meta = nxt._input_metadata[slot]
            if g.device != meta.device and not (g.dim() == 0 and g.device.type == "cpu"):
                raise RuntimeError(f"{fn.name()} gives a gradient on {g.device} to {nxt.name()}, whose input is "
                                   f"on {meta.device}")
            if tuple(g.shape) != tuple(meta.shape):  # a broadcast input: reduced as the engine reduces it
                g = g.sum_to_size(meta.shape)
            g = g.to(meta.dtype)
            inputs = pending.setdefault(nxt, [None] * len(nxt._input_metadata))
            inputs[slot] = g if inputs[slot] is None else inputs[slot] + g


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.name()] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def ops_called() -> Iterator[Counter]:
    """A Counter of the ATen / custom op names (``'diffmm::triton_diff_fwd'``, ...) dispatched inside."""
    with _Recorder() as rec:
        yield rec.names
