"""The tokenizer files of an export folder, so ``transformers.AutoTokenizer.from_pretrained(folder)`` works as is.

:func:`save_tokenizer` writes ``tokenizer.json`` (a ``tokenizers`` pipeline), ``tokenizer_config.json`` and
``special_tokens_map.json`` for the tokenizers diffmm uses, each of which writes itself (``save_pretrained``, the same
files that ``DiffLM`` / ``DiffCLIP.save_pretrained(folder, tokenizer=...)`` put in a folder):

- :class:`~diffmm.data.tokenizers.ClipBPE` (an LM on the CLIP BPE) and open_clip's ``SimpleTokenizer`` / diffmm's
  caption :class:`~diffmm.models.clip.tokenizer.CLIPTokenizer`: the same vocabulary and merges, open_clip's split
  pattern, byte-level symbols and the ``</w>`` end-of-word suffix
  (:func:`~diffmm.models.clip.tokenizer.clip_tokenizer_json`). open_clip's cleaning becomes normalizers
  (:func:`~diffmm.models.clip.tokenizer.clip_normalizer` says what is not reproduced: ftfy's mojibake repair, rare
  entities). Text without those gets open_clip's ids: 510 of the 514 Python 3.11 doc sources (2.9 M tokens) do, the
  4 others being pages about HTML entities and codecs (tests/hub/test_tokenizer_files.py compares on such
  documents). An LM tokenizer adds no special tokens (as ``ClipBPE.encode``); a caption tokenizer adds
  ``<start_of_text>`` ... ``<end_of_text>`` (as open_clip's ``__call__``, without its padding to the context length).
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
from open_clip.tokenizer import SimpleTokenizer

from diffmm.data.tokenizers import ClipBPE, TokenizerFile, load_lm_tokenizer
from diffmm.hub.checkpoint import SAFE_GLOBALS, load_state_file
from diffmm.hub.formats import is_lightning
from diffmm.models.clip.tokenizer import CLIPTokenizer, clip_tokenizer_json
from diffmm.models.hub_mixin import (CLIP_BPE, CLIP_CAPTION, SPECIAL_TOKENS_FILE, TOKENIZER_FILE,  # noqa: F401
                                     TOKENIZER_JSON, write_tokenizer_files)
from diffmm.models.hub_mixin import TOKENIZER_CONFIG_FILE as CONFIG_FILE


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
    if isinstance(tokenizer, (ClipBPE, TokenizerFile, CLIPTokenizer)):
        return tokenizer.save_pretrained(folder, model_max_length=model_max_length)
    if isinstance(tokenizer, SimpleTokenizer):  # open_clip's own caption tokenizer
        eos, bos = tokenizer.decoder[tokenizer.eot_token_id], tokenizer.decoder[tokenizer.sot_token_id]
        return write_tokenizer_files(clip_tokenizer_json(tokenizer, add_special_tokens=True), folder,
                                     kind=CLIP_CAPTION, eos=eos, bos=bos, pad=eos,
                                     model_max_length=model_max_length or tokenizer.context_length)
    raise TypeError(f"save_tokenizer: no tokenizer files for {type(tokenizer).__name__}; expected ClipBPE, "
                    f"TokenizerFile, open_clip's SimpleTokenizer or diffmm's CLIPTokenizer")


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
    if is_lightning(Path(source)):
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
        return load_state_file(path, trust_pickle=trust_pickle)
