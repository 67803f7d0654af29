"""Weights: safe file reading, checkpoint formats and converters, exports, and the one factory of model names
(:mod:`diffmm.hub.factory`)."""
from diffmm.hub.checkpoint import DamagedFileError, atomic_save, check_state_dict, load_state_file
from diffmm.hub.factory import (create_model, create_model_and_transforms, describe_pretrained, get_tokenizer,
                                list_pretrained, load_pretrained)

__all__ = ["DamagedFileError", "atomic_save", "check_state_dict", "load_state_file", "create_model",
           "create_model_and_transforms", "describe_pretrained", "get_tokenizer", "list_pretrained", "load_pretrained"]
