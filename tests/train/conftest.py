"""Fixtures of the training tests: tiny image-text and text shards (config builders: ``train_configs.py``)."""
from __future__ import annotations

import pytest

from train_helpers import write_image_text_shards, write_text_shards


@pytest.fixture(scope="session")
def text_data(tmp_path_factory):
    """(train spec, val spec, tokenizer path) of tiny text shards."""
    root = tmp_path_factory.mktemp("text")
    train, tok = write_text_shards(str(root / "train"), n_docs=40, per_shard=10, seed=0)
    val, _ = write_text_shards(str(root / "val"), n_docs=8, per_shard=8, seed=1, tokenizer=tok)
    return train, val, tok


@pytest.fixture(scope="session")
def image_text_data(tmp_path_factory):
    """(train spec, val spec) of tiny image-text shards."""
    root = tmp_path_factory.mktemp("imgtext")
    return (write_image_text_shards(str(root / "train"), n=96, per_shard=32, seed=0),
            write_image_text_shards(str(root / "val"), n=16, per_shard=16, seed=1))
