"""The one factory of model names and weights, with open_clip's API where it overlaps: :func:`create_model`,
:func:`create_model_and_transforms`, :func:`get_tokenizer`, :func:`load_pretrained`, :func:`list_pretrained`,
:func:`describe_pretrained`.

A model is named by one of (:func:`model_kind`; ``diffmm.create_model``, ``CLIPModule(model_name=...)`` and every
CLI's ``--model`` read names through it):

1. a diffmm config name (``diffmm.list_models()``: ``DiffCLIP-ViT-B-16``, ``CLIP-Tiny``, ``OpenCLIP-ViT-B-16``,
   ...) or a path to a model-config ``.json`` file: random weights unless ``pretrained=`` / ``--pretrained``;
2. ``open_clip:NAME``: an open_clip architecture (``open_clip.list_models()``), built as diffmm's ``DiffCLIP`` in
   open_clip's layout when diffmm implements it (plain ViT + text Transformer), else as open_clip's own model
   (:mod:`diffmm.hub.open_clip_models`); random weights unless ``pretrained=`` (a file, or an open_clip tag, which
   open_clip downloads);
3. ``local-dir:FOLDER`` / ``hf-hub:ORG/REPO``: an open_clip folder or a diffmm export (weights included);
4. a path to weights: a Lightning ``.ckpt`` from ``diffmm fit``, a diffmm export folder, an open_clip file or
   folder, an official DiffCLIP checkpoint (what :func:`load_pretrained` reads; weights included).

Anything else is a one-line error listing these (bare open_clip names such as ``ViT-B-32`` are refused with a
hint to write ``open_clip:ViT-B-32``: diffmm never silently swaps in another library's random model).

:func:`load_pretrained` recognises a local checkpoint by its files and keys (nothing unpickled), in the order of
:data:`FORMATS`: a Lightning ``.ckpt`` (the model rebuilt without the training code, :func:`load_lightning`), a HF
DiffLlama folder, a diffmm export folder, then the CLIP layouts of :mod:`diffmm.hub.clip_formats`.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import huggingface_hub
import torch
import torch.nn as nn

from diffmm.hub.checkpoint import (MODEL_CONFIG_KEY, check_state_dict, is_lightning_checkpoint, raise_if_damaged,
                                   read_lightning)
from diffmm.hub.clip_formats import (CLIP_LAYOUTS, check_attention_types, clip_layout, load_clip,
                                     load_weights_and_config, strict_load)
from diffmm.hub.difflama import is_difflama_folder, load_difflama
from diffmm.hub.diffmm_export import is_export_folder, load_export
from diffmm.hub.open_clip_models import create_native, diffclip_config, download_tag
from diffmm.hub.precision import check_precision, set_precision
from diffmm.hub.pretrained_vision import init_pretrained_vision
from diffmm.models.clip.config import CLIPConfig, UnknownModelError, get_model_config, list_models, load_config_file
from diffmm.models.clip.hf_text import HFTokenizer
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.clip.preprocess import tokenizer_for, transforms_for
from diffmm.models.clip.tokenizer import CLIPTokenizer
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.models.swap import swap_attention

log = logging.getLogger("diffmm.hub")

OPEN_CLIP_PREFIX = "open_clip:"
LOCAL_DIR, HF_HUB = "local-dir:", "hf-hub:"
#: prefixes of saved models (weights included)
SAVED_PREFIXES = (LOCAL_DIR, HF_HUB)
#: what a name can be, for the one-line error
ACCEPTED = ("a diffmm model name ({names})", "open_clip:NAME (an open_clip architecture)",
            "local-dir:FOLDER or hf-hub:ORG/REPO", "a path to a model-config .json, a Lightning .ckpt from diffmm fit, "
            "a diffmm export folder or a checkpoint file diffmm.load_pretrained reads")
#: file endings that make a name a path even when the file is missing (so the error says "no such file")
PATH_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors", ".json")


# ------------------------------------------------------------------------------------------------ names
def model_kind(name: str) -> str:
    """Which rule ``name`` follows: ``'config'``, ``'open_clip'``, ``'saved'`` or ``'path'`` (see module doc).

    Raises:
        FileNotFoundError: a path-like name (with a separator or a checkpoint suffix) that does not exist.
        UnknownModelError: any other name no rule accepts, listing what is accepted.
    """
    if not isinstance(name, str) or not name:
        raise UnknownModelError(f"model name {name!r}; expected a non-empty string")
    if name.startswith(OPEN_CLIP_PREFIX):
        return "open_clip"
    if name.startswith(SAVED_PREFIXES):
        return "saved"
    if name in list_models():
        return "config"
    if os.path.exists(name):
        return "config" if (name.endswith(".json") and os.path.isfile(name)) else "path"
    if name.endswith(PATH_SUFFIXES) or os.sep in name or (os.altsep and os.altsep in name):
        raise FileNotFoundError(f"{name}: no such file or folder (as a model: a model-config .json, a Lightning .ckpt, "
                                f"an export folder or a checkpoint file)")
    raise UnknownModelError(unknown_model_message(name))


def unknown_model_message(name: str) -> str:
    """``unknown model 'X'; accepted: ...`` (with a hint when open_clip knows the name)."""
    accepted = "; ".join(a.format(names=", ".join(list_models())) for a in ACCEPTED)
    try:
        import open_clip  # for the hint only (``import diffmm`` works without open_clip)

        hint = f"; did you mean open_clip:{name}?" if name in open_clip.list_models() else ""
    except ImportError:
        hint = ""
    return f"unknown model {name!r}; accepted: {accepted}{hint}"


def has_weights(name: str, pretrained: Optional[str]) -> bool:
    """Whether the model ``name`` (+ ``pretrained``) comes with trained weights (False: random init)."""
    return bool(pretrained) or model_kind(name) in ("saved", "path")


def random_weights_message(name: str) -> str:
    return (f"model {name!r} has random weights (no --pretrained and not a checkpoint): its results are chance "
            f"level; pass --pretrained FILE or a checkpoint as --model")


def resolve_location(name: Union[str, os.PathLike]) -> Path:
    """A file or folder path, ``local-dir:PATH`` or ``hf-hub:ORG/REPO`` (a snapshot: the Hugging Face cache first,
    then the network) -> an existing local path."""
    s = str(name)
    if s.startswith(HF_HUB):
        repo = s[len(HF_HUB):]
        try:
            return Path(huggingface_hub.snapshot_download(repo, local_files_only=True))
        except Exception:  # not cached
            pass
        try:
            return Path(huggingface_hub.snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "*.bin",
                                                                                "*.txt"]))
        except Exception as e:  # no network (or HF_HUB_OFFLINE), no such repository, ...
            raise ConnectionError(f"{s}: not in the local Hugging Face cache and could not be downloaded "
                                  f"({type(e).__name__}); download the folder elsewhere and load it with "
                                  f"local-dir:PATH") from None
    p = Path(s[len(LOCAL_DIR):] if s.startswith(LOCAL_DIR) else s)
    if not p.exists():
        raise FileNotFoundError(f"{s}: no such file or folder")
    return p


# ------------------------------------------------------------------------------------------ list_pretrained
#: tag -> what files of that tag are and how to load them (no hub downloads exist for these: local files only)
PRETRAINED_TAGS = {
    "official": "the official DiffCLIP checkpoint (checkpoint_best.pt, SLIP format; trust_pickle=True / "
                "--trust_pickle true) or its state dict as .safetensors; loads into DiffCLIP-* configs with ImageNet "
                "mean/std and the official tokenizer truncation",
    "open_clip": "an open_clip ViT CLIP checkpoint (open_clip_model.safetensors / open_clip_pytorch_model.bin, a "
                 "torch.save(model.state_dict()) file, or a folder with open_clip_config.json); loads exactly into "
                 "OpenCLIP-* configs and into open_clip:NAME",
    "timm": "a timm VisionTransformer state dict; fills the image tower (visual) of any config of its shape",
    "diffmm": "diffmm's own weights: a Lightning .ckpt from diffmm fit, a diffmm export folder (diffmm export), or "
              "torch.save(model.state_dict()) of the same config",
}


#: tag -> the local files of that format, for the error on a tag given as ``pretrained=``
PRETRAINED_FILES = {
    "official": "checkpoint_best.pt with trust_pickle=True, or its state dict as .safetensors",
    "open_clip": "open_clip_model.safetensors, open_clip_pytorch_model.bin or local-dir:FOLDER",
    "timm": "a timm ViT state dict (.safetensors, .pth)",
    "diffmm": "a Lightning .ckpt, a diffmm export folder or a torch.save(model.state_dict()) file",
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
    ``--pretrained PATH``.

    Args:
        as_str: ``'name:tag'`` strings instead of tuples.
        open_clip_tags: add open_clip's own hub tags as ``('open_clip:NAME', tag)`` (downloaded by open_clip, so
            they need the network).
    """
    pairs = [(name, tag) for name in list_models() for tag in _tags_of(name)]
    if open_clip_tags:
        import open_clip  # only for open_clip's tags

        pairs += [(OPEN_CLIP_PREFIX + n, t) for n, t in open_clip.list_pretrained()]
    return [f"{n}:{t}" for n, t in pairs] if as_str else pairs


