"""Public API mirroring open_clip: ``create_model``, ``create_model_and_transforms``, ``get_tokenizer``,
``list_models`` (plus ``get_model_config`` / ``add_model_config``, ``list_pretrained``).

Model names follow one rule (:mod:`diffmm.models.clip.naming`): the JSON files of ``diffmm/model_configs``
(``DiffCLIP-ViT-B-16``, ``DiffCLIP-star-Tiny``, ``CLIP-Tiny``, ...) or a path to such a JSON file,
``open_clip:NAME``, ``local-dir:`` / ``hf-hub:`` names of saved models, or a path to weights (Lightning ``.ckpt``,
export folder, checkpoint file).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from diffmm.models.clip.config import CLIPConfig, load_config_file
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.clip.naming import describe_pretrained, list_pretrained  # noqa: F401  (public API)

log = logging.getLogger("diffmm.models")

CONFIG_DIR = Path(__file__).resolve().parents[2] / "model_configs"
_EXTRA_CONFIGS: dict[str, Path] = {}
SAVED_PREFIXES = ("local-dir:", "hf-hub:")


def _config_files() -> dict[str, Path]:
    files = {p.stem: p for p in sorted(CONFIG_DIR.glob("*.json"))}
    files.update(_EXTRA_CONFIGS)
    return files


def list_models() -> list[str]:
    """Names of the built-in (and added) model configs."""
    return sorted(_config_files(), key=lambda n: (n.replace("-star", "").replace("-dagger", ""), n))


def add_model_config(path: Union[str, Path]) -> None:
    """Register a JSON config file (or every ``*.json`` in a folder) under its file stem."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"{path}: no model-config JSON file")
    for f in files:
        load_config_file(f)  # validate now, not at first use
        _EXTRA_CONFIGS[f.stem] = f


def get_model_config(name: str) -> CLIPConfig:
    """The config of a named model or of a JSON file path."""
    files = _config_files()
    if name in files:
        return load_config_file(files[name])
    if name.endswith(".json") and Path(name).is_file():
        return load_config_file(name)
    raise ValueError(f"unknown model {name!r}; known models: {', '.join(list_models())}")


def create_model(model_name: str, pretrained: Optional[str] = None, *, device: Union[str, torch.device, None] = None,
                 precision: str = "fp32", output_dict: bool = False, trust_pickle: bool = False,
                 swap: Optional[dict] = None, **overrides: Any) -> torch.nn.Module:
    """Build a model by name and optionally load weights, then optionally swap its attention.

    Args:
        model_name: see :mod:`diffmm.models.clip.naming` (one rule for every entry point): a config name
            (:func:`list_models`) or a config JSON path; ``open_clip:NAME``; ``local-dir:`` / ``hf-hub:``; or a path
            to weights (Lightning ``.ckpt`` from ``diffmm fit``, diffmm export folder, open_clip / official file).
        pretrained: weights for a config name or ``open_clip:NAME``: a checkpoint in any supported format (open_clip
            file or ``local-dir:``, timm, official DiffCLIP, diffmm export, Lightning ``.ckpt``), loaded strictly
            after converting to diffmm's layout (a timm ViT checkpoint initialises only the image tower); for
            ``open_clip:NAME`` also an open_clip hub tag (downloaded by open_clip). Official DiffCLIP files set the
            official preprocessing (ImageNet mean/std, the official tokenizer truncation) in the model's config.
        device / precision: where (default: where it was built) and in which dtype (``fp32``, ``fp16``,
            ``bf16``) the weights live.
        output_dict: ``forward`` returns a dict.
        trust_pickle: allow checkpoints that need full unpickling (the official ``checkpoint_best.pt``).
        swap: keyword arguments of :func:`diffmm.swap_attention` applied *after* the weights are loaded
            (``attention``: ``diff`` | ``diff_v2``, ``towers``, ``layers``, ``init``: ``upcycle`` | ``scratch``,
            ``lambda_init``, ``backend``, ``seed`` of the upcycled layers' random parts), e.g.
            ``swap={"init": "upcycle"}`` turns a pretrained CLIP into a DiffCLIP with the same outputs.
        overrides: config fields (top level) or ``vision_cfg=dict(...)`` / ``text_cfg=dict(...)`` merged in.
    """
    from diffmm.models.clip.naming import model_kind

    kind = model_kind(model_name)
    if pretrained and kind in ("saved", "path"):
        raise ValueError(f"model {model_name!r} already holds weights; pretrained= ({pretrained!r}) is for config "
                         f"names and open_clip:NAME")
    if kind == "open_clip":
        from diffmm.models.clip.open_clip_models import create_open_clip

        model = create_open_clip(model_name, pretrained, trust_pickle=trust_pickle, overrides=overrides)
    elif kind == "saved":
        from diffmm.hub.clip_formats import load_clip

        model = load_clip(model_name, trust_pickle=trust_pickle, overrides=overrides or None)
    elif kind == "path":
        model = _load_path(model_name, trust_pickle=trust_pickle, overrides=overrides)
    else:
        cfg = get_model_config(model_name)
        if overrides:
            cfg = cfg.replace(**overrides)
        model = DiffCLIP(cfg)
        if pretrained:
            load_pretrained_into(model, pretrained, trust_pickle=trust_pickle, keep=_preprocess_keys(overrides))
    if swap:
        apply_swap(model, swap)
    model.output_dict = output_dict
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    if dtype is None:
        raise ValueError(f"precision {precision!r}; expected fp32, fp16 or bf16")
    if device is not None:
        model = model.to(device=device)
    return model if dtype == torch.float32 else model.to(dtype=dtype)


