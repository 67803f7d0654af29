"""Where an LM's tokenizer comes from when none is named: what a Lightning checkpoint records (the LM module's
``tokenizer`` hyper-parameter, else the data module's) or an LM folder's tokenizer files
(:mod:`diffmm.hub.tokenizer_files`). ``diffmm export`` and the LM evaluations resolve tokenizers here."""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from diffmm.data.tokenizers import load_lm_tokenizer
from diffmm.hub.checkpoint import SAFE_GLOBALS, is_lightning_checkpoint, read_lightning
from diffmm.hub.tokenizer_files import CONFIG_FILE, TOKENIZER_FILE, load_folder_tokenizer


def load_tokenizer_spec(spec: str | os.PathLike):
    """An LM tokenizer from a spec: a folder :func:`~diffmm.hub.tokenizer_files.save_tokenizer` wrote (its ``tokenizer_config.json``), else
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
