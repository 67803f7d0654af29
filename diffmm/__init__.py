"""diffmm: differential attention for multimodal models.

Top-level API (mirrors open_clip where it overlaps):
    diffmm.ops.diff_attention     the attention kernel contract and its backends
    diffmm.nn                     DiffAttention, Attention, RMSNorm, SwiGLU, RoPE, KVCache
    diffmm.load_pretrained        one loader for every supported checkpoint format
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

from diffmm.hub import load_pretrained  # noqa: E402

# Names resolved lazily so `import diffmm` stays light (no open_clip / timm / lightning import).
_LAZY = {
    "create_model": "diffmm.models.clip.factory",
    "create_model_and_transforms": "diffmm.models.clip.factory",
    "get_tokenizer": "diffmm.models.clip.factory",
    "list_models": "diffmm.models.clip.factory",
    "swap_attention": "diffmm.models.swap",
    "DiffLM": "diffmm.models.lm",
    "LMConfig": "diffmm.models.lm",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'diffmm' has no attribute {name!r}")


__all__ = ["load_pretrained", "__version__", *_LAZY]
