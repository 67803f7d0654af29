"""What the training modules log besides the loss and throughput: the lambdas of differential attention layers."""
from __future__ import annotations

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
