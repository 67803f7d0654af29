"""FSDP with diffmm's transformer blocks as the wrapping (and optional activation-checkpointing) units.

Lightning's ``FSDPStrategy`` takes module *classes* for ``auto_wrap_policy``, which a YAML file
cannot name directly; :class:`BlockFSDPStrategy` takes import paths (or ``auto``) instead::

    trainer:
      strategy:
        class_path: diffmm.train.strategies.BlockFSDPStrategy
        init_args: {wrap: [auto], checkpoint_blocks: true, sharding_strategy: FULL_SHARD}
"""
from __future__ import annotations

import importlib
from typing import Any, Optional

import torch.nn as nn
from pytorch_lightning.strategies import FSDPStrategy

#: the repeated blocks of diffmm's models (``auto``)
DIFFMM_BLOCKS = ("diffmm.models.clip.blocks.VisionBlock", "diffmm.models.clip.blocks.TextBlock",
                 "diffmm.models.lm.Block")


def resolve_classes(names: list[str]) -> set[type[nn.Module]]:
    """Module classes from import paths; ``auto`` expands to :data:`DIFFMM_BLOCKS`."""
    out: set[type[nn.Module]] = set()
    for name in names:
        for path in (DIFFMM_BLOCKS if name == "auto" else (name,)):
            module, _, attr = path.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"strategy.wrap: cannot import {path!r} ({e})") from None
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise ValueError(f"strategy.wrap: {path!r} is not an nn.Module class")
            out.add(cls)
    return out


class BlockFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` wrapping each transformer block in its own FSDP unit.

    Args:
        wrap: import paths of the block classes to shard as units; ``auto`` = diffmm's blocks.
        checkpoint_blocks: also recompute those blocks' activations in backward.
        **kwargs: ``FSDPStrategy`` arguments (``sharding_strategy``, ``state_dict_type``, ``cpu_offload``, ...).
    """

    def __init__(self, wrap: Optional[list[str]] = None, checkpoint_blocks: bool = False, **kwargs: Any) -> None:
        classes = resolve_classes(wrap or ["auto"])
        kwargs.setdefault("auto_wrap_policy", classes)
        if checkpoint_blocks:
            kwargs.setdefault("activation_checkpointing_policy", classes)
        super().__init__(**kwargs)