def describe_pretrained() -> dict[str, str]:
    """Tag -> description of the files of that tag."""
    return dict(PRETRAINED_TAGS)


def check_pretrained_file(model_name: str, pretrained: str) -> None:
    """A one-line ``FileNotFoundError`` when ``pretrained`` for the config ``model_name`` is no local file or folder:
    a tag of :func:`list_pretrained` names a format (diffmm downloads nothing), so the error says which files it
    means; any other word lists the model's tags."""
    if pretrained.startswith(SAVED_PREFIXES) or os.path.exists(pretrained):
        return
    tags = _tags_of(model_name) if model_name in list_models() else list(PRETRAINED_TAGS)
    if pretrained in tags:
        raise FileNotFoundError(f"pretrained {pretrained!r} for {model_name}: diffmm downloads nothing; the tag names "
                                f"a format of local files, so pass the file itself: {PRETRAINED_FILES[pretrained]}")
    if os.sep in pretrained or pretrained.endswith(PATH_SUFFIXES) or (os.altsep and os.altsep in pretrained):
        raise FileNotFoundError(f"pretrained {pretrained}: no such file or folder")
    raise FileNotFoundError(f"pretrained {pretrained!r} for {model_name}: no such file, and not a tag; "
                            f"list_pretrained() offers {model_name} with {', '.join(tags)} (formats of local files: "
                            f"pass the file's path; describe_pretrained() says which)")


