"""DiffCLIP and its standard twin: ViT and causal text towers with registry attention, open_clip's API."""
from diffmm.models.clip.config import CLIPConfig, TextCfg, VisionCfg, from_open_clip_config, load_config_file
from diffmm.models.clip.factory import (add_model_config, apply_swap, create_model, create_model_and_transforms,
                                        get_model_config, get_tokenizer, list_models, tokenizer_for)
from diffmm.models.clip.naming import describe_pretrained, list_pretrained
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.clip.text import TextTransformer
from diffmm.models.clip.vision import VisionTransformer

try:  # make diffmm's ViTs reachable through timm.create_model("diffmm_...")
    import diffmm.models.timm_models  # noqa: F401
except ImportError as e:  # pragma: no cover - timm is a dependency; keep the CLIP API usable without it
    import logging

    logging.getLogger("diffmm.models").debug("timm entrypoints not registered: %s", e)

__all__ = ["CLIPConfig", "TextCfg", "VisionCfg", "from_open_clip_config", "load_config_file", "add_model_config",
           "create_model", "create_model_and_transforms", "get_model_config", "get_tokenizer", "list_models",
           "apply_swap", "tokenizer_for", "list_pretrained", "describe_pretrained",
           "DiffCLIP", "TextTransformer", "VisionTransformer"]
