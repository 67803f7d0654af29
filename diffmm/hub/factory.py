"""The one factory of model names and weights, with open_clip's API where it overlaps: :func:`create_model`,
:func:`create_model_and_transforms`, :func:`get_tokenizer`, :func:`load_pretrained`, :func:`list_pretrained`.

A model is named by one of (:func:`model_kind`; every API and CLI reads names through it; the table with what each
builds: docs/models.md, "Model names: one rule everywhere"):

1. a diffmm CLIP or LM config name, or a model-config ``.json`` path: random weights unless ``pretrained=``;
2. ``open_clip:NAME``: diffmm's ``DiffCLIP`` in open_clip's layout when diffmm implements it, else open_clip's model;
3. ``local-dir:FOLDER`` / ``hf-hub:ORG/REPO``: an open_clip folder or a diffmm export (Hub: cached or downloaded);
4. a path to weights in any format of :data:`diffmm.hub.formats.FORMATS` (weights included).

Anything else is a one-line error listing these (a bare open_clip name gets a hint to write ``open_clip:NAME``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import huggingface_hub
import torch
import torch.nn as nn

from diffmm.hub.clip_convert import TAGS, tags_of
from diffmm.hub.dinov2_onnx import init_pretrained_vision
from diffmm.hub.formats import Weights, read_weights
from diffmm.hub.open_clip_models import create_native, diffclip_config, download_tag
from diffmm.hub.precision import check_precision, set_precision
from diffmm.models.clip.config import CLIPConfig, UnknownModelError, get_model_config, list_models
from diffmm.models.clip.hf_text import HFTokenizer
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.clip.preprocess import tokenizer_for, transforms_for
from diffmm.models.clip.tokenizer import CLIPTokenizer
from diffmm.models.clip.vision import VisionTransformer
from diffmm.models.hub_mixin import DiffmmHubMixin
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.models.lm_configs import LM_CONFIGS
from diffmm.models.swap import swap_attention
from diffmm.models.weights import load_strict

log = logging.getLogger("diffmm.hub")

OPEN_CLIP_PREFIX, LOCAL_DIR, HF_HUB = "open_clip:", "local-dir:", "hf-hub:"
#: file endings that make a name a path even when the file is missing (so the error says "no such file")
PATH_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors", ".json")


# ------------------------------------------------------------------------------------------------ names
def model_kind(name: str) -> str:
    """Which rule ``name`` follows: ``'config'``, ``'lm'``, ``'open_clip'``, ``'saved'`` or ``'path'``.

    Raises:
        FileNotFoundError: a path-like name (with a separator or a checkpoint suffix) that does not exist.
        UnknownModelError: any other name no rule accepts, listing what is accepted.
    """
    if not isinstance(name, str) or not name:
        raise UnknownModelError(f"model name {name!r}; expected a non-empty string")
    if name.startswith(OPEN_CLIP_PREFIX):
        return "open_clip"
    if name.startswith((LOCAL_DIR, HF_HUB)):
        return "saved"
    if name in list_models():
        return "config"
    if name in LM_CONFIGS:
        return "lm"
    if os.path.exists(name):
        return "config" if (name.endswith(".json") and os.path.isfile(name)) else "path"
    if name.endswith(PATH_SUFFIXES) or os.sep in name or (os.altsep and os.altsep in name):
        raise FileNotFoundError(f"{name}: no such file or folder (as a model: a model-config .json, a Lightning .ckpt, "
                                f"an export folder or a checkpoint file)")
    try:
        import open_clip  # for the hint only (``import diffmm`` works without open_clip)

        hint = f"; did you mean open_clip:{name}?" if name in open_clip.list_models() else ""
    except ImportError:
        hint = ""
    raise UnknownModelError(f"unknown model {name!r}; accepted: a diffmm CLIP model name ({', '.join(list_models())}); "
                            f"an LM config name ({', '.join(LM_CONFIGS)}); open_clip:NAME (an open_clip architecture); "
                            f"local-dir:FOLDER or hf-hub:ORG/REPO; a path to a model-config .json, a Lightning .ckpt "
                            f"from diffmm fit, an export folder or another checkpoint diffmm.load_pretrained "
                            f"reads{hint}")


def has_weights(name: str, pretrained: Optional[str]) -> bool:
    """Whether the model ``name`` (+ ``pretrained``) comes with trained weights (False: random init)."""
    return bool(pretrained) or model_kind(name) in ("saved", "path")


def random_weights_message(name: str) -> str:
    return (f"model {name!r} has random weights (no --pretrained and not a checkpoint): its results are chance "
            f"level; pass --pretrained FILE or a checkpoint as --model")


def resolve_location(name: Union[str, os.PathLike]) -> Path:
    """A file or folder path, ``local-dir:PATH`` or ``hf-hub:ORG/REPO`` -> an existing local path. A Hub repository
    comes from the local Hugging Face cache, else is downloaded (not with ``HF_HUB_OFFLINE=1``)."""
    s = str(name)
    if s.startswith(HF_HUB):
        repo, patterns = s[len(HF_HUB):], ["*.json", "*.safetensors", "*.bin", "*.txt"]
        try:
            return Path(huggingface_hub.snapshot_download(repo, local_files_only=True))  # cached: no network
        except Exception:
            pass
        try:
            return Path(huggingface_hub.snapshot_download(repo, allow_patterns=patterns))
        except Exception as e:  # no network (or HF_HUB_OFFLINE), no such repository, ...
            raise ConnectionError(f"{s}: not in the local Hugging Face cache and could not be downloaded "
                                  f"({type(e).__name__}); download the folder elsewhere and load it with "
                                  f"local-dir:PATH") from None
    p = Path(s[len(LOCAL_DIR):] if s.startswith(LOCAL_DIR) else s)
    if not p.exists():
        raise FileNotFoundError(f"{s}: no such file or folder")
    return p


def list_pretrained(as_str: bool = False, open_clip_tags: bool = False) -> list:
    """``(model name, tag)`` pairs of what can be loaded, like ``open_clip.list_pretrained()``. A tag names a
    format of local files that loads into the model (:data:`diffmm.hub.clip_convert.TAGS`): pass the file as
    ``pretrained=PATH``. ``open_clip_tags``: add open_clip's own tags as ``('open_clip:NAME', tag)`` (open_clip
    downloads those)."""
    pairs = [(name, tag) for name in list_models() for tag in tags_of(name)]
    if open_clip_tags:
        import open_clip  # only for open_clip's tags

        pairs += [(OPEN_CLIP_PREFIX + n, t) for n, t in open_clip.list_pretrained()]
    return [f"{n}:{t}" for n, t in pairs] if as_str else pairs


def _check_pretrained_file(model_name: str, pretrained: str) -> None:
    """A one-line ``FileNotFoundError`` when ``pretrained`` is no local file, folder or Hub name: a tag says which
    files it means; any other word lists the model's tags."""
    if pretrained.startswith((LOCAL_DIR, HF_HUB)) or os.path.exists(pretrained):
        return
    tags = tags_of(model_name) if model_name in list_models() else list(TAGS)
    if pretrained in tags:
        raise FileNotFoundError(f"pretrained {pretrained!r} for {model_name}: the tag names a format of local files, "
                                f"so pass the file itself: {TAGS[pretrained].files}")
    if os.sep in pretrained or pretrained.endswith(PATH_SUFFIXES) or (os.altsep and os.altsep in pretrained):
        raise FileNotFoundError(f"pretrained {pretrained}: no such file or folder")
    raise FileNotFoundError(f"pretrained {pretrained!r} for {model_name}: no such file, and not a tag; "
                            f"list_pretrained() offers {model_name} with {', '.join(tags)} (formats of local files: "
                            f"pass the file's path)")


