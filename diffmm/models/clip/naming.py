"""The one rule for CLIP model names, shared by ``diffmm.create_model`` and every CLI's ``--model``.

A model is named by one of:

1. a diffmm config name (``diffmm.list_models()``: ``DiffCLIP-ViT-B-16``, ``CLIP-Tiny``, ``OpenCLIP-ViT-B-16``,
   ...) or a path to a model-config ``.json`` file: random weights unless ``pretrained=`` / ``--pretrained``;
2. ``open_clip:NAME``: an open_clip architecture (``open_clip.list_models()``), built as diffmm's ``DiffCLIP`` in
   open_clip's layout when diffmm implements it (plain ViT + text Transformer), else as open_clip's own model;
   random weights unless ``pretrained=`` (a file, or an open_clip tag, which open_clip downloads);
3. ``local-dir:FOLDER`` / ``hf-hub:ORG/REPO``: an open_clip folder or a diffmm export (weights included);
4. a path to weights: a Lightning ``.ckpt`` from ``diffmm fit``, a diffmm export folder, an open_clip file or
   folder, an official DiffCLIP checkpoint (``diffmm.load_pretrained`` reads it; weights included).

Anything else is a one-line error listing these (bare open_clip names such as ``ViT-B-32`` are refused with a
hint to write ``open_clip:ViT-B-32``: diffmm never silently swaps in another library's random model).
"""
from __future__ import annotations

import os
from typing import Optional

OPEN_CLIP_PREFIX = "open_clip:"
SAVED_PREFIXES = ("local-dir:", "hf-hub:")
#: what a name can be, for the one-line error
ACCEPTED = ("a diffmm model name ({names})", "open_clip:NAME (an open_clip architecture)",
            "local-dir:FOLDER or hf-hub:ORG/REPO", "a path to a model-config .json, a Lightning .ckpt from diffmm fit, "
            "a diffmm export folder or a checkpoint file diffmm.load_pretrained reads")
#: file endings that make a name a path even when the file is missing (so the error says "no such file")
PATH_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors", ".json")


class UnknownModelError(ValueError):
    """A model name that matches no rule of this module."""


def model_kind(name: str) -> str:
    """Which rule ``name`` follows: ``'config'``, ``'open_clip'``, ``'saved'`` or ``'path'`` (see module doc).

    Raises:
        FileNotFoundError: a path-like name (with a separator or a checkpoint suffix) that does not exist.
        UnknownModelError: any other name no rule accepts, listing what is accepted.
    """
    from diffmm.models.clip.factory import _config_files

    if not isinstance(name, str) or not name:
        raise UnknownModelError(f"model name {name!r}; expected a non-empty string")
    if name.startswith(OPEN_CLIP_PREFIX):
        return "open_clip"
    if name.startswith(SAVED_PREFIXES):
        return "saved"
    if name in _config_files():
        return "config"
    if os.path.exists(name):
        return "config" if (name.endswith(".json") and os.path.isfile(name)) else "path"
    if name.endswith(PATH_SUFFIXES) or os.sep in name or (os.altsep and os.altsep in name):
        raise FileNotFoundError(f"{name}: no such file or folder (as a model: a model-config .json, a Lightning .ckpt, "
                                f"an export folder or a checkpoint file)")
    raise UnknownModelError(unknown_model_message(name))


def unknown_model_message(name: str) -> str:
    """``unknown model 'X'; accepted: ...`` (with a hint when open_clip knows the name)."""
    from diffmm.models.clip.factory import list_models

    accepted = "; ".join(a.format(names=", ".join(list_models())) for a in ACCEPTED)
    hint = ""
    try:
        import open_clip

        if name in open_clip.list_models():
            hint = f"; did you mean open_clip:{name}?"
    except ImportError:  # pragma: no cover - open_clip is a dependency
        pass
    return f"unknown model {name!r}; accepted: {accepted}{hint}"


def has_weights(name: str, pretrained: Optional[str]) -> bool:
    """Whether the model ``name`` (+ ``pretrained``) comes with trained weights (False: random init)."""
    return bool(pretrained) or model_kind(name) in ("saved", "path")


def random_weights_message(name: str) -> str:
    return (f"model {name!r} has random weights (no --pretrained and not a checkpoint): its results are chance "
            f"level; pass --pretrained FILE or a checkpoint as --model")


# --------------------------------------------------------------------------------------- list_pretrained
#: tag -> what files of that tag are and how to load them (no hub downloads exist for these: local files only)
PRETRAINED_TAGS = {
    "official": "the official DiffCLIP checkpoint (checkpoint_best.pt, SLIP format; trust_pickle=True / "
                "--trust-pickle) or its state dict as .safetensors; loads into DiffCLIP-* configs with ImageNet mean/std and the "
                "official tokenizer truncation",
    "open_clip": "an open_clip ViT CLIP checkpoint (open_clip_model.safetensors / open_clip_pytorch_model.bin, a "
                 "torch.save(model.state_dict()) file, or a folder with open_clip_config.json); loads exactly into "
                 "OpenCLIP-* configs and into open_clip:NAME",
    "timm": "a timm VisionTransformer state dict; fills the image tower (visual) of any config of its shape",
    "diffmm": "diffmm's own weights: a Lightning .ckpt from diffmm fit, a diffmm export folder (diffmm export), or "
              "torch.save(model.state_dict()) of the same config",
}


def _tags_of(config_name: str) -> list[str]:
    if config_name.startswith("OpenCLIP-"):
        return ["open_clip", "timm", "diffmm"]
    if config_name.startswith("DiffCLIP"):
        return ["official", "timm", "diffmm"]
    return ["timm", "diffmm"]


def list_pretrained(as_str: bool = False, open_clip_tags: bool = False) -> list:
    """``(model name, tag)`` pairs of what can be loaded, like ``open_clip.list_pretrained()``.

    diffmm downloads nothing: a tag names a *format* of local files that loads into the model (see
    :data:`PRETRAINED_TAGS` or :func:`describe_pretrained`); pass the file as ``pretrained=PATH`` /
    ``--pretrained PATH``. ``open_clip_tags=True`` adds open_clip's own hub tags as ``('open_clip:NAME', tag)``
    (downloaded by open_clip, so they need the network).

    Args:
        as_str: ``'name:tag'`` strings instead of tuples.
        open_clip_tags: include open_clip's hub tags.
    """
    from diffmm.models.clip.factory import list_models

    pairs = [(name, tag) for name in list_models() for tag in _tags_of(name)]
    if open_clip_tags:
        import open_clip

        pairs += [(OPEN_CLIP_PREFIX + n, t) for n, t in open_clip.list_pretrained()]
    return [f"{n}:{t}" for n, t in pairs] if as_str else pairs


def describe_pretrained() -> dict[str, str]:
    """Tag -> description of the files of that tag."""
    return dict(PRETRAINED_TAGS)

