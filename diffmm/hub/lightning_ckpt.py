"""Lightning checkpoints from ``diffmm fit`` as a checkpoint format: ``diffmm.load_pretrained(PATH)``,
``diffmm.create_model(PATH)``, ``diffmm eval --model PATH``, ``diffmm classify --model PATH``, ``diffmm export``.

The file is read with ``torch.load(weights_only=True)``: tensors and plain containers only (plus ``pathlib``
paths, which hyper-parameters may hold); no code in the pickle runs. The model is rebuilt without the training
code, from (first match):

1. ``diffmm_model_config`` (``CLIPModule`` writes the config of diffmm's ``DiffCLIP`` into every checkpoint, swapped
   layers and preprocessing included): ``DiffCLIP(config)``;
2. the hyper-parameters ``model_name`` / ``model_kwargs`` / ``swap`` of ``CLIPModule`` (models that open_clip builds):
   ``diffmm.create_model(model_name, swap=swap, **model_kwargs)`` without the ``pretrained`` weights;
3. the hyper-parameters ``model_name`` / ``model_kwargs`` of ``LMModule``: ``DiffLM``;

then its ``model.*`` weights load strictly (one error naming missing, unexpected and mis-shaped keys).
"""
from __future__ import annotations

import os
import pathlib
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from diffmm.hub.checkpoint import check_state_dict, load_state_file
from diffmm.hub.formats import CheckpointFormat, register_format

LIGHTNING_MARKERS = ("pytorch-lightning_version", "hyper_parameters")
#: checkpoint entry holding the ``CLIPConfig`` dict of a ``DiffCLIP`` (written by ``CLIPModule``)
MODEL_CONFIG_KEY = "diffmm_model_config"
#: classes besides tensors and plain containers a Lightning checkpoint may hold (hyper-parameter paths)
SAFE_GLOBALS = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)


def is_lightning_checkpoint(path: str | os.PathLike) -> bool:
    """True for a torch file with Lightning's top-level entries (read without unpickling)."""
    from diffmm.hub.clip_formats import peek_keys

    p = Path(str(path))
    return p.is_file() and any(m in peek_keys(p) for m in LIGHTNING_MARKERS)


def read_lightning(path: str | os.PathLike, *, prefix: str = "model.", trust_pickle: bool = False
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """``(hyper-parameters, the model's state dict with prefix removed, the whole checkpoint)``."""
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        ckpt = load_state_file(path, trust_pickle=trust_pickle)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"{path}: not a Lightning checkpoint (no 'state_dict')")
    sd = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    if not sd:
        raise KeyError(f"{path}: no weights under the prefix {prefix!r} (export: use --prefix)")
    return dict(ckpt.get("hyper_parameters") or {}), sd, ckpt


def _kind(sd: dict[str, torch.Tensor]) -> str:
    return "clip" if ("logit_scale" in sd or any(k.startswith("visual.") for k in sd)) else "lm"


def _build_clip(path: str, ckpt: dict, hp: dict, sd: dict, model_name: Optional[str],
                model_config: Optional[str]) -> nn.Module:
    from diffmm.models.clip import DiffCLIP, create_model, load_config_file
    from diffmm.models.clip.config import CLIPConfig

    if model_config:
        return DiffCLIP(load_config_file(model_config))
    if model_name is None and isinstance(ckpt.get(MODEL_CONFIG_KEY), dict):
        return DiffCLIP(CLIPConfig.from_dict(ckpt[MODEL_CONFIG_KEY], source=f"{path}: {MODEL_CONFIG_KEY}"))
    name = model_name or hp.get("model_name")
    if not name:
        raise ValueError(f"{path}: the checkpoint saves no model_name (a model passed as a Python object); "
                         f"name the architecture (export: --model NAME or --model-config FILE)")
    kwargs = {k: v for k, v in (hp.get("model_kwargs") or {}).items() if k not in ("pretrained", "device")}
    return create_model(name, swap=hp.get("swap"), **kwargs)


def _build_lm(path: str, ckpt: dict, hp: dict, sd: dict, model_name: Optional[str],
              model_config: Optional[str]) -> nn.Module:
    import json

    from diffmm.models.lm import DiffLM, LMConfig

    if model_config:
        return DiffLM(LMConfig.from_dict(json.loads(Path(model_config).read_text()), source=model_config))
    name = model_name or hp.get("model_name")
    if not name:
        raise ValueError(f"{path}: the checkpoint saves no model_name; export: pass --model NAME or "
                         f"--model-config FILE")
    overrides = dict(hp.get("model_kwargs") or {})
    if "wte.weight" in sd:  # the training module pads the tokenizer's vocabulary
        overrides.setdefault("vocab_size", sd["wte.weight"].shape[0])
    return DiffLM(LMConfig.from_name(name, **overrides))


BUILDERS = {"clip": _build_clip, "lm": _build_lm}


def load_lightning(path: str | os.PathLike, *, kind: Optional[str] = None, prefix: str = "model.",
                   model_name: Optional[str] = None, model_config: Optional[str] = None,
                   trust_pickle: bool = False, **unused: Any) -> nn.Module:
    """Rebuild the model of a Lightning checkpoint (see the module docstring) and load its weights strictly.

    Args:
        kind: ``'clip'`` or ``'lm'`` (default: by the keys).
        prefix: the model's prefix in the Lightning state dict.
        model_name / model_config: build this architecture instead of the checkpoint's own.
        trust_pickle: allow objects beyond tensors and plain containers (only for files you trust).
    """
    hp, sd, ckpt = read_lightning(path, prefix=prefix, trust_pickle=trust_pickle)
    kind = kind or _kind(sd)
    if kind not in BUILDERS:
        raise ValueError(f"kind {kind!r}; expected one of {', '.join(BUILDERS)}")
    model = BUILDERS[kind](str(path), ckpt, hp, sd, model_name, model_config)
    check_state_dict(sd, model.state_dict(), source=str(path))  # shapes and dtype kinds
    model.load_state_dict(sd, strict=True)
    return model.eval()


register_format(CheckpointFormat("lightning", is_lightning_checkpoint, load_lightning,
                                 "Lightning .ckpt from diffmm fit (model rebuilt from the checkpoint, weights only)"))
