"""Weights a checkpoint names instead of storing: a locked pretrained tower, by its source and a SHA-256 of its weights.

A LiT run (:class:`diffmm.train.LiTModule` with ``save_locked: false``) trains a projection against a tower that
never changes; its checkpoints hold what trained and a list under :data:`WEIGHT_REFS_KEY` of
``{"source", "keys", "sha256"}`` entries. :func:`restore_weights` puts the named weights back from a model built from
the checkpoint's config with its pretrained towers (what :func:`diffmm.create_model` builds for that config) and
checks the hash, so a changed source is an error, not a silently different model.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
from typing import Mapping, Optional

import torch
import torch.nn as nn

from diffmm.models.clip.hf_text import PACKAGED_MODELS

#: checkpoint entry: the references of the weights left out of its state dict
WEIGHT_REFS_KEY = "diffmm_weight_refs"


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a tensor of any dtype (bf16 has no numpy type)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of named tensors: names, shapes, dtypes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def _with_version(name: str, dist: str) -> str:
    try:
        return f"{name} (pip {dist} {importlib.metadata.version(dist)})"
    except (importlib.metadata.PackageNotFoundError, ValueError):  # not an installed distribution (a file path)
        return name


def pretrained_source(model: nn.Module, tower: str) -> Optional[str]:
    """Where the ``'text'`` or ``'visual'`` tower of a diffmm CLIP built from its config takes its weights from
    (``text_cfg.hf_model_name`` / ``vision_cfg.pretrained``, with the pip package and version that ship them), or
    None when it starts from random weights."""
    cfg = getattr(model, "config", None)
    if tower == "text":
        name = getattr(getattr(cfg, "text_cfg", None), "hf_model_name", None)
        if not name:
            return None
        packaged = PACKAGED_MODELS.get(name)
        return _with_version(f"text_cfg.hf_model_name {name}", packaged[2] if packaged else name)
    name = getattr(getattr(cfg, "vision_cfg", None), "pretrained", None)
    return _with_version(f"vision_cfg.pretrained {name}", name) if name else None


def weight_reference(tensors: Mapping[str, torch.Tensor], source: str) -> dict:
    """The reference that stands for ``tensors`` (state-dict names relative to the model) in a checkpoint."""
    return {"source": source, "keys": sorted(tensors), "sha256": weights_digest(tensors)}


def restore_weights(state_dict: dict[str, torch.Tensor], refs: Optional[list[dict]],
                    model_state: Mapping[str, torch.Tensor], *, prefix: str = "", where: str = "checkpoint"
                    ) -> dict[str, torch.Tensor]:
    """``state_dict`` with the weights ``refs`` name put back (in place; also returned), taken from ``model_state``:
    the state dict of a model built from the checkpoint's config with its pretrained towers. Keys of
    ``state_dict`` carry ``prefix`` (``"model."`` in a Lightning checkpoint). A one-line error when the model lacks a
    key or its weights are not the ones the checkpoint was saved with."""
    for ref in refs or ():
        missing = [k for k in ref["keys"] if k not in model_state]
        if missing:
            raise KeyError(f"{where}: {ref['source']} gives no {missing[0]} ({len(missing)} of the "
                           f"{len(ref['keys'])} weights it stands for are missing)")
        tensors = {k: model_state[k] for k in ref["keys"]}
        got = weights_digest(tensors)
        if got != ref["sha256"]:
            raise ValueError(f"{where}: {ref['source']} now gives other weights than the checkpoint was saved with "
                             f"(sha256 {got[:12]}..., saved {ref['sha256'][:12]}...); install the version it names")
        state_dict.update({prefix + k: t for k, t in tensors.items()})
    return state_dict
