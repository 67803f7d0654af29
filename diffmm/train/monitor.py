"""What the training modules log besides the loss: lambdas of differential attention layers and throughput."""
from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.nn as nn


def lambda_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that define ``lambda_full()`` (differential attention layers), by dotted name."""
    return {name: m for name, m in model.named_modules() if callable(getattr(m, "lambda_full", None))}


@torch.no_grad()
def lambda_values(layers: dict[str, nn.Module]) -> dict[str, float]:
    """``lambda/<layer>`` -> lambda of that layer (one value per layer, shared by its heads), plus
    ``lambda_mean/<tower>`` -> mean over the layers under each top-level child (``visual``, ``transformer``, ...)."""
    if not layers:
        return {}
    names = list(layers)
    vals = torch.stack([layers[n].lambda_full().detach().float().reshape(()) for n in names]).cpu().tolist()
    out = {f"lambda/{n}": v for n, v in zip(names, vals)}
    towers: dict[str, list[float]] = defaultdict(list)
    for n, v in zip(names, vals):
        towers[n.split(".", 1)[0] if "." in n else "model"].append(v)
    out.update({f"lambda_mean/{t}": sum(vs) / len(vs) for t, vs in towers.items()})
    return out


class Throughput:
    """Items per second over the window between two :meth:`rate` calls (wall clock, includes data loading).

    Call :meth:`add` once per step with the items of that step, :meth:`rate` when logging.
    """

    def __init__(self) -> None:
        self._t0: float | None = None
        self._items = 0

    def reset(self) -> None:
        """Start a new window now."""
        self._t0, self._items = time.perf_counter(), 0

    def add(self, items: int) -> None:
        """Count ``items`` processed in this step."""
        if self._t0 is None:
            self.reset()
            return  # the first step after a reset only starts the clock
        self._items += int(items)

    def rate(self) -> float | None:
        """Items/s since the last :meth:`rate` (None when nothing was counted); starts a new window."""
        if self._t0 is None or self._items == 0:
            return None
        now = time.perf_counter()
        r = self._items / max(now - self._t0, 1e-9)
        self._t0, self._items = now, 0
        return r