# --------------------------------------------------------------------------------------------- create_model
def create_model(model_name: str, pretrained: Optional[str] = None, *, device: Union[str, torch.device, None] = None,
                 precision: str = "fp32", output_dict: bool = False, trust_pickle: bool = False,
                 swap: Optional[dict] = None, **overrides: Any) -> nn.Module:
    """Build a model by name and optionally load weights, then optionally swap its attention.

    Args:
        model_name: a config name (:func:`~diffmm.models.clip.config.list_models`) or a config JSON path;
            ``open_clip:NAME``; ``local-dir:`` / ``hf-hub:``; or a path to weights (Lightning ``.ckpt`` from
            ``diffmm fit``, diffmm export folder, open_clip / official file); see the module docstring.
        pretrained: weights for a config name or ``open_clip:NAME``: a checkpoint in any supported format (open_clip
            file or ``local-dir:``, timm, official DiffCLIP, diffmm export, Lightning ``.ckpt``), loaded strictly
            after converting to diffmm's layout (a timm ViT checkpoint initialises only the image tower); for
            ``open_clip:NAME`` also an open_clip hub tag (downloaded by open_clip). Official DiffCLIP files set the
            official preprocessing (ImageNet mean/std, the official tokenizer truncation) in the model's config.
        device: where the weights live (default: where they were built).
        precision: open_clip's names and meaning (:mod:`diffmm.hub.precision`): ``fp32``; ``fp16`` / ``bf16``
            (mixed: Linear / Conv weights and projections low, norms, embeddings and scalars fp32);
            ``pure_fp16`` / ``pure_bf16`` (everything); ``amp``, ``amp_bf16``, ``amp_bfloat16`` (fp32 weights).
        output_dict: ``forward`` returns a dict.
        trust_pickle: allow checkpoints that need full unpickling (the official ``checkpoint_best.pt``).
        swap: keyword arguments of :func:`diffmm.swap_attention` applied *after* the weights are loaded
            (``attention``: ``diff`` | ``diff_v2``, ``towers``, ``layers``, ``init``: ``upcycle`` | ``scratch``,
            ``lambda_init``, ``backend``, ``seed`` of the upcycled layers' random parts), e.g.
            ``swap={"init": "upcycle"}`` turns a pretrained CLIP into a DiffCLIP with the same outputs.
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
    else:
        cfg = get_model_config(model_name)
        if pretrained:
            check_pretrained_file(model_name, pretrained)  # before building: a tag is no file
        cfg = cfg.replace(**overrides) if overrides else cfg
        model = init_pretrained_vision(cfg) if cfg.vision_cfg.pretrained else DiffCLIP(cfg)
        if pretrained:
            load_pretrained_into(model, pretrained, trust_pickle=trust_pickle, keep=_preprocess_keys(overrides))
    if swap:
        apply_swap(model, swap)
    model.output_dict = output_dict
    if device is not None:
        model = model.to(device=device)
    if getattr(model, "diffmm_open_clip_precision", None) == precision:
        return model  # open_clip's factory set it
    return set_precision(model, precision)


#: the keys of ``swap=`` (those of :func:`diffmm.swap_attention`; ``attention`` is its ``attn_type``)
SWAP_KEYS = ("attention", "attn_type", "towers", "layers", "init", "lambda_init", "backend", "seed")


def apply_swap(model: nn.Module, swap: dict, *, source: str = "swap") -> nn.Module:
    """:func:`diffmm.swap_attention` with the keys of ``swap`` (see :func:`create_model`); returns ``model``.

    The upcycled layers' random parts (lambda vectors, split noise) come from a generator seeded with
    ``swap['seed']`` (default 0), so swapping does not consume the global RNG (data augmentation and the first
    batches stay the same as without the swap).
    """
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


def copy_preprocessing(model: nn.Module, cfg: Any, keep: set[str] = frozenset()) -> None:
    """Set the preprocessing a checkpoint's config names (non-default ``image_mean`` / ``image_std`` /
    ``truncate``) on a ``DiffCLIP``'s config, except the fields in ``keep`` (``'vision_cfg.image_mean'``, ...)."""
    if not isinstance(model, DiffCLIP) or not isinstance(cfg, CLIPConfig):
        return
    for tower, key, default in (("vision_cfg", "image_mean", None), ("vision_cfg", "image_std", None),
                                ("text_cfg", "truncate", "eot")):
        value = getattr(getattr(cfg, tower), key)
        if value != default and f"{tower}.{key}" not in keep:
            setattr(getattr(model.config, tower), key, value)


