"""Public API mirroring open_clip: ``create_model``, ``create_model_and_transforms``, ``get_tokenizer``,
``list_models`` (plus ``get_model_config`` / ``add_model_config``).

Model names are the JSON files of ``diffmm/model_configs`` (``DiffCLIP-ViT-B-16``, ``DiffCLIP-star-Tiny``,
``CLIP-Tiny``, ...), a path to such a JSON file, or ``local-dir:`` / ``hf-hub:`` names of saved models.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from diffmm.models.clip.config import CLIPConfig, load_config_file
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.clip.transforms import clip_transforms

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
                 **overrides: Any) -> torch.nn.Module:
    """Build a model by name and optionally load weights.

    Args:
        model_name: a config name (see :func:`list_models`), a JSON path, or ``local-dir:`` / ``hf-hub:`` name.
        pretrained: a checkpoint in any supported format (open_clip file or ``local-dir:``, timm, official
            DiffCLIP, diffmm export); loaded strictly after converting to diffmm's layout. A timm ViT
            checkpoint initialises only the image tower.
        device / precision: where (default: where it was built) and in which dtype (``fp32``, ``fp16``,
            ``bf16``) the weights live.
        output_dict: ``forward`` returns a dict.
        trust_pickle: allow checkpoints that need full unpickling (the official ``checkpoint_best.pt``).
        overrides: config fields (top level) or ``vision_cfg=dict(...)`` / ``text_cfg=dict(...)`` merged in.
    """
    if model_name.startswith(SAVED_PREFIXES):
        from diffmm.hub.clip_formats import load_clip

        model = load_clip(model_name, trust_pickle=trust_pickle, overrides=overrides or None)
    else:
        cfg = get_model_config(model_name)
        if overrides:
            cfg = cfg.replace(**overrides)
        model = DiffCLIP(cfg)
        if pretrained:
            from diffmm.hub.clip_formats import load_weights_into

            load_weights_into(model, pretrained, trust_pickle=trust_pickle)
    model.output_dict = output_dict
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    if dtype is None:
        raise ValueError(f"precision {precision!r}; expected fp32, fp16 or bf16")
    if device is not None:
        model = model.to(device=device)
    return model if dtype == torch.float32 else model.to(dtype=dtype)


def create_model_and_transforms(model_name: str, pretrained: Optional[str] = None, *,
                                image_mean: Optional[tuple] = None, image_std: Optional[tuple] = None,
                                aug_cfg: Optional[dict] = None, **kwargs: Any
                                ) -> tuple[torch.nn.Module, Callable, Callable]:
    """``(model, preprocess_train, preprocess_val)`` like open_clip; the image size comes from the config."""
    model = create_model(model_name, pretrained, **kwargs)
    train, val = clip_transforms(model.config.vision_cfg.image_size, mean=image_mean, std=image_std, aug_cfg=aug_cfg)
    return model, train, val


def get_tokenizer(model_name: Optional[str] = None, context_length: Optional[int] = None):
    """open_clip's CLIP BPE ``SimpleTokenizer`` (ships inside open_clip) with the model's context length.

    ``tokenizer(list_of_str) -> LongTensor (B, context_length)``; EOT is the largest id of each row.
    """
    from open_clip.tokenizer import SimpleTokenizer

    if context_length is None:
        if not model_name:
            context_length = 77
        elif model_name.startswith(SAVED_PREFIXES):
            context_length = _saved_context_length(model_name)
        else:
            context_length = get_model_config(model_name).text_cfg.context_length
    return SimpleTokenizer(context_length=context_length)


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
