"""Data: webdataset image-text / image-label / LM-text pipelines, shard writers and shard tools."""
from __future__ import annotations

from diffmm.data.dist import assign_shards, detect_rank_world
from diffmm.data.files import write_json_atomic
from diffmm.data.image_text import ImageLabelDataset, ImageTextDataset, image_label_loader, image_text_loader
from diffmm.data.shard_tools import (check_shards, index_shards, write_shards_from_captions, write_shards_from_folders,
                                     write_shards_from_text)
from diffmm.data.stats import DataStats
from diffmm.data.stream import ShardLoader, ShardStream
from diffmm.data.text import TextDataset, inputs_targets, text_loader
from diffmm.data.tokenizers import ClipBPE, TokenizerFile, load_lm_tokenizer, train_byte_level_bpe
from diffmm.data.urls import expand_sources
from diffmm.data.writer import ShardWriter

__all__ = [
    "ClipBPE", "DataStats", "ImageLabelDataset", "ImageTextDataset", "ShardLoader", "ShardStream", "ShardWriter",
    "TextDataset", "TokenizerFile", "assign_shards", "check_shards", "detect_rank_world",
    "expand_sources", "image_label_loader", "image_text_loader", "index_shards", "inputs_targets",
    "load_lm_tokenizer", "text_loader", "train_byte_level_bpe", "write_json_atomic",
    "write_shards_from_captions", "write_shards_from_folders", "write_shards_from_text",
]
