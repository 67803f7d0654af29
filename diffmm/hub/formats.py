"""The one table of checkpoint formats (:data:`FORMATS`): each entry recognises its files by their names and keys
(nothing unpickled) and reads them into :class:`Weights` ``(kind, config, state dict)`` in diffmm's layout.

Kinds: ``'clip'`` (a ``DiffCLIP``, config a ``CLIPConfig``), ``'lm'`` (a ``DiffLM``, an ``LMConfig``), ``'visual'``
(diffmm's ``VisionTransformer``, a ``VisionCfg``: a timm ViT file) and ``'name'`` (a Lightning checkpoint without a
model record: the model is rebuilt by name from its hyper-parameters; config ``{'name', 'swap', 'kwargs'}``).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

from diffmm.hub.checkpoint import load_state_file, peek_keys, raise_if_damaged, read_state_dict
from diffmm.hub.clip_convert import (from_open_clip_config, infer_clip_config, infer_timm_vit_config, key_layout,
                                     mha_text_to_diffmm, open_clip_to_diffmm, timm_vit_to_diffmm)
from diffmm.hub.dinov2_onnx import init_pretrained_vision
from diffmm.hub.difflama import MODEL_TYPE, from_difflama, hf_to_lm_config, load_state_file_folder, read_json
from diffmm.hub.open_clip_models import open_clip_config
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.clip.config import IMAGENET_MEAN, IMAGENET_STD, CLIPConfig, UnknownModelError, load_config_file
from diffmm.models.hub_mixin import CONFIG, MARKER, WEIGHTS, read_export, read_record
from diffmm.models.lm import LMConfig
from diffmm.models.weight_refs import WEIGHT_REFS_KEY, restore_weights

log = logging.getLogger("diffmm.hub")

#: a Lightning checkpoint's entry holding the model record (``diffmm.models.hub_mixin.model_record``)
MODEL_KEY = "diffmm_model"
#: the entry of checkpoints written before :data:`MODEL_KEY`: a ``DiffCLIP``'s ``CLIPConfig`` dict
OLD_CLIP_CONFIG_KEY = "diffmm_model_config"
LIGHTNING_MARKERS = ("pytorch-lightning_version", "hyper_parameters")
OPEN_CLIP_CONFIG = "open_clip_config.json"
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                     "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth", "model.safetensors",
                     "pytorch_model.bin")


class Weights(NamedTuple):
    """What a format reads: the model kind, its config (None: the file does not tell), the state dict and the file
    it came from (for errors)."""
    kind: str
    config: Any
    state_dict: dict[str, torch.Tensor]
    source: str = ""


@dataclass(frozen=True)
class Format:
    """A checkpoint format: ``recognise(path)`` (by names and keys, nothing unpickled) and ``read(path, **options)``."""
    name: str
    files: str
    recognise: Callable[[Path], bool]
    read: Callable[..., Weights]


def _folder_with(path: Path, name: str, test: Callable[[dict], bool]) -> bool:
    """Whether ``path`` is a folder whose JSON object ``name`` passes ``test``."""
    try:
        return (path / name).is_file() and test(read_json(path / name))
    except (ValueError, OSError):
        return False


# ----------------------------------------------------------------------------------------------- readers
def is_lightning(path: Path) -> bool:
    """A torch file with Lightning's top-level entries (read without unpickling)."""
    return path.is_file() and any(m in peek_keys(path) for m in LIGHTNING_MARKERS)


def _read_lightning(path: Path, *, prefix: str = "model.", trust_pickle: bool = False, kind: Optional[str] = None,
                    model_name: Optional[str] = None, model_config: Optional[str] = None, build: bool = True,
                    **unused) -> Weights:
    """The model record the training module wrote, unless ``model_config`` (a JSON config file) or ``model_name``
    names the architecture; checkpoints written before the record: their ``diffmm_model_config`` (CLIP), else the
    module's ``model_name`` / ``model_kwargs`` / ``swap`` (an LM's vocabulary from ``wte.weight``)."""
    ckpt = load_state_file(path, trust_pickle=trust_pickle)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"{path}: not a Lightning checkpoint (no 'state_dict')")
    sd = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    if not sd:
        raise KeyError(f"{path}: no weights under the prefix {prefix!r} (export: use --prefix)")
    kind = kind or ("clip" if "logit_scale" in sd or any(k.startswith("visual.") for k in sd) else "lm")
    if model_config:
        return Weights(kind, load_config_file(model_config) if kind == "clip" else
                       LMConfig.from_dict(read_json(Path(model_config)), source=model_config), sd)
    if model_name is None and MODEL_KEY in ckpt:
        cls, config = read_record(ckpt[MODEL_KEY], source=f"{path}: {MODEL_KEY}")
        if ckpt.get(WEIGHT_REFS_KEY):  # locked pretrained towers saved by reference (LiTModule(save_locked=False))
            towers = init_pretrained_vision(config) if config.vision_cfg.pretrained else DiffCLIP(config)
            restore_weights(sd, ckpt[WEIGHT_REFS_KEY], towers.state_dict(), where=str(path))
        return Weights(cls.export_kind, config, sd)
    if model_name is None and isinstance(ckpt.get(OLD_CLIP_CONFIG_KEY), dict):
        return Weights("clip", CLIPConfig.from_dict(ckpt[OLD_CLIP_CONFIG_KEY], source=f"{path}: {OLD_CLIP_CONFIG_KEY}"),
                       sd)
    if not build:
        return Weights(kind, None, sd)  # loaded into a model that has its own config
    hp = dict(ckpt.get("hyper_parameters") or {})
    name = model_name or hp.get("model_name")
    kwargs = {} if model_name else {k: v for k, v in (hp.get("model_kwargs") or {}).items()
                                    if k not in ("pretrained", "device")}
    if not name:
        raise ValueError(f"{path}: the checkpoint saves no model record and no model_name (a model passed as a "
                         f"Python object); name the architecture (export: --model NAME or --model_config FILE)")
    if kind == "clip":
        return Weights("name", {"name": name, "swap": None if model_name else hp.get("swap"), "kwargs": kwargs}, sd)
    if "wte.weight" in sd:  # the training module padded the tokenizer's vocabulary
        kwargs.setdefault("vocab_size", sd["wte.weight"].shape[0])
    return Weights("lm", LMConfig.from_name(name, **kwargs), sd)


