"""Feed-forward blocks: SwiGLU (LMs) and the two-layer GELU MLP (CLIP towers)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffmm.ops.activations import quick_gelu


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases by default (LLaMA / DIFF LM)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``, the GELU approximation of OpenAI CLIP's text tower."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quick_gelu(x)


ACTIVATIONS = {"gelu": nn.GELU, "quick_gelu": QuickGELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
               "silu": nn.SiLU, "relu": nn.ReLU}


def create_act(name: str) -> nn.Module:
    """Activation by name; an unknown name lists the known ones."""
    try:
        return ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}") from None