def load_pretrained_into(model: nn.Module, pretrained: str, *, trust_pickle: bool = False,
                         keep: set[str] = frozenset()) -> nn.Module:
    """Load ``pretrained`` (any format :func:`create_model` accepts) into ``model`` strictly, with the file's
    preprocessing (see :func:`copy_preprocessing`)."""
    path = resolve_location(pretrained)
    if is_lightning_checkpoint(path):
        src = load_lightning(path, trust_pickle=trust_pickle)
        sd = src.state_dict()
        check_attention_types(model, sd, str(pretrained))
        strict_load(model, sd, f"{pretrained} (Lightning checkpoint)")
        cfg = getattr(src, "config", None)
    else:
        _, cfg = load_weights_and_config(model, path, trust_pickle=trust_pickle)
    copy_preprocessing(model, cfg, keep)
    return model


def _create_open_clip(name: str, pretrained: Optional[str], *, trust_pickle: bool, overrides: dict,
                      precision: str = "fp32") -> nn.Module:
    """The model of ``open_clip:NAME`` (rule 2 of the module docstring) with ``pretrained`` loaded strictly."""
    tag_cfg: dict = {}
    if pretrained and not os.path.exists(pretrained) and not pretrained.startswith(SAVED_PREFIXES):
        pretrained, tag_cfg = download_tag(name, pretrained)  # an open_clip hub tag
    cfg = diffclip_config(name)
    if cfg is None:  # open_clip builds it
        path = str(resolve_location(pretrained)) if pretrained else None
        return create_native(name, path, trust_pickle=trust_pickle, overrides=overrides, tag_cfg=tag_cfg,
                             precision=precision)
    if tag_cfg.get("mean") is not None:
        cfg.vision_cfg.image_mean, cfg.vision_cfg.image_std = tuple(tag_cfg["mean"]), tuple(tag_cfg["std"])
    model = DiffCLIP(cfg.replace(**overrides) if overrides else cfg)
    if pretrained:
        load_pretrained_into(model, pretrained, trust_pickle=trust_pickle)
    model.diffmm_open_clip_name = name
    return model


