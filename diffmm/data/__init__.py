"""Data: webdataset image-text / image-label / LM-text pipelines, shard writers and the demo datasets.

Names are imported lazily so that ``diffmm shards --help`` stays fast.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "ImageTextDataset": "image_text", "ImageLabelDataset": "image_text", "image_text_loader": "image_text",
    "image_label_loader": "image_text", "TextDataset": "text", "text_loader": "text", "inputs_targets": "text",
    "ShardStream": "stream", "ShardLoader": "stream", "DataStats": "stats", "ShardWriter": "writer",
    "image_transform": "transforms", "clip_tokenizer": "tokenizers", "load_lm_tokenizer": "tokenizers",
    "train_byte_level_bpe": "tokenizers", "TokenizerFile": "tokenizers", "ClipBPE": "tokenizers",
    "expand_sources": "urls", "read_sizes": "urls", "detect_rank_world": "dist", "assign_shards": "dist",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"diffmm.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'diffmm.data' has no attribute {name!r}")
