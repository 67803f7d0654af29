"""``diffmm export CHECKPOINT OUT``: write a diffmm export folder (``config.json`` + ``model.safetensors``).

CHECKPOINT is a Lightning ``.ckpt`` from ``diffmm fit`` (the model is rebuilt from the checkpoint: the saved model
config, else its ``model_name`` / ``model_kwargs`` / ``swap`` hyper-parameters, or ``--model`` / ``--model-config``;
its ``model.*`` weights are loaded strictly), any file or folder ``diffmm.load_pretrained`` reads (official
DiffCLIP ``checkpoint_best.pt`` with ``--trust-pickle``, open_clip files and ``local-dir:`` folders, ...), or a
model name (``diffmm.create_model``'s rule) with ``--pretrained`` weights (without them: random weights, and a
warning).

Examples::

    diffmm export runs/diffclip-tiny-emoji/checkpoints/last.ckpt exports/diffclip-tiny
    diffmm export checkpoint_best.pt exports/diffclip-b16 --trust-pickle
    diffmm export OpenCLIP-ViT-B-16 exports/openclip-b16 --pretrained open_clip_model.safetensors
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional

import torch

from diffmm.hub.checkpoint import is_lightning_checkpoint
from diffmm.hub.diffmm_export import save_export
from diffmm.hub.factory import create_model, has_weights, load_lightning, random_weights_message

log = logging.getLogger("diffmm.hub")


def export(checkpoint: str, out: str, *, kind: Optional[str] = None, prefix: str = "model.",
           model_name: Optional[str] = None, model_config: Optional[str] = None, trust_pickle: bool = False,
           dtype: Optional[str] = None, pretrained: Optional[str] = None) -> Path:
    """Write the export folder ``out`` from ``checkpoint`` (a Lightning checkpoint, any file ``load_pretrained``
    reads, or a model name of :func:`diffmm.create_model` with ``pretrained``); returns the folder."""
    if is_lightning_checkpoint(checkpoint):
        model = load_lightning(checkpoint, kind=kind, prefix=prefix, model_name=model_name, model_config=model_config,
                               trust_pickle=trust_pickle)
    elif (model_name or model_config) and not pretrained:
        raise ValueError(f"{checkpoint}: --model / --model-config choose the architecture of a Lightning checkpoint; "
                         f"this is not one")
    else:  # a checkpoint, or a model name (diffmm.create_model's rule) with weights from --pretrained or none
        model = create_model(checkpoint, pretrained, trust_pickle=trust_pickle)
        if not has_weights(checkpoint, pretrained):
            log.warning(random_weights_message(checkpoint))
    if dtype:
        model = model.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    return save_export(model, out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="diffmm export",
                                description="Write a diffmm export folder (config.json + model.safetensors) from a "
                                            "Lightning checkpoint or any checkpoint diffmm.load_pretrained reads.")
    p.add_argument("checkpoint", help="Lightning .ckpt, any checkpoint diffmm.load_pretrained reads, or a model name "
                                      "(diffmm config, open_clip:NAME) with --pretrained")
    p.add_argument("out", help="export folder to write")
    p.add_argument("--pretrained", help="weights for a model name given as CHECKPOINT (any format diffmm loads)")
    p.add_argument("--kind", choices=("clip", "lm"), help="model kind of a Lightning checkpoint (default: by keys)")
    p.add_argument("--model", dest="model_name", help="model config name (default: the checkpoint's model_name)")
    p.add_argument("--model-config", help="JSON model config file (overrides --model)")
    p.add_argument("--prefix", default="model.", help="prefix of the model's keys in a Lightning state_dict")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="cast the weights before writing")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow checkpoints that need full unpickling (only for files you trust)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        folder = export(args.checkpoint, args.out, kind=args.kind, prefix=args.prefix, model_name=args.model_name,
                        model_config=args.model_config, trust_pickle=args.trust_pickle, dtype=args.dtype,
                        pretrained=args.pretrained)
    except (FileNotFoundError, PermissionError, KeyError, ValueError, TypeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"diffmm export: {msg}", file=sys.stderr)
        return 1
    print(f"wrote {folder}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