# --------------------------------------------------------------------------------------------- create_model
def create_model(model_name: str, pretrained: Optional[str] = None, *, device: Union[str, torch.device, None] = None,
                 precision: str = "fp32", output_dict: bool = False, trust_pickle: bool = False,
                 swap: Optional[dict] = None, **overrides: Any) -> nn.Module:
    """Build a model by name and optionally load weights, then optionally swap its attention.

    Args:
        model_name: a CLIP or LM config name, a config JSON path, ``open_clip:NAME``, ``local-dir:`` / ``hf-hub:``
            or a path to weights (see the module docstring).
        pretrained: weights for a config name or ``open_clip:NAME``: a checkpoint in any supported format, loaded
            strictly after converting to diffmm's layout (a timm ViT file fills only the image tower), with the
            file's preprocessing; for ``open_clip:NAME`` also an open_clip tag.
        device: move the model there.
        precision: open_clip's names (:mod:`diffmm.hub.precision`).
        output_dict: ``forward`` returns a dict (open_clip's ``output_dict``).
        trust_pickle: allow checkpoints that need full unpickling (the official ``checkpoint_best.pt``).
        swap: keyword arguments of :func:`diffmm.swap_attention` applied after the weights are loaded
            (``attention``, ``towers``, ``layers``, ``init``, ``lambda_init``, ``backend``, ``seed``).
        overrides: config fields (top level) or ``vision_cfg=dict(...)`` / ``text_cfg=dict(...)`` merged in.
    """
    check_precision(precision)
    kind = model_kind(model_name)
    if pretrained and kind in ("saved", "path"):
        raise ValueError(f"model {model_name!r} already holds weights; pretrained= ({pretrained!r}) is for config "
                         f"names and open_clip:NAME")
    if kind == "open_clip":
        model = _create_open_clip(model_name[len(OPEN_CLIP_PREFIX):], pretrained, trust_pickle=trust_pickle,
                                  overrides=overrides, precision=precision)
    elif kind in ("saved", "path"):
        model = _load_saved(model_name, trust_pickle=trust_pickle, overrides=overrides)
    elif kind == "lm":
        model = DiffLM(LMConfig.from_name(model_name, **overrides))
        if pretrained:
            _load_into(model, pretrained, trust_pickle=trust_pickle)
    else:
        cfg = get_model_config(model_name)
        if pretrained:
            _check_pretrained_file(model_name, pretrained)  # before building: a tag is no file
        cfg = cfg.replace(**overrides) if overrides else cfg
        model = init_pretrained_vision(cfg) if cfg.vision_cfg.pretrained else DiffCLIP(cfg)
        if pretrained:
            _load_into(model, pretrained, trust_pickle=trust_pickle, keep=_preprocess_keys(overrides))
    if swap:
        apply_swap(model, swap)
    if hasattr(model, "output_dict"):  # CLIP models
        model.output_dict = output_dict
    if device is not None:
        model = model.to(device=device)
    if kind == "open_clip" and not isinstance(model, DiffCLIP):
        return model  # open_clip's factory set the precision
    return set_precision(model, precision)


