"""The CLIP BPE tokenizer with the model's truncation rule (``text_cfg.truncate``).

open_clip's ``SimpleTokenizer`` cuts a caption longer than the context and puts the end-of-text token last
(``'eot'``). The official DiffCLIP code (github hammoudhasan/DiffCLIP, whose tokenizer is SLIP's) keeps the first
``context_length`` tokens as they are (``'cut'``): a long caption then has no EOT, and EOT pooling (the argmax of
the ids) takes the largest id of what remains. Everything else (byte-level BPE, lower-casing, whitespace cleaning)
is the same: both are open_clip's BPE.

:func:`clip_tokenizer_json` is the same tokenizer as a Hugging Face ``tokenizers`` pipeline: the folder that
``CLIPTokenizer.save_pretrained`` writes (and ``DiffCLIP.save_pretrained`` with it) loads with
``transformers.AutoTokenizer``; ``ClipBPE`` (the CLIP BPE of LMs) uses it too.

open_clip (and ftfy, which comes with it) is imported when a tokenizer is built, not when this module is:
``import diffmm`` works without open_clip (the GPU check machine has none; ``tests/scripts/test_gpu_check.py``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from diffmm.models.clip.config import TRUNCATE_MODES

#: tokenizer files of a folder (``transformers.AutoTokenizer`` reads them)
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE = "tokenizer.json", "tokenizer_config.json", \
    "special_tokens_map.json"
#: ``diffmm_tokenizer`` values of tokenizer_config.json: which diffmm tokenizer the files hold
CLIP_BPE, CLIP_CAPTION, TOKENIZER_JSON = "clip-bpe", "clip-caption", "tokenizer.json"


#: open_clip's word pattern (case-insensitive, as open_clip compiles it) without its special-token alternatives
CLIP_SPLIT = r"""(?i)'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
#: named HTML entities unescaped as open_clip's ``html.unescape`` does (``&amp;`` last, applied twice)
HTML_ENTITIES = {"&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'", "&nbsp;": "\u00a0",
                 **{f"&#{c};": chr(c) for c in range(32, 127) if c != 38},
                 **{f"&#{x}{c:{h}};": chr(c) for c in range(32, 127) if c != 38 for x in "xX" for h in "xX"},
                 "&#38;": "&", "&#x26;": "&", "&#X26;": "&", "&amp;": "&"}


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

    def save_pretrained(self, folder: Union[str, os.PathLike], model_max_length: Optional[int] = None) -> list[Path]:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json`` that
        ``transformers.AutoTokenizer`` loads: ``<start_of_text> ... <end_of_text>`` around a caption, padding with the
        EOT (``padding="max_length", truncation=True`` gives these ids up to the EOT; open_clip pads with 0, which
        is ``'!'`` and cannot be named as a pad token), ``model_max_length`` = the context length. Captions longer
        than the context keep their EOT last there (``'eot'``), also for a ``'cut'`` tokenizer."""
        bos, eos = self.bpe.decoder[self.sot_token_id], self.bpe.decoder[self.eot_token_id]
        tok = clip_tokenizer_json(self.bpe, add_special_tokens=True)
        return write_tokenizer_files(tok, folder, kind=CLIP_CAPTION, eos=eos, bos=bos, pad=eos,
                                     model_max_length=model_max_length or self.context_length)


def clip_normalizer() -> normalizers.Normalizer:
    """open_clip's cleaning (``ftfy.fix_text``, HTML unescaping twice, whitespace collapsing, lower-casing) as
    ``tokenizers`` normalizers: ftfy's context-free fixes (control characters, Latin ligatures, character width,
    curly quotes, NFC), :data:`HTML_ENTITIES` (common named ones, numeric ASCII ones), whitespace and lower-casing
    (with ``str.lower``'s final sigma: a capital sigma after a letter and before none).

    Not reproduced: ftfy's mojibake repair (``fix_encoding``, a heuristic) and other entities (non-ASCII numeric
    ones, entities nested three deep); text without those gets open_clip's ids (``tests/data/test_tokenizer_files.py``
    compares on real documents).
    """
    from ftfy import chardata  # comes with open_clip (imported when used, as open_clip is)

    # ftfy's tables (ftfy comes with open_clip): control characters, Latin ligatures, width forms, curly quotes
    control_class = "".join(f"\\x{{{c:x}}}" for c in sorted(chardata.CONTROL_CHARS))
    steps = [normalizers.Replace(Regex(f"[{control_class}]"), "")]
    steps += [normalizers.Replace(chr(c), s) for c, s in sorted(chardata.LIGATURES.items())]
    steps += [normalizers.Replace(chr(c), s) for c, s in sorted(chardata.WIDTH_MAP.items())]
    steps += [normalizers.Replace(Regex(chardata.SINGLE_QUOTE_RE.pattern), "'"),
              normalizers.Replace(Regex(chardata.DOUBLE_QUOTE_RE.pattern), '"'), normalizers.NFC()]
    for _ in range(2):  # html.unescape(html.unescape(text))
        steps += [normalizers.Replace(k, v) for k, v in HTML_ENTITIES.items()]
    steps += [normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip(),
              normalizers.Replace(Regex(r"(?<=\p{L})Σ(?!\p{L})"), "ς"),  # str.lower's final sigma
              normalizers.Lowercase()]
    return normalizers.Sequence(steps)


def clip_tokenizer_json(bpe, *, add_special_tokens: bool = False) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` with the ids of open_clip's ``SimpleTokenizer`` ``bpe`` (``ClipBPE`` included).

    Args:
        bpe: the open_clip tokenizer (its ``encoder`` vocabulary and ``bpe_ranks`` merges).
        add_special_tokens: add ``<start_of_text>`` / ``<end_of_text>`` around a text (captions); off for LMs.
    """
    merges = [pair for pair, _ in sorted(bpe.bpe_ranks.items(), key=lambda kv: kv[1])]
    tok = Tokenizer(models.BPE(vocab=dict(bpe.encoder), merges=merges, end_of_word_suffix="</w>"))
    specials = [bpe.decoder[i] for i in bpe.all_special_ids]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.normalizer = clip_normalizer()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("</w>", " ")])
    if add_special_tokens:
        sot, eot = bpe.decoder[bpe.sot_token_id], bpe.decoder[bpe.eot_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{sot} $A {eot}", pair=f"{sot} $A {eot} $B:1 {eot}:1",
            special_tokens=[(sot, bpe.sot_token_id), (eot, bpe.eot_token_id)])
    return tok


def write_tokenizer_files(tok: Tokenizer, folder: Union[str, os.PathLike], *, kind: str, eos: str,
                          bos: Optional[str] = None, pad: Optional[str] = None,
                          model_max_length: Optional[int] = None) -> list[Path]:
    """Write a ``tokenizers`` pipeline as ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``
    (``transformers.AutoTokenizer`` loads them as a fast tokenizer); returns the files.

    Args:
        tok: the pipeline.
        kind: the ``diffmm_tokenizer`` entry (:data:`CLIP_BPE`, :data:`CLIP_CAPTION`, :data:`TOKENIZER_JSON`).
        eos / bos / pad: the special tokens transformers should name (no bos: none is added).
        model_max_length: the context length recorded for transformers (None: unlimited).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / TOKENIZER_FILE))
    special = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "clean_up_tokenization_spaces": False,
              "model_max_length": int(model_max_length) if model_max_length else int(1e30), "diffmm_tokenizer": kind}
    if pad:
        config["pad_token"] = pad
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (folder / SPECIAL_TOKENS_FILE).write_text(json.dumps(special, indent=2) + "\n")
    return [folder / TOKENIZER_FILE, folder / TOKENIZER_CONFIG_FILE, folder / SPECIAL_TOKENS_FILE]
