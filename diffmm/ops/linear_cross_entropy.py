"""Cross entropy of a linear head without the full logits: the LM head and its loss, fused by chunks of rows.

``F.cross_entropy(hidden @ weight.T, targets)`` writes (N, V) logits, a (N, V) log-softmax, and in backward a
zero-filled (N, V) gradient and another (N, V) log-softmax gradient: at 2,048 tokens and a 32,000-word vocabulary
that is four passes over 262 MB each, about a third of the head's time on a CPU. Here the rows go through in chunks
whose logits stay in cache, and the gradients of ``hidden`` and ``weight`` are computed in the same pass
(``softmax - onehot``, scaled by 1/n), so backward only scales them by the incoming gradient. Same three matmuls,
no (N, V) tensor: measured in docs/attention.md, "CPU step".
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

#: logits per chunk (rows x vocabulary): 16 MB of fp32 on a CPU (stays in the last-level cache), 1 GB on GPUs
CHUNK_ELEMENTS = {"cpu": 1 << 22}
GPU_CHUNK_ELEMENTS = 1 << 28


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, chunk: int,
             dtype: torch.dtype, with_grad: bool):
    """Mean cross entropy of ``hidden @ weight.T`` (matmuls in ``dtype``, softmax in fp32 or fp64) and, with
    ``with_grad``, its gradients with respect to ``hidden`` (N, E) and ``weight`` (V, E)."""
    acc = torch.promote_types(dtype, torch.float32)  # softmax, loss and gradient sums
    valid = targets != ignore_index  # (N,)
    n = valid.sum()
    safe_targets = torch.where(valid, targets, 0)
    row_scale = valid.to(acc) / n.clamp(min=1)  # (N,) each row's weight in the mean; 0 where ignored
    h, w = hidden.to(dtype), weight.to(dtype)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if with_grad else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if with_grad else None
    for s in range(0, h.shape[0], chunk):
        hs, ts = h[s:s + chunk], safe_targets[s:s + chunk]  # (C, E), (C,)
        rows = torch.arange(hs.shape[0], device=hs.device)
        logp = torch.log_softmax(torch.mm(hs, w.t()).to(acc), dim=-1)  # (C, V)
        total -= (logp[rows, ts] * valid[s:s + chunk]).sum()
        if not with_grad:
            continue
        dlogits = logp.exp_()  # softmax
        dlogits[rows, ts] -= 1  # d(-log p_t)/d logits = softmax - onehot
        dlogits = dlogits.to(dtype)
        scale = row_scale[s:s + chunk, None]  # (C, 1): applied to the small factors, not to the (C, V) block
        torch.mul(torch.mm(dlogits, w), scale, out=grad_h[s:s + chunk])
        hs_scaled = hs * scale.to(dtype)
        if dtype == acc:
            grad_w.addmm_(dlogits.t(), hs_scaled)
        else:
            grad_w += torch.mm(dlogits.t(), hs_scaled)
    loss = total / n  # nan when every target is ignored, as F.cross_entropy
    if not with_grad:
        return loss, None, None
    return loss, grad_h.to(hidden.dtype), grad_w.to(weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Gradients computed in forward; backward scales them by the loss's incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk, dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            loss, grad_h, grad_w = _chunked(hidden, weight, targets, ignore_index, chunk, dtype, with_grad=True)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * dloss.to(grad_h.dtype), grad_w * dloss.to(grad_w.dtype), None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = -100, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Mean cross entropy of ``hidden @ weight.T`` against ``targets``, equal to
    ``F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=ignore_index)`` up to rounding.

    Args:
        hidden: (..., E) inputs of the head.
        weight: (V, E) head weight (no bias).
        targets: (...) class ids, ``ignore_index`` where nothing is scored.
        ignore_index: target value left out of the mean.
        chunk_size: rows per chunk; default: a 16 MB fp32 logit block on a CPU.

    Returns:
        0-d loss, fp32 (fp64 for fp64 inputs; nan when every target is ignored). Under autocast the matmuls run
        in the autocast dtype, the softmax in fp32.
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected (vocab, {hidden.shape[-1]}) to match "
                         f"hidden {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets has shape {tuple(targets.shape)}; expected {tuple(hidden.shape[:-1])} like hidden")
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if torch.compiler.is_compiling():  # the compiler fuses the plain formula itself
        return F.cross_entropy(F.linear(h, weight).float(), t, ignore_index=ignore_index)
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    chunk = chunk_size or max(1, CHUNK_ELEMENTS.get(device, GPU_CHUNK_ELEMENTS) // weight.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, t, ignore_index, chunk, dtype)
    with torch.autocast(device, enabled=False):
        return _chunked(h, weight, t, ignore_index, chunk, dtype, with_grad=False)[0]