#: the keys of ``swap=`` (those of :func:`diffmm.swap_attention`; ``attention`` is its ``attn_type``)
SWAP_KEYS = ("attention", "attn_type", "towers", "layers", "init", "lambda_init", "backend", "seed")


def apply_swap(model: nn.Module, swap: dict, *, source: str = "swap") -> nn.Module:
    """:func:`diffmm.swap_attention` with the keys of ``swap``; returns ``model``. The upcycled layers' random
    parts come from a generator seeded with ``swap['seed']`` (default 0), not from the global RNG."""
    if not isinstance(swap, dict):
        raise TypeError(f"{source}: expected a mapping of swap_attention arguments; got {type(swap).__name__}")
    unknown = sorted(set(swap) - set(SWAP_KEYS))
    if unknown:
        raise ValueError(f"{source}: unknown keys {', '.join(unknown)}; expected some of {', '.join(SWAP_KEYS)}")
    kw = dict(swap)
    if "attention" in kw and "attn_type" in kw:
        raise ValueError(f"{source}: give attention or attn_type, not both")
    attn_type = kw.pop("attention", None) or kw.pop("attn_type", None) or "diff"
    generator = torch.Generator().manual_seed(int(kw.pop("seed", 0) or 0))
    return swap_attention(model, attn_type=attn_type, generator=generator, **kw)