#: the keys of ``swap=`` (those of :func:`diffmm.swap_attention`; ``attention`` is its ``attn_type``)
SWAP_KEYS = ("attention", "attn_type", "towers", "layers", "init", "lambda_init", "backend", "seed")


def apply_swap(model: torch.nn.Module, swap: dict, *, source: str = "swap") -> torch.nn.Module:
    """:func:`diffmm.swap_attention` with the keys of ``swap`` (see :func:`create_model`); returns ``model``.

    The upcycled layers' random parts (lambda vectors, split noise) come from a generator seeded with
    ``swap['seed']`` (default 0), so swapping does not consume the global RNG (data augmentation and the first
    batches stay the same as without the swap).
    """
    from diffmm.models.swap import swap_attention

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


def copy_preprocessing(model: torch.nn.Module, cfg: Any, keep: set[str] = frozenset()) -> None:
    """Set the preprocessing a checkpoint's config names (non-default ``image_mean`` / ``image_std`` /
    ``truncate``) on a ``DiffCLIP``'s config, except the fields in ``keep`` (``'vision_cfg.image_mean'``, ...)."""
    if not isinstance(model, DiffCLIP) or not isinstance(cfg, CLIPConfig):
        return
    for tower, key, default in (("vision_cfg", "image_mean", None), ("vision_cfg", "image_std", None),
                                ("text_cfg", "truncate", "eot")):
        value = getattr(getattr(cfg, tower), key)
        if value != default and f"{tower}.{key}" not in keep:
            setattr(getattr(model.config, tower), key, value)


def load_pretrained_into(model: torch.nn.Module, pretrained: str, *, trust_pickle: bool = False,
                         keep: set[str] = frozenset()) -> torch.nn.Module:
    """Load ``pretrained`` (any format :func:`create_model` accepts) into ``model`` strictly, with the file's
    preprocessing (see :func:`copy_preprocessing`)."""
    from diffmm.hub.clip_formats import check_attention_types, load_weights_and_config
    from diffmm.hub.lightning_ckpt import is_lightning_checkpoint, load_lightning

    if is_lightning_checkpoint(pretrained):
        src = load_lightning(pretrained, trust_pickle=trust_pickle)
        from diffmm.hub.clip_formats import strict_load

        sd = src.state_dict()
        check_attention_types(model, sd, str(pretrained))
        strict_load(model, sd, f"{pretrained} (Lightning checkpoint)")
        cfg = getattr(src, "config", None)
    else:
        _, cfg = load_weights_and_config(model, pretrained, trust_pickle=trust_pickle)
    copy_preprocessing(model, cfg, keep)
    return model


def _load_path(path: str, *, trust_pickle: bool, overrides: dict) -> torch.nn.Module:
    """A model with weights from a file or folder (rule 4 of :mod:`~diffmm.models.clip.naming`)."""
    from diffmm.hub import load_pretrained

    model = load_pretrained(path, trust_pickle=trust_pickle)
    if overrides:
        if not isinstance(model, DiffCLIP):
            raise ValueError(f"{path}: config overrides ({', '.join(overrides)}) apply to diffmm's CLIP models; "
                             f"this checkpoint builds a {type(model).__name__}")
        rebuilt = DiffCLIP(model.config.replace(**overrides))
        rebuilt.load_state_dict(model.state_dict(), strict=True)
        model = rebuilt
    return model