def _read_difflama(path: Path, *, attn_backend: Optional[str] = None, **unused) -> Weights:
    cfg = hf_to_lm_config(read_json(path / "config.json"), source=str(path / "config.json"),
                          attn_backend=attn_backend)
    return Weights("lm", cfg, from_difflama(load_state_file_folder(path), cfg, source=str(path)))


def _read_export(path: Path, **overrides) -> Weights:
    overrides = {k: v for k, v in overrides.items() if v is not None and k not in ("trust_pickle", "build")}
    cls, config, sd = read_export(path, **overrides)
    return Weights(cls.export_kind, config, sd, str(path / WEIGHTS))


def _run_model_name(path: Path, ckpt_name: Any) -> Optional[str]:
    """The open_clip architecture an open_clip_train run names: ``params.txt`` beside its ``checkpoints`` folder
    (``model: NAME``), else the run name's ``model_NAME`` part (open_clip_train's default run name)."""
    params = path.parent.parent / "params.txt"
    if params.is_file():
        for line in params.read_text().splitlines():
            if line.startswith("model: "):
                return line[len("model: "):].strip()
    m = re.search(r"-model_(.+?)-lr_", ckpt_name) if isinstance(ckpt_name, str) else None
    return m.group(1) if m else None


def _read_open_clip(path: Path, *, trust_pickle: bool = False, model_name: Optional[str] = None,
                    quick_gelu: Optional[bool] = None, head_width: Optional[int] = None,
                    text_head_width: Optional[int] = None, build: bool = True, **unused) -> Weights:
    """An open_clip file or folder (plain ViT towers, or a diffmm timm tower: ``visual.trunk.*``). The config:
    the folder's ``open_clip_config.json``, ``model_name`` (an open_clip architecture), the architecture an
    open_clip_train checkpoint names, else the shapes with 64-wide heads (said in one line, unless given)."""
    oc_cfg = None
    if path.is_dir():
        meta = read_json(path / OPEN_CLIP_CONFIG)
        if "model_cfg" not in meta:
            raise ValueError(f"{path / OPEN_CLIP_CONFIG}: no 'model_cfg' entry")
        oc_cfg, path = meta["model_cfg"], _weights_in(path)
    ckpt = load_state_file(path, trust_pickle=trust_pickle)
    raw = read_state_dict(path, obj=ckpt)
    run = None  # the architecture an open_clip_train run names (when nothing else says it)
    if build and not (model_name or oc_cfg or head_width or text_head_width):
        run = _run_model_name(path, ckpt.get("name") if isinstance(ckpt, dict) else None)
    if (model_name or run or "").startswith("local-dir:"):  # open_clip's own folder rule
        oc_cfg = read_json(Path((model_name or run)[len("local-dir:"):]) / OPEN_CLIP_CONFIG).get("model_cfg")
    elif model_name or run:
        try:
            oc_cfg = open_clip_config(model_name or run)
        except UnknownModelError:
            if model_name:
                raise
            log.warning("%s: the run names the architecture %s, which open_clip does not know here", path, run)
    sd = open_clip_to_diffmm(raw, source=str(path))
    if oc_cfg is not None:
        cfg = from_open_clip_config(oc_cfg if quick_gelu is None else {**oc_cfg, "quick_gelu": quick_gelu},
                                    source=str(path))
        return Weights("clip", cfg, sd, str(path))
    if not build:
        return Weights("clip", None, sd, str(path))  # loaded into a model that has its own config
    if head_width is None or text_head_width is None:
        log.warning("%s: the file names no open_clip architecture; assumed 64-wide attention heads (shapes do not "
                    "tell them): pass model_name=NAME (open_clip's) or head_width= / text_head_width=", path)
    cfg = infer_clip_config(sd, head_width=head_width or 64, text_head_width=text_head_width or 64,
                            act="quick_gelu" if quick_gelu else "gelu", source=str(path),
                            norm_eps=1e-6 if key_layout(raw) == "open_clip_timm" else 1e-5)  # timm's LayerNorm eps
    return Weights("clip", cfg, sd, str(path))


