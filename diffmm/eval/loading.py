"""What an evaluation runs on, loaded through the one factory (:mod:`diffmm.hub.factory`): a CLIP-like model with
its own preprocessing and tokenizer, or an LM and its tokenizer."""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from diffmm.data.tokenizers import LMTokenizer, load_lm_tokenizer
from diffmm.eval.common import EvalError, resolve_device
from diffmm.hub.factory import create_model, has_weights, random_weights_message
from diffmm.hub.export import recorded_tokenizer
from diffmm.models.clip.preprocess import tokenizer_for, transforms_for
from diffmm.models.lm import DiffLM

log = logging.getLogger("diffmm.eval")


def load_clip(model: str, pretrained: Optional[str] = None, *, device: str | torch.device | None = "auto",
              trust_pickle: bool = False, seed: int = 0,
              **overrides: Any) -> tuple[torch.nn.Module, Callable, Callable]:
    """``(model, eval_preprocess, tokenizer)`` of a CLIP-like model in eval mode (``diffmm.create_model``'s rule
    for names); the preprocessing and tokenizer are the model's own (``transforms_for`` / ``tokenizer_for``).

    Args:
        model: a diffmm config name or config JSON, ``open_clip:NAME``, ``local-dir:FOLDER`` / ``hf-hub:ORG/REPO``,
            or a path to weights (a Lightning ``.ckpt`` from ``diffmm fit``, an export folder, an open_clip or
            official DiffCLIP checkpoint).
        pretrained: weights for a config name or ``open_clip:NAME`` (without them: random weights and a warning).
        device: ``cpu``, ``cuda``, ``cuda:1`` or ``auto``.
        trust_pickle: allow pickled checkpoints that need full unpickling (official DiffCLIP files).
        seed: torch seed before the model is built (random-weight runs).
        overrides: config fields for ``diffmm.create_model`` (e.g. a smaller ``vision_cfg``).
    """
    torch.manual_seed(seed)
    if not has_weights(model, pretrained):
        log.warning(random_weights_message(model))
    net = create_model(model, pretrained, device=resolve_device(device), trust_pickle=trust_pickle, **overrides)
    if not (callable(getattr(net, "encode_image", None)) and callable(getattr(net, "encode_text", None))):
        raise EvalError(f"{model!r} builds a {type(net).__name__}, not a CLIP model (no encode_image / encode_text)")
    return net.eval(), transforms_for(net)[1], tokenizer_for(net)


def load_lm(lm: str, *, vocab_size: Optional[int] = None, block_size: Optional[int] = None,
            device: str | torch.device | None = "auto", trust_pickle: bool = False, seed: int = 0) -> torch.nn.Module:
    """An LM in eval mode (``diffmm.create_model``'s rule): a checkpoint (a Lightning ``.ckpt`` of ``diffmm fit``,
    a diffmm export or a DiffLlama folder), or an LM config name: random weights (seeded with ``seed``) with
    ``vocab_size`` and ``block_size`` (when given) overridden. ``config:NAME`` (the earlier spelling) still works."""
    if lm.startswith("config:"):
        log.warning("--lm %s: the config: prefix is no longer needed (--lm %s)", lm, lm[len("config:"):])
        lm = lm[len("config:"):]
    torch.manual_seed(seed)
    sizes = {k: v for k, v in {"vocab_size": vocab_size, "block_size": block_size}.items() if v}
    model = create_model(lm, trust_pickle=trust_pickle, **(sizes if not has_weights(lm, None) else {}))
    if not isinstance(model, DiffLM):
        raise EvalError(f"{lm!r} builds a {type(model).__name__}, not an LM")
    return model.to(resolve_device(device)).eval()


def lm_tokenizer(lm: str, tokenizer: Optional[str] = None) -> LMTokenizer:
    """The tokenizer ``tokenizer`` names (``clip``, a ``tokenizer.json`` or a folder holding one); by default the one
    the LM records (a Lightning checkpoint's ``tokenizer`` hyper-parameter, an LM folder's tokenizer files:
    :func:`~diffmm.hub.export.recorded_tokenizer`), else the CLIP BPE."""
    if tokenizer is not None:
        return load_lm_tokenizer(tokenizer)
    recorded = recorded_tokenizer(lm)
    return load_lm_tokenizer("clip") if recorded is None else recorded
