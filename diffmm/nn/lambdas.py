"""lambda of differential attention (DIFF Transformer, arXiv 2410.05258, section 2.1): the ``lambda_init``
schedules and the re-parameterised ``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init``."""
from __future__ import annotations

import math

import torch


def lambda_init_depth(layer: int) -> float:
    """``0.8 - 0.6 * exp(-0.3 * layer)`` for 0-based ``layer``: 0.2, 0.356, 0.471, ..."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


def resolve_lambda_init(spec: str | float, layer: int) -> float:
    """``'depth'`` -> the depth schedule, ``'constant'`` -> 0.8 (DiffCLIP), a number -> itself."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return float(spec)
    if spec == "depth":
        return lambda_init_depth(layer)
    if spec == "constant":
        return 0.8
    raise ValueError(f"lambda_init {spec!r} is unknown; expected 'depth', 'constant' or a number")


def lambda_full(lq1: torch.Tensor, lk1: torch.Tensor, lq2: torch.Tensor, lk2: torch.Tensor,
                lambda_init: float) -> torch.Tensor:
    """The re-parameterised lambda as a 0-d tensor in fp32 (fp64 for fp64 vectors); differentiable."""
    ct = torch.promote_types(lq1.dtype, torch.float32)
    q1, k1, q2, k2 = (t.to(ct) for t in (lq1, lk1, lq2, lk2))
    return torch.exp(torch.dot(q1, k1)) - torch.exp(torch.dot(q2, k2)) + float(lambda_init)
