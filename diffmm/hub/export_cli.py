"""``diffmm export CHECKPOINT OUT``: write a diffmm export folder (``config.json`` + ``model.safetensors``).

CHECKPOINT is a Lightning ``.ckpt`` from ``diffmm fit`` (the model is rebuilt from its saved
``model_name`` / ``model_kwargs`` hyper-parameters, or from ``--model`` / ``--model-config``, and its
``model.*`` weights are loaded strictly), or any file or folder ``diffmm.load_pretrained`` reads (official
DiffCLIP ``checkpoint_best.pt`` with ``--trust-pickle``, open_clip files and ``local-dir:`` folders, ...).

Examples::

    diffmm export lightning_logs/version_0/checkpoints/last.ckpt exports/diffclip-tiny
    diffmm export checkpoint_best.pt exports/diffclip-b16 --trust-pickle
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

LIGHTNING_MARKERS = ("pytorch-lightning_version", "hyper_parameters")


def _is_lightning(path: Path) -> bool:
    from diffmm.hub.clip_formats import peek_keys

    return path.is_file() and any(m in peek_keys(path) for m in LIGHTNING_MARKERS)


def _build_clip(hp: dict[str, Any], sd: dict, model_name: Optional[str], model_config: Optional[str]) -> nn.Module:
    from diffmm.models.clip import DiffCLIP, create_model, load_config_file

    if model_config:
        return DiffCLIP(load_config_file(model_config))
    name = model_name or hp.get("model_name")
    if not name:
        raise ValueError("the checkpoint saves no model_name; pass --model NAME or --model-config FILE")
    kwargs = {k: v for k, v in (hp.get("model_kwargs") or {}).items() if k not in ("pretrained", "device")}
    return create_model(name, **kwargs)


def _build_lm(hp: dict[str, Any], sd: dict, model_name: Optional[str], model_config: Optional[str]) -> nn.Module:
    from diffmm.models.lm import DiffLM, LMConfig

    if model_config:
        return DiffLM(LMConfig.from_dict(json.loads(Path(model_config).read_text()), source=model_config))
    name = model_name or hp.get("model_name")
    if not name:
        raise ValueError("the checkpoint saves no model_name; pass --model NAME or --model-config FILE")
    overrides = dict(hp.get("model_kwargs") or {})
    if "wte.weight" in sd:  # the training module pads the tokenizer's vocabulary
        overrides.setdefault("vocab_size", sd["wte.weight"].shape[0])
    return DiffLM(LMConfig.from_name(name, **overrides))


BUILDERS = {"clip": _build_clip, "lm": _build_lm}


def model_from_lightning(path: Path, *, kind: Optional[str] = None, prefix: str = "model.",
                         model_name: Optional[str] = None, model_config: Optional[str] = None,
                         trust_pickle: bool = False) -> nn.Module:
    """Rebuild the model of a Lightning checkpoint and load its ``prefix``-ed weights strictly."""
    from diffmm.hub.checkpoint import check_state_dict, load_state_file

    ckpt = load_state_file(path, trust_pickle=trust_pickle)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"{path}: not a Lightning checkpoint (no 'state_dict')")
    sd = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    if not sd:
        raise KeyError(f"{path}: no weights under the prefix {prefix!r} (use --prefix)")
    hp = ckpt.get("hyper_parameters") or {}
    if kind is None:
        kind = "clip" if ("image_projection" in sd or "visual.patch_embed.proj.weight" in sd) else "lm"
    model = BUILDERS[kind](hp, sd, model_name, model_config)
    check_state_dict(sd, model.state_dict(), source=str(path))  # shapes and dtype kinds
    model.load_state_dict(sd, strict=True)
    return model.eval()


def export(checkpoint: str, out: str, *, kind: Optional[str] = None, prefix: str = "model.",
           model_name: Optional[str] = None, model_config: Optional[str] = None, trust_pickle: bool = False,
           dtype: Optional[str] = None) -> Path:
    """Write the export folder ``out`` from ``checkpoint``; returns the folder."""
    import diffmm
    from diffmm.hub.diffmm_export import save_export

    path = Path(checkpoint)
    if _is_lightning(path):
        model = model_from_lightning(path, kind=kind, prefix=prefix, model_name=model_name,
                                     model_config=model_config, trust_pickle=trust_pickle)
    else:
        model = diffmm.load_pretrained(checkpoint, trust_pickle=trust_pickle)
    if dtype:
        model = model.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    return save_export(model, out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="diffmm export",
                                description="Write a diffmm export folder (config.json + model.safetensors) from a "
                                            "Lightning checkpoint or any checkpoint diffmm.load_pretrained reads.")
    p.add_argument("checkpoint", help="Lightning .ckpt, or any checkpoint diffmm.load_pretrained reads")
    p.add_argument("out", help="export folder to write")
    p.add_argument("--kind", choices=sorted(BUILDERS), help="model kind of a Lightning checkpoint (default: by keys)")
    p.add_argument("--model", dest="model_name", help="model config name (default: the checkpoint's model_name)")
    p.add_argument("--model-config", help="JSON model config file (overrides --model)")
    p.add_argument("--prefix", default="model.", help="prefix of the model's keys in a Lightning state_dict")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="cast the weights before writing")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow checkpoints that need full unpickling (only for files you trust)")
    args = p.parse_args(argv)
    try:
        folder = export(args.checkpoint, args.out, kind=args.kind, prefix=args.prefix, model_name=args.model_name,
                        model_config=args.model_config, trust_pickle=args.trust_pickle, dtype=args.dtype)
    except (FileNotFoundError, PermissionError, KeyError, ValueError, TypeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"diffmm export: {msg}", file=sys.stderr)
        return 1
    print(f"wrote {folder}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
