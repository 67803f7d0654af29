"""Load the models an evaluation runs on: CLIP-like models (diffmm, open_clip) and LMs (+ tokenizer)."""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from diffmm.eval.common import EvalError, resolve_device

OPEN_CLIP_PREFIX = "open_clip:"
_SAVED = ("local-dir:", "hf-hub:")


def load_clip(model: str, pretrained: str | None = None, *, device: str | torch.device | None = None,
              trust_pickle: bool = False, **kwargs: Any) -> tuple[torch.nn.Module, Callable, Callable]:
    """``(model, eval_preprocess, tokenizer)`` for a diffmm or open_clip model, in eval mode.

    Args:
        model: a diffmm config name (``diffmm.list_models()``), a config JSON, ``local-dir:FOLDER`` /
            a diffmm export folder, or ``open_clip:NAME`` (an open_clip architecture; plain open_clip names
            that diffmm does not know also go to open_clip).
        pretrained: weights in any format diffmm loads (or, for open_clip models, what open_clip accepts).
        trust_pickle: allow pickled checkpoints that need full unpickling (official DiffCLIP files).
    """
    device = resolve_device(device)
    import diffmm

    name = model
    if name.startswith(OPEN_CLIP_PREFIX):
        return _load_open_clip(name[len(OPEN_CLIP_PREFIX):], pretrained, device)
    if os.path.isdir(name) and not name.startswith(_SAVED):
        name = "local-dir:" + name
    known = diffmm.list_models()
    if name.startswith(_SAVED) or name.endswith(".json") or name in known:
        try:
            net, _, preprocess = diffmm.create_model_and_transforms(name, pretrained, device=device,
                                                                    trust_pickle=trust_pickle, **kwargs)
        except (FileNotFoundError, KeyError, ValueError, RuntimeError) as e:
            raise EvalError(f"cannot load model {model!r} (pretrained={pretrained!r}): {e}") from None
        ctx = getattr(net, "context_length", None)
        tokenizer = diffmm.get_tokenizer(None, context_length=ctx) if ctx else diffmm.get_tokenizer(None)
        return net.eval(), preprocess, tokenizer
    import open_clip

    if name in open_clip.list_models():
        return _load_open_clip(name, pretrained, device)
    raise EvalError(f"unknown model {model!r}; diffmm models: {', '.join(known)}; or open_clip:NAME, "
                    f"local-dir:FOLDER")


def _load_open_clip(name: str, pretrained: str | None, device: torch.device):
    import open_clip

    try:
        net, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=pretrained, device=device)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        raise EvalError(f"open_clip cannot load {name!r} (pretrained={pretrained!r}): {e}") from None
    return net.eval(), preprocess, open_clip.get_tokenizer(name)


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
