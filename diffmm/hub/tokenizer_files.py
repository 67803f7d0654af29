"""The tokenizer files of an export folder, so ``transformers.AutoTokenizer.from_pretrained(folder)`` works as is.

:func:`save_tokenizer` writes ``tokenizer.json`` (a ``tokenizers`` pipeline), ``tokenizer_config.json`` and
``special_tokens_map.json`` for the tokenizers diffmm uses:

- :class:`~diffmm.data.tokenizers.ClipBPE` (an LM on the CLIP BPE) and open_clip's ``SimpleTokenizer`` / diffmm's
  caption :class:`~diffmm.models.clip.tokenizer.CLIPTokenizer`: the same vocabulary and merges, open_clip's split
  pattern, byte-level symbols and the ``</w>`` end-of-word suffix. open_clip's cleaning (``ftfy.fix_text``, HTML
  unescaping twice, whitespace collapsing, lower-casing) becomes normalizers: ftfy's context-free fixes (control
  characters, Latin ligatures, character width, curly quotes, NFC), :data:`HTML_ENTITIES` (common named ones,
  numeric ASCII ones), whitespace and lower-casing (with ``str.lower``'s final sigma: a capital sigma after a letter
  and before none). Not reproduced: ftfy's mojibake repair (``fix_encoding``, a heuristic), other entities (non-ASCII
  numeric ones, entities nested three deep, which ftfy's own unescaping reaches when a text has no ``<``). Text
  without those gets open_clip's ids: 510 of the 514 Python 3.11 doc sources (2.9 M tokens) do, the 4 others
  being pages about HTML entities and codecs (tests/hub/test_tokenizer_files.py compares on such documents). An LM
  tokenizer adds no special tokens (as ``ClipBPE.encode``); a caption tokenizer adds ``<start_of_text>`` ...
  ``<end_of_text>`` (as open_clip's ``__call__``, without its padding to the context length).
- :class:`~diffmm.data.tokenizers.TokenizerFile`: its ``tokenizer.json``; a post-processor that adds tokens is
  dropped, because diffmm's ``encode`` (what the LM was trained on) adds none.

``tokenizer_config.json`` names the eos token (lm-eval's ``--model hf`` uses it as end-of-text and as the prefix of
an empty context, as the diffmm adapter does) and no bos token; its ``diffmm_tokenizer`` entry lets
:func:`load_folder_tokenizer` rebuild diffmm's own tokenizer (``ClipBPE`` for ``clip-bpe``, so the exact open_clip
cleaning is used in diffmm). :func:`recorded_tokenizer` finds an LM's tokenizer (a Lightning checkpoint's
hyper-parameter, a folder's files) for exports and evaluations.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any, Optional

import torch
from ftfy import chardata
from open_clip.tokenizer import SimpleTokenizer
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from diffmm.data.tokenizers import ClipBPE, TokenizerFile, load_lm_tokenizer
from diffmm.hub.checkpoint import SAFE_GLOBALS, is_lightning_checkpoint, read_lightning

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
#: ``diffmm_tokenizer`` values of tokenizer_config.json
CLIP_BPE, CLIP_CAPTION, TOKENIZER_JSON = "clip-bpe", "clip-caption", "tokenizer.json"
#: open_clip's word pattern (case-insensitive, as open_clip compiles it) without its special-token alternatives
CLIP_SPLIT = r"""(?i)'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
#: named HTML entities unescaped as open_clip's ``html.unescape`` does (``&amp;`` last, applied twice)
HTML_ENTITIES = {"&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'", "&nbsp;": "\u00a0",
                 **{f"&#{c};": chr(c) for c in range(32, 127) if c != 38},
                 **{f"&#{x}{c:{h}};": chr(c) for c in range(32, 127) if c != 38 for x in "xX" for h in "xX"},
                 "&#38;": "&", "&#x26;": "&", "&#X26;": "&", "&amp;": "&"}


def _clip_normalizer() -> normalizers.Normalizer:
    """open_clip's ``_clean_lower`` as ``tokenizers`` normalizers (see the module docstring for what differs)."""
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
    tok.normalizer = _clip_normalizer()
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


def _without_added_tokens(tok: Tokenizer) -> Tokenizer:
    """``tok`` without a post-processor when it adds tokens (diffmm's ``encode`` adds none)."""
    probe = "a b"
    if tok.encode(probe, add_special_tokens=True).ids != tok.encode(probe, add_special_tokens=False).ids:
        tok.post_processor = None
    return tok


