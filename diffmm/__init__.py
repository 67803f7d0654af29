"""diffmm: differential attention for multimodal models.

Top-level API (mirrors open_clip where it overlaps):
    diffmm.ops.diff_attention     the attention kernel contract and its backends
    diffmm.nn                     DiffAttention, Attention, RMSNorm, SwiGLU, RoPE, KVCache
    diffmm.load_pretrained        one loader for every supported checkpoint format
    diffmm.create_model           CLIP models by name (one rule for names: diffmm.models.clip.naming)
    diffmm.list_pretrained        what can be loaded, by tag (local file formats)

``import diffmm`` registers diffmm's ViTs with timm (``timm.create_model("diffmm_diffclip_vit_b_16")``) without
importing timm itself: when timm is already imported they are registered at once, otherwise the moment timm is.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys

__version__ = "0.1.0"

from diffmm.hub import load_pretrained  # noqa: E402

# Names resolved lazily so `import diffmm` stays light (no open_clip / timm / lightning import).
_LAZY = {
    "create_model": "diffmm.models.clip.factory",
    "create_model_and_transforms": "diffmm.models.clip.factory",
    "get_tokenizer": "diffmm.models.clip.factory",
    "list_models": "diffmm.models.clip.factory",
    "list_pretrained": "diffmm.models.clip.naming",
    "describe_pretrained": "diffmm.models.clip.naming",
    "swap_attention": "diffmm.models.swap",
    "DiffLM": "diffmm.models.lm",
    "LMConfig": "diffmm.models.lm",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'diffmm' has no attribute {name!r}")


__all__ = ["load_pretrained", "__version__", *_LAZY]


# ----- timm entrypoints: registered when timm is imported ------------------------------------------------------
def _register_timm_models() -> None:
    try:
        import diffmm.models.timm_models  # noqa: F401  (registers diffmm_* with timm)
    except Exception as e:  # pragma: no cover - never break the user's `import timm`
        logging.getLogger("diffmm").warning("diffmm: timm entrypoints not registered: %s", e)


class _TimmImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when ``timm`` is first imported, wraps its loader so that diffmm's entrypoints are
    registered right after timm's ``__init__`` ran (one shot, then it leaves ``sys.meta_path``)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "timm":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("timm")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module, _exec=exec_module):
            _exec(module)
            _register_timm_models()

        spec.loader.exec_module = exec_then_register
        return spec


if "timm" in sys.modules:
    _register_timm_models()
elif not any(isinstance(f, _TimmImportHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _TimmImportHook())
