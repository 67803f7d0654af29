"""``diffmm export``: write an export folder (``config.json`` + ``model.safetensors``) from any checkpoint: diffmm's
own format, or for an LM with differential attention the Hugging Face DiffLlama format (``--format difflama``).
An LM's folder also holds its tokenizer files.

Examples::

    diffmm export runs/diffclip-tiny-emoji/checkpoints/last.ckpt exports/diffclip-tiny
    diffmm export runs/lm/checkpoints/last.ckpt exports/lm-difflama --format difflama
    diffmm export checkpoint_best.pt exports/diffclip-b16 --trust_pickle true
    diffmm export OpenCLIP-ViT-B-16 exports/openclip-b16 --pretrained open_clip_model.safetensors
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal, Optional

import torch

from diffmm.data.tokenizers import load_lm_tokenizer
from diffmm.hub.checkpoint import load_state_file
from diffmm.hub.difflama import save_difflama
from diffmm.hub.factory import create_model, has_weights, load_pretrained, random_weights_message
from diffmm.hub.formats import is_lightning
from diffmm.models.clip.tokenizer import TOKENIZER_FILE
from diffmm.models.hub_mixin import DiffmmHubMixin
from diffmm.models.lm import DiffLM

log = logging.getLogger("diffmm.hub")


def export(checkpoint: str, out: str, *, format: Literal["diffmm", "difflama"] = "diffmm",
           tokenizer: Optional[str] = None, pretrained: Optional[str] = None,
           kind: Optional[Literal["clip", "lm"]] = None, model: Optional[str] = None,
           model_config: Optional[str] = None, prefix: str = "model.",
           dtype: Optional[Literal["fp32", "fp16", "bf16"]] = None, trust_pickle: bool = False) -> Path:
    """Write an export folder (config.json + model.safetensors, and an LM's tokenizer files) from a checkpoint.

    A Lightning checkpoint's model is rebuilt from the model record it holds (or ``model`` / ``model_config``)
    and its ``model.*`` weights are loaded strictly. An LM's tokenizer: ``tokenizer``, else the one the checkpoint
    records (the LM module's ``tokenizer`` hyper-parameter, else the data module's), else an LM folder's own
    tokenizer files; without one the folder has no tokenizer files (a warning says so).

    Args:
        checkpoint: a Lightning .ckpt from diffmm fit, any checkpoint diffmm.load_pretrained reads (official
            DiffCLIP with trust_pickle, open_clip files, local-dir: folders, ...), or a model name
            (diffmm.create_model's rule) with pretrained weights (without them: random weights, and a warning).
        out: the export folder to write.
        format: diffmm (diffmm.load_pretrained reads it) or difflama (transformers' DiffLlamaForCausalLM, for an
            LM with differential attention and depth lambda_init; diffmm.load_pretrained reads it too).
        tokenizer: an LM's tokenizer: clip or a tokenizer.json (default: the one the checkpoint records).
        pretrained: weights for a model name given as checkpoint (any format diffmm loads).
        kind: the model kind of a Lightning checkpoint (default: told by its keys).
        model: the model config name of a Lightning checkpoint (default: its model_name).
        model_config: a JSON model config file for a Lightning checkpoint (overrides model).
        prefix: the prefix of the model's keys in a Lightning state dict.
        dtype: cast the weights before writing.
        trust_pickle: allow checkpoints that need full unpickling (only for files you trust).
    """
    if model or model_config or kind or prefix != "model.":  # options of a Lightning checkpoint
        if not is_lightning(Path(checkpoint)):
            raise ValueError(f"{checkpoint}: --model / --model_config choose the architecture of a Lightning "
                             f"checkpoint (--kind, --prefix read it); this is not one")
        net = load_pretrained(checkpoint, format="lightning", kind=kind, prefix=prefix, model_name=model,
                              model_config=model_config, trust_pickle=trust_pickle)
    else:  # a checkpoint, or a model name (diffmm.create_model's rule) with weights from pretrained or none
        net = create_model(checkpoint, pretrained, trust_pickle=trust_pickle)
        if not has_weights(checkpoint, pretrained):
            log.warning(random_weights_message(checkpoint))
    if dtype:
        net = net.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    tok = None
    if isinstance(net, DiffLM):
        tok = load_lm_tokenizer(tokenizer) if tokenizer else recorded_tokenizer(checkpoint, trust_pickle=trust_pickle)
    if tokenizer is not None and not isinstance(net, DiffLM):
        raise ValueError(f"{checkpoint}: --tokenizer is for LMs; this is a {type(net).__name__}")
    if tok is not None and tok.vocab_size > net.config.vocab_size:
        raise ValueError(f"{checkpoint}: the tokenizer has {tok.vocab_size} tokens, more than the model's vocab_size "
                         f"{net.config.vocab_size} (--tokenizer names another one)")
    if isinstance(net, DiffLM) and tok is None:
        log.warning("%s: no tokenizer recorded; the export has no tokenizer files (pass --tokenizer clip or a "
                    "tokenizer.json)", checkpoint)
    if format not in ("diffmm", "difflama"):
        raise ValueError(f"format {format!r}; expected diffmm or difflama")
    if not isinstance(net, DiffLM if format == "difflama" else DiffmmHubMixin):
        what = "LMs" if format == "difflama" else "DiffLM and DiffCLIP models"
        raise ValueError(f"{checkpoint}: --format {format} holds {what}; this is a {type(net).__name__}")
    if format == "difflama":
        folder = save_difflama(net, out, tokenizer=tok)
    else:
        net.save_pretrained(out, tokenizer=tok)  # the export folder, tokenizer included (a DiffCLIP: its own)
        folder = Path(out)
    print(f"wrote {folder}")
    return folder


def recorded_tokenizer(source: str | os.PathLike, *, trust_pickle: bool = False) -> Any:
    """The tokenizer an LM source records, or None: a Lightning checkpoint's ``tokenizer`` hyper-parameter (the LM
    module's, else the data module's), an LM folder's own tokenizer files."""
    if is_lightning(Path(source)):
        ckpt = load_state_file(source, trust_pickle=trust_pickle)
        for where in ("hyper_parameters", "datamodule_hyper_parameters"):
            spec = (ckpt.get(where) or {}).get("tokenizer")
            if spec:
                try:
                    return load_lm_tokenizer(spec)
                except (OSError, ValueError) as e:
                    raise ValueError(f"{source}: the recorded tokenizer ({where}.tokenizer) cannot be read: {e}; "
                                     f"name one (--tokenizer)") from None
        return None
    return load_lm_tokenizer(source) if os.path.isfile(os.path.join(source, TOKENIZER_FILE)) else None
