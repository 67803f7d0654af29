"""diffmm: differential attention for multimodal models.

Top-level API (open_clip's where it overlaps; model names and weights: :mod:`diffmm.hub.factory`):
    diffmm.create_model, create_model_and_transforms, get_tokenizer    CLIP and LM models by name
    diffmm.load_pretrained        one loader for every supported checkpoint format
    diffmm.list_models            the CLIP model configs; list_pretrained: the file formats that load into them
    DiffCLIP / DiffLM .save_pretrained / .from_pretrained               diffmm's export folder (and the Hub)
    diffmm.swap_attention         convert the attention of an existing model (open_clip, timm, DiffCLIP)
    diffmm.DiffLM, diffmm.LMConfig    the DIFF Transformer decoder LM
    diffmm.ops.diff_attention     the attention kernel contract and its backends
    diffmm.nn                     DiffAttention, Attention, RMSNorm, SwiGLU, RoPE, KVCache

``import diffmm`` registers diffmm's ViTs with timm (``timm.create_model("diffmm_diffclip_vit_b_16")``). It does not
import open_clip (only ``open_clip:`` names, tokenizers and open_clip's own models do), Lightning or webdataset.
"""
import diffmm.models.timm_models  # noqa: F401  (registers the diffmm_* ViTs with timm)
from diffmm.hub.factory import (create_model, create_model_and_transforms, get_tokenizer, list_pretrained,
                                load_pretrained)
from diffmm.models.clip.config import list_models
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.models.swap import swap_attention

__version__ = "0.1.0"

__all__ = ["__version__", "create_model", "create_model_and_transforms", "get_tokenizer", "list_models",
           "list_pretrained", "load_pretrained", "swap_attention", "DiffLM", "LMConfig"]
