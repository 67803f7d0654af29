"""The CLIP BPE tokenizer with the model's truncation rule (``text_cfg.truncate``).

open_clip's ``SimpleTokenizer`` cuts a caption longer than the context and puts the end-of-text token last
(``'eot'``). The official DiffCLIP code (github hammoudhasan/DiffCLIP, whose tokenizer is SLIP's) keeps the first
``context_length`` tokens as they are (``'cut'``): a long caption then has no EOT, and EOT pooling (the argmax of
the ids) takes the largest id of what remains. Everything else (byte-level BPE, lower-casing, whitespace cleaning)
is the same: both are open_clip's BPE.

open_clip is imported when a tokenizer is built, not when this module is: ``import diffmm`` works without open_clip
(the GPU check machine has none; ``tests/scripts/test_gpu_check.py``).
"""
from __future__ import annotations

from typing import Union

import torch

from diffmm.models.clip.config import TRUNCATE_MODES


class CLIPTokenizer:
    """``tokenizer(list_of_str) -> LongTensor (B, context_length)`` with ``truncate`` ``'eot'`` or ``'cut'``.

    Args:
        context_length: positions of the text tower.
        truncate: see the module docstring.
    """

    def __init__(self, context_length: int = 77, truncate: str = "eot") -> None:
        from open_clip.tokenizer import SimpleTokenizer

        if truncate not in TRUNCATE_MODES:
            raise ValueError(f"truncate {truncate!r}; expected one of {', '.join(TRUNCATE_MODES)}")
        self.bpe = SimpleTokenizer(context_length=context_length)
        self.context_length, self.truncate = context_length, truncate
        self.sot_token_id, self.eot_token_id = self.bpe.sot_token_id, self.bpe.eot_token_id

    def encode(self, text: str) -> list[int]:
        """BPE ids of ``text`` without start/end tokens."""
        return self.bpe.encode(text)

    def decode(self, ids) -> str:
        return self.bpe.decode(ids)

    def __call__(self, texts: Union[str, list[str]], context_length: int | None = None) -> torch.LongTensor:
        if self.truncate == "eot":
            return self.bpe(texts, context_length)
        texts = [texts] if isinstance(texts, str) else list(texts)
        n = context_length or self.context_length
        result = torch.zeros(len(texts), n, dtype=torch.long)
        for i, text in enumerate(texts):
            tokens = ([self.sot_token_id] + self.encode(text) + [self.eot_token_id])[:n]  # no EOT forced at the end
            result[i, :len(tokens)] = torch.tensor(tokens)
        return result
