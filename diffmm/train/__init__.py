"""Lightning training: modules, data modules, the ``diffmm fit|validate|test|predict`` CLI.

Imported lazily so ``import diffmm.train`` does not import Lightning until a name is used.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CLIPModule": "clip_module", "LMModule": "lm_module", "TrainModule": "base",
    "ImageTextDataModule": "datamodules", "TextDataModule": "datamodules", "ShardDataModule": "datamodules",
    "ContrastiveLoss": "losses", "ResumableLoader": "resume", "AtomicCheckpointIO": "checkpoint_io",
    "param_groups": "optim", "WarmupCosine": "optim", "ConfigError": "errors", "BlockFSDPStrategy": "strategies",
    "RecallLMModule": "recall_module", "RecallDataModule": "recall_data",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"diffmm.train.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'diffmm.train' has no attribute {name!r}")