def save_tokenizer(tokenizer, folder: str | os.PathLike, *, model_max_length: Optional[int] = None) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``folder``.

    Args:
        tokenizer: a diffmm LM tokenizer (``ClipBPE``, ``TokenizerFile``), a spec ``load_lm_tokenizer`` reads
            (``clip``, a tokenizer.json), open_clip's ``SimpleTokenizer`` or diffmm's caption ``CLIPTokenizer``.
        folder: the export folder (created when missing).
        model_max_length: the context length recorded for transformers (default: the caption tokenizer's
            context length, else none).
    Returns:
        the written files.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_lm_tokenizer(str(tokenizer))
    if isinstance(tokenizer, ClipBPE):
        tok, kind, eos, bos = clip_tokenizer_json(tokenizer), CLIP_BPE, tokenizer.decoder[tokenizer.eos_id], None
    elif isinstance(getattr(tokenizer, "bpe", None), SimpleTokenizer) or isinstance(tokenizer, SimpleTokenizer):
        bpe = getattr(tokenizer, "bpe", tokenizer)  # diffmm's caption CLIPTokenizer holds open_clip's as .bpe
        tok, kind = clip_tokenizer_json(bpe, add_special_tokens=True), CLIP_CAPTION
        eos, bos = bpe.decoder[bpe.eot_token_id], bpe.decoder[bpe.sot_token_id]
        model_max_length = model_max_length or getattr(tokenizer, "context_length", None)
    elif isinstance(tokenizer, TokenizerFile):
        tok = _without_added_tokens(Tokenizer.from_file(tokenizer.path))
        kind, eos, bos = TOKENIZER_JSON, tokenizer.eos_token, None
    else:
        raise TypeError(f"save_tokenizer: no tokenizer files for {type(tokenizer).__name__}; expected ClipBPE, "
                        f"TokenizerFile, open_clip's SimpleTokenizer or diffmm's CLIPTokenizer")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / TOKENIZER_FILE))
    special = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "clean_up_tokenization_spaces": False,
              "model_max_length": int(model_max_length) if model_max_length else int(1e30),
              "diffmm_tokenizer": kind}
    if kind == CLIP_CAPTION:
        config["pad_token"] = eos  # open_clip pads with 0; transformers needs a named token for padding=True
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (folder / SPECIAL_TOKENS_FILE).write_text(json.dumps(special, indent=2) + "\n")
    return [folder / TOKENIZER_FILE, folder / CONFIG_FILE, folder / SPECIAL_TOKENS_FILE]


def load_folder_tokenizer(folder: str | os.PathLike):
    """diffmm's LM tokenizer of a folder :func:`save_tokenizer` wrote: ``ClipBPE`` for a ``clip-bpe`` folder, else
    a ``TokenizerFile`` of its ``tokenizer.json`` with the eos token its ``tokenizer_config.json`` names."""
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    if config.get("diffmm_tokenizer") == CLIP_BPE:
        return ClipBPE()
    if config.get("diffmm_tokenizer") == CLIP_CAPTION:
        raise ValueError(f"{config_path}: a CLIP caption tokenizer (diffmm_tokenizer: clip-caption), not an LM's")
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return TokenizerFile(str(folder / TOKENIZER_FILE), eos_token=eos)


def folder_eos_id(folder: str | os.PathLike) -> int:
    """The id of the eos token ``tokenizer_config.json`` names, in the folder's ``tokenizer.json``."""
    folder = Path(folder)
    eos = json.loads((folder / CONFIG_FILE).read_text()).get("eos_token")
    idx = Tokenizer.from_file(str(folder / TOKENIZER_FILE)).token_to_id(eos) if isinstance(eos, str) else None
    if idx is None:
        raise ValueError(f"{folder / CONFIG_FILE}: eos_token {eos!r} is not in {folder / TOKENIZER_FILE}")
    return idx


def load_tokenizer_spec(spec: str | os.PathLike):
    """An LM tokenizer from a spec: a folder :func:`save_tokenizer` wrote (its ``tokenizer_config.json``), else
    what :func:`~diffmm.data.tokenizers.load_lm_tokenizer` reads (``clip``, a tokenizer.json or a folder with one)."""
    spec = str(spec)
    if os.path.isfile(os.path.join(spec, CONFIG_FILE)):
        return load_folder_tokenizer(spec)
    return load_lm_tokenizer(spec)


def recorded_tokenizer(source: str | os.PathLike, *, trust_pickle: bool = False) -> Any:
    """The tokenizer an LM source records, or None: a Lightning checkpoint's ``tokenizer`` hyper-parameter (the LM
    module's, else the data module's), an LM folder's own tokenizer files."""
    source = str(source)
    if is_lightning_checkpoint(source):
        ckpt = _read_checkpoint(source, trust_pickle)
        for where in ("hyper_parameters", "datamodule_hyper_parameters"):
            spec = (ckpt.get(where) or {}).get("tokenizer")
            if spec:
                try:
                    return load_tokenizer_spec(spec)
                except (OSError, ValueError) as e:
                    raise ValueError(f"{source}: the recorded tokenizer ({where}.tokenizer) cannot be read: {e}; "
                                     f"name one (--tokenizer)") from None
        return None
    if os.path.isfile(os.path.join(source, TOKENIZER_FILE)):
        return load_tokenizer_spec(source)
    return None


def _read_checkpoint(path: str, trust_pickle: bool) -> dict:
    """A Lightning checkpoint's dict, memory-mapped (the tensors stay on disk) when the file allows it."""
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=not trust_pickle)
    except (RuntimeError, ValueError, pickle.UnpicklingError):  # an old (non-zip) file, or one that needs
        # trust_pickle: read it as the loader does, with its one-line errors
        return read_lightning(path, trust_pickle=trust_pickle)[2]
