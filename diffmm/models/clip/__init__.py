"""DiffCLIP and its standard twin: ViT and causal text towers with registry attention, open_clip's model interface,
configs by name, and the model's preprocessing. Building by name with weights: :mod:`diffmm.hub.factory`."""
from diffmm.models.clip.config import (CLIPConfig, TextCfg, VisionCfg, add_model_config, get_model_config,
                                       list_models, load_config_file)
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.clip.preprocess import (image_size_of, image_transform, normalization_of, tokenizer_for,
                                           transforms_for, truncate_of)
from diffmm.models.clip.text import TextTransformer
from diffmm.models.clip.tokenizer import CLIPTokenizer
from diffmm.models.clip.vision import VisionTransformer

__all__ = ["CLIPConfig", "TextCfg", "VisionCfg", "add_model_config", "get_model_config", "list_models",
           "load_config_file", "DiffCLIP", "image_size_of", "image_transform", "normalization_of", "tokenizer_for",
           "transforms_for", "truncate_of", "TextTransformer", "CLIPTokenizer", "VisionTransformer"]