def _preprocess_keys(overrides: dict) -> set[str]:
    """Preprocessing fields the caller set explicitly (a loaded checkpoint must not replace them)."""
    keys = {f"vision_cfg.{k}" for k in (overrides.get("vision_cfg") or {}) if k in ("image_mean", "image_std")}
    return keys | {f"text_cfg.{k}" for k in (overrides.get("text_cfg") or {}) if k == "truncate"}


def _check_attention_types(model: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """One-line error when standard-attention weights meet differential layers (or the reverse), before the strict
    load would list every lambda key as missing."""
    model_diff, file_diff = (any(k.endswith("attn.lambda_q1") for k in keys) for keys in (model.state_dict(), sd))
    if model_diff and not file_diff:
        raise ValueError(f"{source} holds standard-attention weights, but the model has differential attention; to "
                         f"start a DiffCLIP from a standard CLIP, load the file into the standard model it came from "
                         f"(e.g. model_name OpenCLIP-Tiny / CLIP-Tiny / open_clip:NAME) and convert it with "
                         f"swap: {{init: upcycle}} (CLIPModule or diffmm.create_model(..., swap=...)), or call "
                         f"diffmm.swap_attention(model, init='upcycle')")
    if file_diff and not model_diff:
        raise ValueError(f"{source} holds differential-attention weights (lambda vectors), but the model has standard "
                         f"attention; load it into a DiffCLIP config, or pass the file itself as the model")


def _load_into(model: nn.Module, pretrained: str, *, trust_pickle: bool = False,
               keep: set[str] = frozenset()) -> nn.Module:
    """Load ``pretrained`` (any format) into ``model`` strictly (a timm ViT file into its image tower), and set the
    preprocessing the file's config names (non-default ``image_mean`` / ``image_std`` / ``truncate``) except the
    fields in ``keep``."""
    w = read_weights(resolve_location(pretrained), trust_pickle=trust_pickle, build=False)
    sd, cfg = w.state_dict, w.config
    target = model.visual if w.kind == "visual" else model
    where = f"{w.source} (image tower)" if w.kind == "visual" else w.source
    _check_attention_types(target, sd, where)
    load_strict(target, sd, source=where)
    if isinstance(model, DiffCLIP) and isinstance(cfg, CLIPConfig):
        for tower, key, default in (("vision_cfg", "image_mean", None), ("vision_cfg", "image_std", None),
                                    ("text_cfg", "truncate", "eot")):
            value = getattr(getattr(cfg, tower), key)
            if value != default and f"{tower}.{key}" not in keep:
                setattr(getattr(model.config, tower), key, value)
    return model


def _create_open_clip(name: str, pretrained: Optional[str], *, trust_pickle: bool, overrides: dict,
                      precision: str = "fp32") -> nn.Module:
    """The model of ``open_clip:NAME`` (rule 2 of the module docstring) with ``pretrained`` loaded strictly."""
    tag_cfg: dict = {}
    if pretrained and not os.path.exists(pretrained) and not pretrained.startswith((LOCAL_DIR, HF_HUB)):
        pretrained, tag_cfg = download_tag(name, pretrained)  # an open_clip hub tag
    cfg = diffclip_config(name)
    if cfg is None:  # open_clip builds it
        path = str(resolve_location(pretrained)) if pretrained else None
        return create_native(name, path, trust_pickle=trust_pickle, overrides=overrides, tag_cfg=tag_cfg,
                             precision=precision)
    if tag_cfg.get("mean") is not None:
        cfg.vision_cfg.image_mean, cfg.vision_cfg.image_std = tuple(tag_cfg["mean"]), tuple(tag_cfg["std"])
    model = DiffCLIP(cfg.replace(**overrides) if overrides else cfg)
    return _load_into(model, pretrained, trust_pickle=trust_pickle) if pretrained else model


def _load_saved(name: str, *, trust_pickle: bool, overrides: dict) -> nn.Module:
    """A model with weights from a file, a folder or a ``local-dir:`` / ``hf-hub:`` name (rules 3 and 4)."""
    model = load_pretrained(name, trust_pickle=trust_pickle)
    if overrides:
        if not isinstance(model, DiffCLIP):
            raise ValueError(f"{name}: config overrides ({', '.join(overrides)}) apply to diffmm's CLIP models; "
                             f"this checkpoint builds a {type(model).__name__}")
        model = load_strict(DiffCLIP(model.config.replace(**overrides)), model.state_dict(), source=name)
    return model


def create_model_and_transforms(model_name: str, pretrained: Optional[str] = None, *,
                                image_mean: Optional[tuple] = None, image_std: Optional[tuple] = None,
                                **kwargs: Any) -> tuple[nn.Module, Callable, Callable]:
    """``(model, preprocess_train, preprocess_val)`` like open_clip; the image size and normalisation come from
    the model (``image_mean`` / ``image_std`` override them)."""
    model = create_model(model_name, pretrained, **kwargs)
    train, val = transforms_for(model, mean=image_mean, std=image_std)
    return model, train, val


def get_tokenizer(model_name: Union[str, nn.Module, None] = None, context_length: Optional[int] = None):
    """The CLIP BPE tokenizer of a model (its context length and truncation rule): ``model_name`` is a name or a
    built model; None gives context 77. Models that open_clip builds get ``open_clip.get_tokenizer``'s."""
    if isinstance(model_name, nn.Module):
        return tokenizer_for(model_name, context_length)
    if not model_name:
        return CLIPTokenizer(context_length or 77)
    kind = model_kind(model_name)
    cfg = get_model_config(model_name) if kind == "config" else None
    if kind == "open_clip":
        cfg = diffclip_config(model_name[len(OPEN_CLIP_PREFIX):])
        if cfg is None:  # open_clip builds it, with its own tokenizer
            import open_clip  # only for open_clip: names (``import diffmm`` works without open_clip)

            return open_clip.get_tokenizer(model_name[len(OPEN_CLIP_PREFIX):], context_length=context_length)
    if cfg is None:
        return tokenizer_for(create_model(model_name), context_length)  # a checkpoint: the model it holds knows
    if cfg.text_cfg.hf_model_name:
        return HFTokenizer(cfg.text_cfg.hf_model_name, context_length or cfg.text_cfg.context_length)
    return CLIPTokenizer(context_length or cfg.text_cfg.context_length, cfg.text_cfg.truncate)


# ------------------------------------------------------------------------------------------ load_pretrained
def load_pretrained(path: Union[str, os.PathLike], *, format: Optional[str] = None, **kwargs: Any) -> nn.Module:
    """Build the model a checkpoint describes and load it strictly (eval mode), recognising its format by its
    files and keys (:data:`diffmm.hub.formats.FORMATS`).

    Args:
        path: a file or folder, ``local-dir:FOLDER`` or ``hf-hub:ORG/REPO`` (downloaded unless cached or offline).
        format: skip detection and use this format name.
        kwargs: the format's options (``trust_pickle=True``; open_clip: ``model_name``, ``head_width``,
            ``text_head_width``, ``quick_gelu``; official: ``lambda_init``, ``preprocess``; timm: ``head_width``,
            ``norm_eps``; ``attn_backend``; Lightning: ``prefix``).
    """
    backend = kwargs.pop("attn_backend", None)
    local = resolve_location(path)
    return _build(read_weights(local, format=format, attn_backend=backend, **kwargs), backend).eval()


def _build(w: Weights, backend: Optional[str] = None) -> nn.Module:
    """The model of :class:`~diffmm.hub.formats.Weights`, its state dict loaded strictly."""
    if w.kind == "name":  # rebuilt by name, as the training module built it (without its pretrained file)
        model = create_model(w.config["name"], swap=w.config["swap"], **w.config["kwargs"])
    elif w.kind == "visual":
        model = VisionTransformer(w.config, backend)
    elif backend is not None and w.kind == "clip":
        model = DiffCLIP(dataclasses.replace(w.config, attn_backend=backend))
    else:
        model = DiffmmHubMixin.kinds[w.kind](w.config)
    return load_strict(model, w.state_dict, source=w.source)