def create_model_and_transforms(model_name: str, pretrained: Optional[str] = None, *,
                                image_mean: Optional[tuple] = None, image_std: Optional[tuple] = None,
                                aug_cfg: Optional[dict] = None, **kwargs: Any
                                ) -> tuple[torch.nn.Module, Callable, Callable]:
    """``(model, preprocess_train, preprocess_val)`` like open_clip; the image size and normalisation come from
    the model's config (``image_mean`` / ``image_std`` override them)."""
    from diffmm.models.clip.transforms import transforms_for

    model = create_model(model_name, pretrained, **kwargs)
    train, val = transforms_for(model, mean=image_mean, std=image_std, aug_cfg=aug_cfg)
    return model, train, val


def get_tokenizer(model_name: Union[str, torch.nn.Module, None] = None, context_length: Optional[int] = None):
    """The CLIP BPE tokenizer of a model: its context length and its truncation rule (``text_cfg.truncate``).

    ``model_name`` is a name (:func:`create_model`'s rule) or a built model; None gives context 77.
    ``tokenizer(list_of_str) -> LongTensor (B, context_length)``. open_clip models that diffmm builds with open_clip
    itself get ``open_clip.get_tokenizer``'s.
    """
    from diffmm.models.clip.naming import model_kind
    from diffmm.models.clip.tokenizer import CLIPTokenizer

    if isinstance(model_name, torch.nn.Module):
        return tokenizer_for(model_name, context_length)
    truncate = "eot"
    if model_name:
        kind = model_kind(model_name)
        if kind == "config":
            text = get_model_config(model_name).text_cfg
            context_length, truncate = context_length or text.context_length, text.truncate
        elif kind == "saved":
            context_length = context_length or _saved_context_length(model_name)
        elif kind == "open_clip":
            from diffmm.models.clip.open_clip_models import open_clip_tokenizer

            return open_clip_tokenizer(model_name, context_length)
        else:  # a checkpoint: the model it holds knows
            return tokenizer_for(create_model(model_name), context_length)
    return CLIPTokenizer(context_length=context_length or 77, truncate=truncate)


def tokenizer_for(model: torch.nn.Module, context_length: Optional[int] = None):
    """The tokenizer a built model expects (see :func:`get_tokenizer`)."""
    from diffmm.models.clip.tokenizer import CLIPTokenizer

    oc_name = getattr(model, "diffmm_open_clip_name", None)
    if oc_name is not None and not isinstance(model, DiffCLIP):
        import open_clip

        return open_clip.get_tokenizer(oc_name, context_length=context_length)
    cfg = getattr(model, "config", None)
    if isinstance(cfg, CLIPConfig):
        return CLIPTokenizer(context_length or cfg.text_cfg.context_length, truncate_of(model))
    ctx = getattr(model, "context_length", None) or getattr(getattr(model, "text", None), "context_length", None)
    return CLIPTokenizer(context_length or ctx or 77, truncate_of(model))


def truncate_of(model: torch.nn.Module) -> str:
    """How a built model's tokenizer cuts captions over the context (``TRUNCATE_MODES``): a diffmm config's
    ``text_cfg.truncate``, else open_clip's ``'eot'``. :func:`tokenizer_for` and training (``CLIPModule.truncate``)
    read it."""
    cfg = getattr(model, "config", None)
    return cfg.text_cfg.truncate if isinstance(cfg, CLIPConfig) else "eot"


def _saved_context_length(name: str) -> int:
    """The text context of a ``local-dir:`` / ``hf-hub:`` model (open_clip folder or diffmm export)."""
    import json

    from diffmm.hub.clip_formats import resolve_location

    folder = resolve_location(name)
    for fname, path in (("open_clip_config.json", ("model_cfg", "text_cfg")), ("config.json", ("config", "text_cfg"))):
        f = folder / fname
        if f.is_file():
            d = json.loads(f.read_text())
            for k in path:
                d = d.get(k, {})
            return int(d.get("context_length", 77))
    raise FileNotFoundError(f"{name}: no open_clip_config.json or config.json to read the context length from")
