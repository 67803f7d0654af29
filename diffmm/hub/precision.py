"""Model precision by open_clip's names, with open_clip's meaning (``create_model(precision=...)``; the table of
what each name gives every parameter: docs/models.md, "open_clip's conventions"): ``fp32`` / ``amp*`` keep fp32
weights, ``fp16`` / ``bf16`` are open_clip's mixed precision, ``pure_fp16`` / ``pure_bf16`` cast everything.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from diffmm.models.clip.model import DiffCLIP

#: open_clip's precision names (its training CLI's ``--precision`` choices)
PRECISIONS = ("fp32", "fp16", "bf16", "pure_fp16", "pure_bf16", "amp", "amp_bf16", "amp_bfloat16")
_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16, "pure_fp16": torch.float16, "pure_bf16": torch.bfloat16}


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a one-line ``ValueError``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}; expected one of {', '.join(PRECISIONS)} (open_clip's names)")
    return precision


def set_precision(model: nn.Module, precision: str) -> nn.Module:
    """Put ``model``'s weights in ``precision`` (see the module docstring); returns the model.

    The mixed ``fp16`` / ``bf16`` applies to diffmm's ``DiffCLIP`` with its own text tower (open_clip's own models
    get it from open_clip's factory); other models take ``pure_*`` or ``amp*``.
    """
    dtype = _LOW.get(check_precision(precision))
    if dtype is None:
        return model
    if precision.startswith("pure_"):
        return model.to(dtype=dtype)
    if not isinstance(model, DiffCLIP) or hasattr(model, "text"):
        what = "a Hugging Face text tower" if isinstance(model, DiffCLIP) else type(model).__name__
        raise ValueError(f"precision {precision!r} (open_clip's mixed precision) is for DiffCLIP with its own text "
                         f"tower, not {what}; use pure_{precision} or amp{'_bf16' if precision == 'bf16' else ''}")
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            module.weight.data = module.weight.data.to(dtype)
            if module.bias is not None:
                module.bias.data = module.bias.data.to(dtype)
    for proj in (model.image_projection, model.text_projection):
        proj.data = proj.data.to(dtype)
    return model
