"""LM tokenizers: the CLIP BPE, a local byte-level BPE or any ``tokenizer.json`` (captions:
``diffmm.models.clip.tokenizer``)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Protocol

from open_clip.tokenizer import SimpleTokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from diffmm.models.clip.tokenizer import (CLIP_BPE, CLIP_CAPTION, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_JSON,
                                         clip_tokenizer_json, write_tokenizer_files)

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


class LMTokenizer(Protocol):
    """What the text pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...


class ClipBPE(SimpleTokenizer):
    """The CLIP BPE (open_clip's) as an LM tokenizer: ``encode`` (no special tokens; lower-cases text, drops some
    whitespace) and ``decode``; eos = ``<end_of_text>``."""

    name = "clip-bpe"

    def __init__(self) -> None:
        super().__init__()
        self.vocab_size = len(self.encoder)
        self.eos_id = self.eot_token_id

    def save_pretrained(self, folder: str | os.PathLike, model_max_length: int | None = None) -> list[Path]:
        """Tokenizer files ``transformers.AutoTokenizer`` loads with these ids (no special tokens added, eos named;
        :func:`~diffmm.models.clip.tokenizer.clip_tokenizer_json` says what of open_clip's cleaning differs)."""
        return write_tokenizer_files(clip_tokenizer_json(self), folder, kind=CLIP_BPE,
                                     eos=self.decoder[self.eos_id], model_max_length=model_max_length)


class TokenizerFile:
    """A HuggingFace ``tokenizers`` ``tokenizer.json``.

    Args:
        path: the ``tokenizer.json`` file.
        eos_token: separator/end-of-document token; default: the first of :data:`EOS_CANDIDATES` present.
    """

    def __init__(self, path: str, eos_token: str | None = None) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        self.path = os.path.abspath(path)
        with open(self.path, "rb") as f:
            self.name = "tokenizer.json:" + hashlib.sha256(f.read()).hexdigest()[:12]
        self._tok = tok = Tokenizer.from_file(self.path)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        candidates = [eos_token] if eos_token else list(EOS_CANDIDATES)
        for cand in candidates:
            idx = tok.token_to_id(cand)
            if idx is not None:
                self.eos_id, self.eos_token = idx, cand
                break
        else:
            raise ValueError(f"{path}: no end-of-document token among {candidates}; pass eos_token=")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        return self._tok.decode(ids)

    def save_pretrained(self, folder: str | os.PathLike, model_max_length: int | None = None) -> list[Path]:
        """Tokenizer files ``transformers.AutoTokenizer`` loads with these ids: this ``tokenizer.json`` without a
        post-processor that adds tokens (``encode`` adds none, and the LM was trained on that), eos named."""
        tok = Tokenizer.from_file(self.path)
        probe = "a b"
        if tok.encode(probe, add_special_tokens=True).ids != tok.encode(probe, add_special_tokens=False).ids:
            tok.post_processor = None
        return write_tokenizer_files(tok, folder, kind=TOKENIZER_JSON, eos=self.eos_token,
                                     model_max_length=model_max_length)


def train_byte_level_bpe(texts: Iterable[str], out_path: str, vocab_size: int = 8192,
                         eos_token: str = "<|endoftext|>", min_frequency: int = 2) -> TokenizerFile:
    """Train a byte-level BPE on ``texts`` with ``tokenizers`` and save it as ``out_path`` (tokenizer.json).

    The vocabulary holds the 256 byte symbols, ``eos_token`` and the learned merges, so any text
    (any UTF-8) encodes without unknown tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[eos_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tok.save(out_path)
    return TokenizerFile(out_path, eos_token=eos_token)


def load_lm_tokenizer(spec: str | os.PathLike) -> LMTokenizer:
    """``"clip"`` -> :class:`ClipBPE`; a path to a ``tokenizer.json`` -> :class:`TokenizerFile`; a folder: the
    tokenizer its ``tokenizer_config.json`` names (what ``save_pretrained`` wrote: ``ClipBPE`` for ``clip-bpe``,
    else its ``tokenizer.json`` with the eos token named there), else its ``tokenizer.json``."""
    spec = str(spec)
    if spec in ("clip", "clip-bpe"):
        return ClipBPE()
    config_path = Path(spec) / TOKENIZER_CONFIG_FILE
    if not config_path.is_file():
        return TokenizerFile(os.path.join(spec, TOKENIZER_FILE) if os.path.isdir(spec) else spec)
    config = json.loads(config_path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    if config.get("diffmm_tokenizer") == CLIP_BPE:
        return ClipBPE()
    if config.get("diffmm_tokenizer") == CLIP_CAPTION:
        raise ValueError(f"{config_path}: a CLIP caption tokenizer (diffmm_tokenizer: clip-caption), not an LM's")
    eos = config.get("eos_token")
    return TokenizerFile(os.path.join(spec, TOKENIZER_FILE), eos_token=eos.get("content") if isinstance(eos, dict)
                         else eos)