def _load_saved(name: str, *, trust_pickle: bool, overrides: dict) -> nn.Module:
    """A model with weights from a file, a folder or a ``local-dir:`` / ``hf-hub:`` name (rules 3 and 4)."""
    model = load_pretrained(name, trust_pickle=trust_pickle)
    if overrides:
        if not isinstance(model, DiffCLIP):
            raise ValueError(f"{name}: config overrides ({', '.join(overrides)}) apply to diffmm's CLIP models; "
                             f"this checkpoint builds a {type(model).__name__}")
        rebuilt = DiffCLIP(model.config.replace(**overrides))
        rebuilt.load_state_dict(model.state_dict(), strict=True)
        model = rebuilt
    return model


def create_model_and_transforms(model_name: str, pretrained: Optional[str] = None, *,
                                image_mean: Optional[tuple] = None, image_std: Optional[tuple] = None,
                                **kwargs: Any) -> tuple[nn.Module, Callable, Callable]:
    """``(model, preprocess_train, preprocess_val)`` like open_clip; the image size and normalisation come from
    the model (:func:`~diffmm.models.clip.preprocess.transforms_for`; ``image_mean`` / ``image_std`` override
    them)."""
    model = create_model(model_name, pretrained, **kwargs)
    train, val = transforms_for(model, mean=image_mean, std=image_std)
    return model, train, val


def get_tokenizer(model_name: Union[str, nn.Module, None] = None, context_length: Optional[int] = None):
    """The CLIP BPE tokenizer of a model: its context length and its truncation rule (``text_cfg.truncate``).

    ``model_name`` is a name (:func:`create_model`'s rule) or a built model; None gives context 77.
    ``tokenizer(list_of_str) -> LongTensor (B, context_length)``. open_clip models that diffmm builds with open_clip
    itself get ``open_clip.get_tokenizer``'s.
    """
    if isinstance(model_name, nn.Module):
        return tokenizer_for(model_name, context_length)
    if not model_name:
        return CLIPTokenizer(context_length or 77)
    kind = model_kind(model_name)
    if kind == "config":
        text = get_model_config(model_name).text_cfg
        if text.hf_model_name:
            return HFTokenizer(text.hf_model_name, context_length or text.context_length)
        return CLIPTokenizer(context_length or text.context_length, text.truncate)
    if kind == "open_clip":
        name = model_name[len(OPEN_CLIP_PREFIX):]
        cfg = diffclip_config(name)
        if cfg is None:  # open_clip builds it, with its own tokenizer
            import open_clip  # only for open_clip: names (``import diffmm`` works without open_clip)

            return open_clip.get_tokenizer(name, context_length=context_length)
        return CLIPTokenizer(context_length or cfg.text_cfg.context_length, cfg.text_cfg.truncate)
    return tokenizer_for(create_model(model_name), context_length)  # a checkpoint: the model it holds knows


# ------------------------------------------------------------------------------------------ load_pretrained
#: the formats :func:`load_pretrained` reads, in detection order: name -> description
FORMATS = {
    "lightning": "Lightning .ckpt from diffmm fit (model rebuilt from the checkpoint, weights only)",
    "difflama": "HF transformers DiffLlamaForCausalLM folder (config.json + safetensors)",
    "diffmm_export": "diffmm export folder (config.json with 'diffmm_export' + model.safetensors)",
    **CLIP_LAYOUTS,
}


def detect_format(path: Path) -> str:
    """The :data:`FORMATS` name of a local file or folder, by its files and keys (nothing unpickled)."""
    raise_if_damaged(path)  # a damaged file names itself instead of "not recognised"
    if is_lightning_checkpoint(path):
        return "lightning"
    if is_difflama_folder(path):
        return "difflama"
    if is_export_folder(path):
        return "diffmm_export"
    layout = clip_layout(path)
    if layout is None:
        raise ValueError(f"{path}: not a recognised checkpoint; supported formats: {', '.join(FORMATS)}")
    return layout


