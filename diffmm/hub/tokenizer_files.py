"""An LM's tokenizer from what names or records it: :func:`load_tokenizer_spec` (``clip``, a ``tokenizer.json``,
or a folder of tokenizer files that a model's ``save_pretrained`` wrote) and :func:`recorded_tokenizer` (what a
Lightning checkpoint's hyper-parameters or an LM folder's files name)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from diffmm.data.tokenizers import ClipBPE, TokenizerFile, load_lm_tokenizer
from diffmm.hub.checkpoint import load_state_file
from diffmm.hub.formats import is_lightning
from diffmm.models.clip.tokenizer import CLIP_BPE, CLIP_CAPTION, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE


def load_tokenizer_spec(spec: str | os.PathLike):
    """An LM tokenizer: a folder with ``tokenizer_config.json`` (``ClipBPE`` for ``diffmm_tokenizer: clip-bpe``,
    else a ``TokenizerFile`` of its ``tokenizer.json`` with the eos token it names), else what
    :func:`~diffmm.data.tokenizers.load_lm_tokenizer` reads (``clip``, a tokenizer.json or a folder with one)."""
    config_path = Path(spec) / TOKENIZER_CONFIG_FILE
    if not config_path.is_file():
        return load_lm_tokenizer(str(spec))
    config = json.loads(config_path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    if config.get("diffmm_tokenizer") == CLIP_BPE:
        return ClipBPE()
    if config.get("diffmm_tokenizer") == CLIP_CAPTION:
        raise ValueError(f"{config_path}: a CLIP caption tokenizer (diffmm_tokenizer: clip-caption), not an LM's")
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return TokenizerFile(str(Path(spec) / TOKENIZER_FILE), eos_token=eos)


def recorded_tokenizer(source: str | os.PathLike, *, trust_pickle: bool = False) -> Any:
    """The tokenizer an LM source records, or None: a Lightning checkpoint's ``tokenizer`` hyper-parameter (the LM
    module's, else the data module's), an LM folder's own tokenizer files."""
    if is_lightning(Path(source)):
        ckpt = load_state_file(source, trust_pickle=trust_pickle)
        for where in ("hyper_parameters", "datamodule_hyper_parameters"):
            spec = (ckpt.get(where) or {}).get("tokenizer")
            if spec:
                try:
                    return load_tokenizer_spec(spec)
                except (OSError, ValueError) as e:
                    raise ValueError(f"{source}: the recorded tokenizer ({where}.tokenizer) cannot be read: {e}; "
                                     f"name one (--tokenizer)") from None
        return None
    return load_tokenizer_spec(source) if os.path.isfile(os.path.join(source, TOKENIZER_FILE)) else None