def _weights_in(folder: Path) -> Path:
    for n in OPEN_CLIP_WEIGHTS:
        if (folder / n).is_file():
            return folder / n
    found = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".pt", ".pth", ".bin"))
    if len(found) == 1:
        return folder / found[0]
    raise FileNotFoundError(f"{folder}: no weights file (looked for {', '.join(OPEN_CLIP_WEIGHTS)}; found "
                            f"{found or 'none'})")


def _read_official(path: Path, *, trust_pickle: bool = False, lambda_init: str | float = "constant",
                   preprocess: str = "auto", **unused) -> Weights:
    """``preprocess``: ``'official'`` (ImageNet mean/std, the official tokenizer truncation), ``'openai'`` (diffmm's
    defaults), or ``'auto'``: official for files written by the official code (SLIP format: ``best_acc1`` or DDP's
    ``module.`` prefix), diffmm's defaults for a bare state dict (diffmm's own ``DiffCLIP`` has the same layout)."""
    if preprocess not in ("auto", "official", "openai"):
        raise ValueError(f"preprocess {preprocess!r}; expected auto, official or openai")
    sd = mha_text_to_diffmm(read_state_dict(path, trust_pickle=trust_pickle), source=str(path))
    cfg = infer_clip_config(sd, lambda_init=lambda_init, source=str(path))
    keys = peek_keys(path)
    if preprocess == "official" or (preprocess == "auto" and ("best_acc1" in keys
                                                              or any(k.startswith("module.") for k in keys))):
        cfg.vision_cfg.image_mean, cfg.vision_cfg.image_std = IMAGENET_MEAN, IMAGENET_STD
        cfg.text_cfg.truncate = "cut"  # the official tokenizer keeps the first context_length tokens
    return Weights("clip", cfg, sd)


def _read_timm(path: Path, *, trust_pickle: bool = False, head_width: Optional[int] = None, norm_eps: float = 1e-6,
               lambda_init: str | float = "depth", **unused) -> Weights:
    sd = timm_vit_to_diffmm(read_state_dict(path, trust_pickle=trust_pickle), prefix="", source=str(path))
    return Weights("visual", infer_timm_vit_config(sd, head_width=head_width, norm_eps=norm_eps,
                                                   lambda_init=lambda_init, source=str(path)), sd)


def _layout_is(*layouts: str) -> Callable[[Path], bool]:
    return lambda path: path.is_file() and key_layout(peek_keys(path)) in layouts


#: the formats :func:`read_weights` reads, in the order it tries them
FORMATS = (
    Format("lightning", "a Lightning .ckpt from diffmm fit (the model rebuilt from its record)", is_lightning,
           _read_lightning),
    Format("difflama", "a HF transformers DiffLlamaForCausalLM folder (config.json + safetensors)",
           lambda p: _folder_with(p, "config.json", lambda c: c.get("model_type") == MODEL_TYPE), _read_difflama),
    Format("diffmm_export", f"a diffmm export folder ({CONFIG} with '{MARKER}' + {WEIGHTS})",
           lambda p: (p / WEIGHTS).is_file() and _folder_with(p, CONFIG, lambda c: MARKER in c), _read_export),
    Format("open_clip", "an open_clip CLIP file (plain ViT or diffmm timm tower; open_clip_train checkpoints too), "
           "or a folder / local-dir: with open_clip_config.json",
           lambda p: (p / OPEN_CLIP_CONFIG).is_file() or _layout_is("open_clip", "open_clip_timm")(p),
           _read_open_clip),
    Format("diffclip_official", "an official DiffCLIP checkpoint (checkpoint_best.pt with trust_pickle=True) or a "
           "DiffCLIP state dict", _layout_is("diffclip"), _read_official),
    Format("timm_vit", "a timm VisionTransformer state dict (image tower only)", _layout_is("timm"), _read_timm),
)
FORMAT_NAMES = tuple(f.name for f in FORMATS)


def read_weights(path: Path, *, format: Optional[str] = None, **options: Any) -> Weights:
    """``Weights`` of a local file or folder in the format called ``format``, else in the first of :data:`FORMATS`
    that recognises it (``options`` go to its reader)."""
    if format is not None and format not in FORMAT_NAMES:
        raise ValueError(f"unknown checkpoint format {format!r}; expected one of {', '.join(FORMAT_NAMES)}")
    if format is None:
        raise_if_damaged(path)  # a damaged file names itself instead of "not recognised"
    fmt = FORMATS[FORMAT_NAMES.index(format)] if format else next((f for f in FORMATS if f.recognise(path)), None)
    if fmt is None:
        raise ValueError(f"{path}: not a recognised checkpoint; supported: "
                         + "; ".join(f"{f.name} ({f.files})" for f in FORMATS))
    w = fmt.read(path, **options)
    return w if w.source else w._replace(source=str(path))