def load_pretrained(path: Union[str, os.PathLike], *, format: Optional[str] = None, **kwargs) -> nn.Module:
    """Build a diffmm model from local files (or a ``local-dir:`` / ``hf-hub:`` name), recognising the format by
    its files and keys.

    Args:
        path: a file or folder, ``local-dir:FOLDER`` or ``hf-hub:ORG/REPO``.
        format: skip detection and use this :data:`FORMATS` name.
        kwargs: passed to the format's loader (e.g. ``trust_pickle=True``, ``model_name=...``).
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; expected one of {', '.join(FORMATS)}")
    local = resolve_location(path)
    format = format or detect_format(local)
    if format == "lightning":
        return load_lightning(local, **kwargs)
    if format == "difflama":
        return load_difflama(local, **kwargs)
    if format == "diffmm_export":
        return load_export(local, **kwargs)
    return load_clip(local, layout=format, **kwargs)


def load_lightning(path: Union[str, os.PathLike], *, kind: Optional[str] = None, prefix: str = "model.",
                   model_name: Optional[str] = None, model_config: Optional[str] = None,
                   trust_pickle: bool = False, **unused: Any) -> nn.Module:
    """Rebuild the model of a Lightning checkpoint from ``diffmm fit`` and load its weights strictly.

    The file is read with ``torch.load(weights_only=True)`` (tensors, plain containers and ``pathlib`` paths; no
    code in the pickle runs). The model is built from (first match): ``model_config`` / ``model_name`` if given;
    the checkpoint's ``diffmm_model_config`` (the ``CLIPConfig`` that ``CLIPModule`` saves, swapped layers and
    preprocessing included); the hyper-parameters ``model_name`` / ``model_kwargs`` / ``swap`` of ``CLIPModule``
    (:func:`create_model` without the ``pretrained`` weights) or ``model_name`` / ``model_kwargs`` of ``LMModule``.

    Args:
        kind: ``'clip'`` or ``'lm'`` (default: by the keys).
        prefix: the model's prefix in the Lightning state dict.
        model_name / model_config: build this architecture (a name, a JSON config file) instead.
        trust_pickle: allow objects beyond tensors and plain containers (only for files you trust).
    """
    hp, sd, ckpt = read_lightning(path, prefix=prefix, trust_pickle=trust_pickle)
    kind = kind or ("clip" if ("logit_scale" in sd or any(k.startswith("visual.") for k in sd)) else "lm")
    if kind == "clip":
        model = _lightning_clip(str(path), ckpt, hp, model_name, model_config)
    elif kind == "lm":
        model = _lightning_lm(str(path), hp, sd, model_name, model_config)
    else:
        raise ValueError(f"kind {kind!r}; expected clip or lm")
    check_state_dict(sd, model.state_dict(), source=str(path))  # shapes and dtype kinds
    model.load_state_dict(sd, strict=True)
    return model.eval()


def _lightning_clip(path: str, ckpt: dict, hp: dict, model_name: Optional[str],
                    model_config: Optional[str]) -> nn.Module:
    if model_config:
        return DiffCLIP(load_config_file(model_config))
    if model_name is None and isinstance(ckpt.get(MODEL_CONFIG_KEY), dict):
        return DiffCLIP(CLIPConfig.from_dict(ckpt[MODEL_CONFIG_KEY], source=f"{path}: {MODEL_CONFIG_KEY}"))
    name = model_name or hp.get("model_name")
    if not name:
        raise ValueError(f"{path}: the checkpoint saves no model_name (a model passed as a Python object); "
                         f"name the architecture (export: --model NAME or --model_config FILE)")
    kwargs = {k: v for k, v in (hp.get("model_kwargs") or {}).items() if k not in ("pretrained", "device")}
    return create_model(name, swap=hp.get("swap"), **kwargs)


def _lightning_lm(path: str, hp: dict, sd: dict, model_name: Optional[str], model_config: Optional[str]) -> nn.Module:
    if model_config:
        return DiffLM(LMConfig.from_dict(json.loads(Path(model_config).read_text()), source=model_config))
    name = model_name or hp.get("model_name")
    if not name:
        raise ValueError(f"{path}: the checkpoint saves no model_name; export: pass --model NAME or "
                         f"--model_config FILE")
    overrides = dict(hp.get("model_kwargs") or {})
    if "wte.weight" in sd:  # the training module pads the tokenizer's vocabulary
        overrides.setdefault("vocab_size", sd["wte.weight"].shape[0])
    return DiffLM(LMConfig.from_name(name, **overrides))
