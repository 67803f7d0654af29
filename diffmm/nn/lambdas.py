"""lambda_init schedules of differential attention (SPEC section 1)."""
from __future__ import annotations

import math


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
