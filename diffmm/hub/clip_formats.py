"""Pretrained CLIP weights from local files: open_clip, timm, the official DiffCLIP layout, diffmm exports,
``local-dir:`` folders and ``hf-hub:`` names.

Every source turns its file into a state dict in diffmm's ``DiffCLIP`` layout (``diffmm.hub.clip_convert``)
plus, where the file tells it, a config. Then either a model is built from that config
(:func:`load_clip`, ``diffmm.load_pretrained``) or the weights go into an existing model
(:func:`load_weights_into`, ``create_model(name, pretrained=...)``). Loads are strict: one error names every
missing, unexpected and mis-shaped key. Pickles load with ``weights_only=True`` unless ``trust_pickle=True``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickletools
import socket
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from diffmm.hub.checkpoint import check_state_dict, load_state_file, raise_if_damaged, safetensors_damage
from diffmm.hub.clip_convert import (infer_official_config, infer_open_clip_config, infer_timm_vit_config,
                                     mha_text_to_diffmm, open_clip_to_diffmm, strip_module, timm_vit_to_diffmm)
from diffmm.hub.formats import CheckpointFormat, register_format

LOCAL_DIR, HF_HUB = "local-dir:", "hf-hub:"
OPEN_CLIP_CONFIG = "open_clip_config.json"
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                     "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth", "model.safetensors",
                     "pytorch_model.bin")
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


# ----------------------------------------------------------------------------------------------- peeking
def peek_keys(path: Path, limit: int = 200_000) -> set[str]:
    """Strings naming tensors in a checkpoint, read without unpickling anything (cheap, safe detection).

    safetensors: the header's keys. torch zip files: the string constants of ``data.pkl`` (keys, and names
    like ``state_dict``), read with ``pickletools`` (nothing is executed). Other files: empty.
    """
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            if safetensors_damage(path) is not None:
                return set()  # damaged: the loader names the file
            with safe_open(str(path), "pt") as f:
                return set(f.keys())
        if not zipfile.is_zipfile(path):
            return set()
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            if name is None:
                return set()
            data = z.read(name)
        out: set[str] = set()
        for op, arg, _ in pickletools.genops(data):
            if isinstance(arg, str) and "UNICODE" in op.name:
                out.add(arg)
                if len(out) >= limit:
                    break
        return out
    except (OSError, ValueError, RuntimeError, zipfile.BadZipFile):
        return set()


def _has(keys: set[str], key: str) -> bool:
    return key in keys or f"module.{key}" in keys


def _local(path) -> Path:
    s = str(path)
    return Path(s[len(LOCAL_DIR):]) if s.startswith(LOCAL_DIR) else Path(s)


def _read_sd(path: Path, trust_pickle: bool) -> dict[str, torch.Tensor]:
    """A checkpoint file -> its state dict (unwraps ``{'state_dict': ...}`` / ``{'model': ...}``; strips
    ``module.``)."""
    obj = load_state_file(path, trust_pickle=trust_pickle)
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path}: expected a state dict of tensors (or a checkpoint with 'state_dict')")
    return strip_module(obj)


def _weights_in(folder: Path, names=OPEN_CLIP_WEIGHTS) -> Path:
    for n in names:
        if (folder / n).is_file():
            return folder / n
    found = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if len(found) == 1:
        return folder / found[0]
    raise FileNotFoundError(f"{folder}: no weights file (looked for {', '.join(names)}; found {found or 'none'})")


# ---------------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class ClipSource:
    """A file layout: ``detect(path)`` and ``read(path, **kw) -> (diffmm state dict, config or None, towers)``
    where towers is ``'clip'`` (both) or ``'visual'`` (an image tower only)."""

    name: str
    detect: Callable[[Path], bool]
    read: Callable[..., tuple[dict, Any, str]]
    description: str


def _detect_open_clip(path: Path) -> bool:
    path = _local(path)
    if path.is_dir():
        return (path / OPEN_CLIP_CONFIG).is_file()
    keys = peek_keys(path)
    return _has(keys, "visual.class_embedding") or _has(keys, "visual.conv1.weight")


def _read_open_clip(path, *, trust_pickle: bool = False, model_name: Optional[str] = None,
                    quick_gelu: Optional[bool] = None, head_width: int = 64, text_head_width: int = 64,
                    need_config: bool = True, **unused):
    """``need_config=False`` (loading into an existing model): a config the shapes cannot tell is None, not an
    error (head widths are guesses)."""
    from diffmm.models.clip.config import from_open_clip_config

    path = _local(path)
    oc_cfg = None
    if path.is_dir():
        with open(path / OPEN_CLIP_CONFIG) as f:
            meta = json.load(f)
        if "model_cfg" not in meta:
            raise ValueError(f"{path / OPEN_CLIP_CONFIG}: no 'model_cfg' entry")
        oc_cfg, path = meta["model_cfg"], _weights_in(path)
    elif model_name is not None:
        import open_clip

        oc_cfg = open_clip.get_model_config(model_name)
        if oc_cfg is None:
            raise ValueError(f"{path}: open_clip has no model config {model_name!r}")
    raw = _read_sd(path, trust_pickle)
    if oc_cfg is not None:
        cfg = from_open_clip_config(dict(oc_cfg) if quick_gelu is None else {**oc_cfg, "quick_gelu": quick_gelu},
                                    source=str(path))
    else:
        try:
            cfg = infer_open_clip_config(raw, head_width=head_width, text_head_width=text_head_width,
                                         quick_gelu=bool(quick_gelu), source=str(path))
        except (ValueError, KeyError):
            if need_config:
                raise
            cfg = None
    return open_clip_to_diffmm(raw, source=str(path)), cfg, "clip"


def _detect_official(path: Path) -> bool:
    if path.is_dir():
        return False
    keys = peek_keys(path)
    return _has(keys, "image_projection") and _has(keys, "visual.patch_embed.proj.weight")


def _read_official(path, *, trust_pickle: bool = False, lambda_init: str | float = "constant",
                   preprocess: str = "auto", **unused):
    """``preprocess``: ``'official'`` (ImageNet mean/std, the official tokenizer truncation), ``'openai'`` (diffmm's
    defaults), or ``'auto'``: official for files written by the official code (SLIP format: ``best_acc1`` or DDP's
    ``module.`` prefix), diffmm's defaults for a bare state dict (diffmm's own ``DiffCLIP`` has the same layout)."""
    path = Path(path)
    sd = mha_text_to_diffmm(_read_sd(path, trust_pickle), source=str(path))
    cfg = infer_official_config(sd, lambda_init=lambda_init, source=str(path))
    if preprocess not in ("auto", "official", "openai"):
        raise ValueError(f"preprocess {preprocess!r}; expected auto, official or openai")
    if preprocess == "official" or (preprocess == "auto" and _written_by_official_code(path)):
        set_official_preprocessing(cfg)
    return sd, cfg, "clip"


def _written_by_official_code(path: Path) -> bool:
    keys = peek_keys(path)
    return "best_acc1" in keys or any(k.startswith("module.") for k in keys)


def set_official_preprocessing(cfg) -> None:
    """The official DiffCLIP preprocessing on a config: ImageNet mean/std and the official tokenizer truncation."""
    from diffmm.models.clip.config import IMAGENET_MEAN, IMAGENET_STD

    cfg.vision_cfg.image_mean, cfg.vision_cfg.image_std = IMAGENET_MEAN, IMAGENET_STD
    cfg.text_cfg.truncate = "cut"


def _detect_timm(path: Path) -> bool:
    if path.is_dir():
        return False
    keys = peek_keys(path)
    return "patch_embed.proj.weight" in keys and "blocks.0.norm1.weight" in keys


def _read_timm(path, *, trust_pickle: bool = False, head_width: Optional[int] = None, norm_eps: float = 1e-6,
               lambda_init: str | float = "depth", **unused):
    path = Path(path)
    sd = timm_vit_to_diffmm(_read_sd(path, trust_pickle), prefix="", source=str(path))
    cfg = infer_timm_vit_config(sd, head_width=head_width, norm_eps=norm_eps, lambda_init=lambda_init,
                                source=str(path))
    return sd, cfg, "visual"


SOURCES = [
    ClipSource("open_clip", _detect_open_clip, _read_open_clip,
               "open_clip CLIP checkpoint file, or a folder / local-dir: with open_clip_config.json"),
    ClipSource("diffclip_official", _detect_official, _read_official,
               "official DiffCLIP checkpoint (checkpoint_best.pt with trust_pickle=True, or a safetensors state dict)"),
    ClipSource("timm_vit", _detect_timm, _read_timm, "timm VisionTransformer state dict (image tower only)"),
]


def _source_of(path: Path) -> ClipSource:
    raise_if_damaged(path)  # a damaged file names itself instead of "not recognised"
    for src in SOURCES:
        if src.detect(path):
            return src
    raise ValueError(f"{path}: not a recognised CLIP checkpoint ({', '.join(s.name for s in SOURCES)}, "
                     f"diffmm export)")


# ------------------------------------------------------------------------------------------- hf-hub
def network_available(host: Optional[str] = None, timeout: float = 3.0) -> bool:
    """Whether the Hugging Face endpoint accepts a TCP connection (False when HF_HUB_OFFLINE is set)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return False
    host = host or os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_hf_hub(name: str) -> Path:
    """``hf-hub:org/repo`` -> a local snapshot folder (the Hugging Face cache first, then the network)."""
    repo = name[len(HF_HUB):]
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise RuntimeError(f"{name}: hf-hub names need the huggingface_hub package") from None
    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except Exception:  # not cached
        pass
    if not network_available():
        raise ConnectionError(f"{name}: not in the local Hugging Face cache and huggingface.co is not reachable "
                              f"(no network); download the folder elsewhere and load it with local-dir:PATH")
    return Path(snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt"]))


# ---------------------------------------------------------------------------------------------- loading
def resolve_location(path) -> Path:
    """A file or folder path, ``local-dir:PATH`` or ``hf-hub:ORG/REPO`` -> an existing local path."""
    s = str(path)
    if s.startswith(HF_HUB):
        return resolve_hf_hub(s)
    p = _local(s)
    if not p.exists():
        raise FileNotFoundError(f"{s}: no such file or folder")
    return p


def read_clip_weights(path, **kw) -> tuple[dict[str, torch.Tensor], Any, str, str]:
    """``(state dict in diffmm layout, config or None, towers, source name)`` of any supported CLIP checkpoint."""
    from diffmm.hub.diffmm_export import CONFIG, WEIGHTS

    p = resolve_location(path)
    kind = _export_kind(p)
    if kind is not None:
        from diffmm.hub.checkpoint import read_safetensors
        from diffmm.models.clip.config import CLIPConfig

        if kind != "clip":
            raise ValueError(f"{p}: a diffmm export of kind {kind!r}, not 'clip'")
        cfg = CLIPConfig.from_dict(json.loads((p / CONFIG).read_text())["config"], source=str(p / CONFIG))
        return read_safetensors(p / WEIGHTS), cfg, "clip", "diffmm_export"
    src = _source_of(p)
    sd, cfg, towers = src.read(p, **kw)
    return sd, cfg, towers, src.name


def _export_kind(p: Path) -> Optional[str]:
    """The ``kind`` of a diffmm export folder, or None if ``p`` is not one."""
    from diffmm.hub.diffmm_export import CONFIG, MARKER, WEIGHTS

    if not (p.is_dir() and (p / CONFIG).is_file() and (p / WEIGHTS).is_file()):
        return None
    try:
        info = json.loads((p / CONFIG).read_text()).get(MARKER)
    except ValueError:
        return None
    return info.get("kind") if isinstance(info, dict) else None


def _strict_load(module: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    check_state_dict(sd, module.state_dict(), source=source)  # shapes and dtype kinds
    module.load_state_dict(sd, strict=True)


def load_weights_into(model: nn.Module, path, *, trust_pickle: bool = False, **kw) -> nn.Module:
    """Load a checkpoint into an existing ``DiffCLIP`` (strict; a timm ViT checkpoint fills only ``visual``)."""
    load_weights_and_config(model, path, trust_pickle=trust_pickle, **kw)
    return model


def load_weights_and_config(model: nn.Module, path, *, trust_pickle: bool = False, **kw) -> tuple[str, Any]:
    """:func:`load_weights_into`, returning ``(source name, the config the file describes or None)``."""
    sd, cfg, towers, name = read_clip_weights(path, trust_pickle=trust_pickle, need_config=False, **kw)
    target = model.visual if towers == "visual" else model
    where = f"{path} ({name}, image tower)" if towers == "visual" else f"{path} ({name})"
    check_attention_types(target, sd, where)
    _strict_load(target, sd, where)
    return name, cfg


def check_attention_types(model: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """One-line error when standard-attention weights meet differential layers (or the reverse), before the strict
    load would list every lambda key as missing."""
    def differential(keys) -> bool:
        return any(k.endswith("attn.lambda_q1") for k in keys)

    model_diff, file_diff = differential(model.state_dict()), differential(sd)
    if model_diff and not file_diff:
        raise ValueError(f"{source} holds standard-attention weights, but the model has differential attention; to "
                         f"start a DiffCLIP from a standard CLIP, load the file into the standard model it came from "
                         f"(e.g. model_name OpenCLIP-Tiny / CLIP-Tiny / open_clip:NAME) and convert it with "
                         f"swap: {{init: upcycle}} (CLIPModule or diffmm.create_model(..., swap=...)), or call "
                         f"diffmm.swap_attention(model, init='upcycle')")
    if file_diff and not model_diff:
        raise ValueError(f"{source} holds differential-attention weights (lambda vectors), but the model has standard "
                         f"attention; load it into a DiffCLIP config, or pass the file itself as the model")


def read_state_dict(path, *, trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint file's state dict as saved (unwrapped from ``state_dict`` / ``model``; ``module.`` stripped)."""
    return _read_sd(Path(path), trust_pickle)


def strict_load(module: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """Load ``sd`` into ``module``: one error naming missing, unexpected and mis-shaped keys, else a strict load."""
    _strict_load(module, sd, source)


def load_clip(path, *, trust_pickle: bool = False, overrides: Optional[dict] = None, source: Optional[str] = None,
              **kw) -> nn.Module:
    """Build the model a checkpoint describes and load it strictly: a ``DiffCLIP`` (or, for a timm ViT file,
    diffmm's ``VisionTransformer``). ``overrides`` are config fields (e.g. ``attn_backend``)."""
    from diffmm.models.clip.model import DiffCLIP
    from diffmm.models.clip.vision import VisionTransformer

    if source is not None:
        p = resolve_location(path)
        src = next(s for s in SOURCES if s.name == source)
        sd, cfg, towers = src.read(p, trust_pickle=trust_pickle, **kw)
        name = src.name
    else:
        export_kind = _export_kind(resolve_location(path))
        if export_kind not in (None, "clip"):  # e.g. an LM export behind local-dir: / hf-hub:
            from diffmm.hub.diffmm_export import load_export

            return load_export(resolve_location(path), **(overrides or {}))
        sd, cfg, towers, name = read_clip_weights(path, trust_pickle=trust_pickle, **kw)
    if towers == "visual":
        overrides = dict(overrides or {})
        backend = overrides.pop("attn_backend", None)
        model = VisionTransformer(dataclasses.replace(cfg, **overrides), backend)
    else:
        if overrides:
            cfg = cfg.replace(**overrides)
        model = DiffCLIP(cfg)
    _strict_load(model, sd, f"{path} ({name})")
    return model.eval()


# ------------------------------------------------------------------------------------ diffmm export + registry
def _clip_config(model) -> dict[str, Any]:
    return model.config.to_dict()


def _clip_build(config: dict[str, Any]):
    from diffmm.models.clip.config import CLIPConfig
    from diffmm.models.clip.model import DiffCLIP

    return DiffCLIP(CLIPConfig.from_dict(config, source="diffmm export config"))


class _DiffCLIPMeta(type):
    def __instancecheck__(cls, obj) -> bool:
        mod = sys.modules.get("diffmm.models.clip.model")
        return mod is not None and isinstance(obj, mod.DiffCLIP)


class DiffCLIPRef(metaclass=_DiffCLIPMeta):
    """``isinstance(m, DiffCLIPRef)`` is ``isinstance(m, DiffCLIP)`` without importing the model package (which
    imports timm and open_clip) when this module is imported by ``diffmm.load_pretrained``."""


def _register() -> None:
    from diffmm.hub.diffmm_export import register_export_kind

    register_export_kind("clip", DiffCLIPRef, _clip_config, _clip_build)
    for src in SOURCES:
        register_format(CheckpointFormat(src.name, src.detect,
                                         lambda path, _s=src.name, **kw: load_clip(path, source=_s, **kw),
                                         src.description))
    register_format(CheckpointFormat(
        "clip_location", lambda p: str(p).startswith((LOCAL_DIR, HF_HUB)), load_clip,
        "local-dir:FOLDER or hf-hub:ORG/REPO holding an open_clip folder or a diffmm CLIP export"))


_register()
