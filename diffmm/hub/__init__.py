"""Weights: the one factory of model names (:mod:`diffmm.hub.factory`), the checkpoint formats it reads
(:mod:`diffmm.hub.formats`) and their converters, exports."""
from diffmm.hub.factory import (create_model, create_model_and_transforms, get_tokenizer, list_pretrained,
                                load_pretrained)
from diffmm.models.weights import DamagedFileError

__all__ = ["DamagedFileError", "create_model", "create_model_and_transforms", "get_tokenizer", "list_pretrained",
           "load_pretrained"]
