"""Load the models an evaluation runs on: CLIP-like models (diffmm, open_clip) and LMs (+ tokenizer)."""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

from diffmm.eval.common import EvalError, resolve_device

log = logging.getLogger("diffmm.eval")


def load_clip(model: str, pretrained: str | None = None, *, device: str | torch.device | None = None,
              trust_pickle: bool = False, warn_random: bool = True,
              **kwargs: Any) -> tuple[torch.nn.Module, Callable, Callable]:
    """``(model, eval_preprocess, tokenizer)`` of a CLIP-like model, in eval mode: the one model resolution of
    ``diffmm eval``, ``diffmm classify`` and ``diffmm export`` (``diffmm.create_model``'s rule for names).

    Args:
        model: a diffmm config name (``diffmm.list_models()``) or config JSON; ``open_clip:NAME``;
            ``local-dir:FOLDER`` / ``hf-hub:ORG/REPO``; or a path to weights: a Lightning ``.ckpt`` from
            ``diffmm fit``, a diffmm export folder, an open_clip / official DiffCLIP checkpoint file.
        pretrained: weights for a config name or ``open_clip:NAME`` (any format diffmm loads; for open_clip names
            also an open_clip tag).
        trust_pickle: allow pickled checkpoints that need full unpickling (official DiffCLIP files).
        warn_random: log a warning when the model has random weights (no ``pretrained``, not a checkpoint).

    The preprocessing (image size, mean/std) and the tokenizer (context length, truncation) are the model's own
    (its config: e.g. ImageNet mean/std and the official truncation for official DiffCLIP checkpoints).
    """
    import diffmm
    from diffmm.models.clip.preprocess import tokenizer_for
    from diffmm.hub.factory import UnknownModelError, has_weights, random_weights_message

    device = resolve_device(device)
    try:
        random = not has_weights(model, pretrained)
        net, _, preprocess = diffmm.create_model_and_transforms(model, pretrained, device=device,
                                                                trust_pickle=trust_pickle, **kwargs)
    except UnknownModelError as e:
        raise EvalError(str(e)) from None
    except PermissionError as e:
        raise EvalError(f"cannot load model {model!r}: {e}") from None
    except (FileNotFoundError, KeyError, ValueError, RuntimeError, TypeError, ConnectionError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise EvalError(f"cannot load model {model!r} (pretrained={pretrained!r}): {msg}") from None
    if random and warn_random:
        log.warning(random_weights_message(model))
    if not (callable(getattr(net, "encode_image", None)) and callable(getattr(net, "encode_text", None))):
        raise EvalError(f"{model!r} builds a {type(net).__name__}, not a CLIP model (no encode_image / encode_text)")
    return net.eval(), preprocess, tokenizer_for(net)


def load_lm(path: str, tokenizer: str | None = None, *, device: str | torch.device | None = None,
            trust_pickle: bool = False) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` for an LM saved in a format ``diffmm.load_pretrained`` knows.

    Args:
        path: a diffmm export folder or a HF DiffLlama folder.
        tokenizer: ``clip``, a ``tokenizer.json`` (or a folder with one); default: ``PATH/tokenizer.json``
            if present, else the CLIP BPE.
    """
    from diffmm.data.tokenizers import load_lm_tokenizer
    from diffmm.hub import load_pretrained

    device = resolve_device(device)
    try:
        model = load_pretrained(path, trust_pickle=trust_pickle) if trust_pickle else load_pretrained(path)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise EvalError(f"cannot load LM {path!r}: {e}") from None
    if tokenizer is None:
        tokenizer = path if os.path.isfile(os.path.join(path, "tokenizer.json")) else "clip"
    try:
        tok = load_lm_tokenizer(tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise EvalError(f"tokenizer {tokenizer!r}: {e}") from None
    return model.to(device).eval(), tok
