"""``swap_attention``: convert, in place, the attention layers of an existing model to another attention type.

Supported models: open_clip ``CLIP`` and ``CustomTextCLIP`` (ViT image tower on ``nn.MultiheadAttention`` or
open_clip's ``Attention``; a timm image tower through ``TimmModel``; the text Transformer), a timm
``VisionTransformer``, and diffmm's own ``DiffCLIP`` / ``VisionTransformer``.

Two initialisations:

- ``init='scratch'``: a fresh layer of ``attn_type`` with its own (the paper's) init; the pretrained attention
  weights are dropped.
- ``init='upcycle'``: a function-preserving layer built from the pretrained weights (``diffmm.models.upcycle``),
  so the swapped model's outputs at step 0 equal the original's.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch
import torch.nn as nn

from diffmm.models.attn_adapters import adapt, register_known_layers
from diffmm.models.upcycle import StdAttnWeights, upcycle
from diffmm.nn import ATTENTION_LAYERS, create_attention
from diffmm.nn.attention import Attention as DiffmmAttention

INITS = ("scratch", "upcycle")
register_known_layers()
Layers = Union[None, int, Sequence[int], dict]


def _open_clip_attention_cls():
    try:
        from open_clip.transformer import Attention
        return Attention
    except ImportError:  # pragma: no cover
        return None


def _timm_attention_cls():
    try:
        from timm.layers import Attention
        return Attention
    except ImportError:  # pragma: no cover
        return None


def extract_weights(layer: nn.Module, where: str) -> tuple[StdAttnWeights, str, dict]:
    """Weights of a standard self-attention layer, its call convention and adapter attributes.

    Raises a one-line error naming ``where`` for layers that are not plain multi-head self-attention.
    """
    oc_attn, timm_attn = _open_clip_attention_cls(), _timm_attention_cls()
    if isinstance(layer, nn.MultiheadAttention):
        if not layer._qkv_same_embed_dim or layer.bias_k is not None or layer.add_zero_attn:
            raise ValueError(f"{where}: nn.MultiheadAttention with separate kdim/vdim, bias_k/bias_v or "
                             f"add_zero_attn cannot be swapped")
        q, k, v = layer.in_proj_weight.chunk(3)
        bq, bk, bv = layer.in_proj_bias.chunk(3) if layer.in_proj_bias is not None else (None, None, None)
        w = StdAttnWeights(q, k, v, layer.out_proj.weight, bq, bk, bv, layer.out_proj.bias, layer.num_heads)
        return w, "mha", {"batch_first": layer.batch_first, "mask_heads": layer.num_heads}
    if oc_attn is not None and isinstance(layer, oc_attn):
        extras = [n for n, on in (("scaled_cosine", layer.logit_scale is not None),
                                  ("scale_heads", layer.head_scale is not None),
                                  ("qk_norm", not isinstance(layer.ln_q, nn.Identity)),
                                  ("inner_norm", not isinstance(layer.ln_inner, nn.Identity))) if on]
        if extras:
            raise ValueError(f"{where}: open_clip Attention with {', '.join(extras)} cannot be swapped")
        q, k, v = layer.in_proj_weight.chunk(3)
        bq, bk, bv = layer.in_proj_bias.chunk(3) if layer.in_proj_bias is not None else (None, None, None)
        w = StdAttnWeights(q, k, v, layer.out_proj.weight, bq, bk, bv, layer.out_proj.bias, layer.num_heads)
        return w, "open_clip", {"mask_heads": layer.num_heads}
    if timm_attn is not None and type(layer) is timm_attn:
        extras = [n for n, on in (("qk_norm", not isinstance(layer.q_norm, nn.Identity)),
                                  ("scale_norm", not isinstance(layer.norm, nn.Identity)),
                                  ("gated", getattr(layer, "gate", None) is not None),
                                  ("dim_out != dim", layer.proj.out_features != layer.qkv.in_features)) if on]
        if extras:
            raise ValueError(f"{where}: timm Attention with {', '.join(extras)} cannot be swapped")
        q, k, v = layer.qkv.weight.chunk(3)
        bq, bk, bv = layer.qkv.bias.chunk(3) if layer.qkv.bias is not None else (None, None, None)
        w = StdAttnWeights(q, k, v, layer.proj.weight, bq, bk, bv, layer.proj.bias, layer.num_heads)
        return w, "timm", {"mask_heads": layer.num_heads}
    if isinstance(layer, DiffmmAttention):
        if layer.num_kv_heads != layer.num_heads or layer.use_rope:
            raise ValueError(f"{where}: GQA / RoPE standard attention is not supported by swap_attention")
        w = StdAttnWeights(layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.out_proj.weight,
                           layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias, layer.out_proj.bias,
                           layer.num_heads, causal=layer.causal)
        return w, getattr(layer, "convention", "native"), {"mask_heads": getattr(layer, "mask_heads", None)}
    raise TypeError(f"{where}: {type(layer).__name__} is not a standard self-attention layer that swap_attention "
                    f"can read (nn.MultiheadAttention, open_clip Attention, timm Attention, diffmm Attention)")


def find_towers(model: nn.Module) -> dict[str, list[nn.Module]]:
    """Tower name -> its Transformer blocks (each with an ``.attn``), for every model type swap supports."""
    from diffmm.models.clip.model import DiffCLIP
    from diffmm.models.clip.vision import VisionTransformer as DiffmmViT

    towers: dict[str, list[nn.Module]] = {}
    if isinstance(model, DiffCLIP):
        return {"visual": list(model.visual.blocks), "text": list(model.transformer.resblocks)}
    if isinstance(model, DiffmmViT):
        return {"visual": list(model.blocks)}
    if _is_timm_vit(model):
        return {"visual": list(model.blocks)}
    visual = getattr(model, "visual", None)
    if visual is not None:
        towers["visual"] = _image_tower_blocks(visual)
    if hasattr(model, "text") and isinstance(model.text, nn.Module):  # CustomTextCLIP
        tr = getattr(model.text, "transformer", None)
        if tr is None or not hasattr(tr, "resblocks"):
            raise TypeError(f"text tower {type(model.text).__name__} has no Transformer blocks to swap "
                            f"(HF text towers are not supported)")
        towers["text"] = list(tr.resblocks)
    elif hasattr(getattr(model, "transformer", None), "resblocks"):  # CLIP keeps the text tower at top level
        towers["text"] = list(model.transformer.resblocks)
    if not towers and hasattr(getattr(model, "transformer", None), "resblocks"):
        towers["visual"] = list(model.transformer.resblocks)  # a bare open_clip VisionTransformer
    if not towers:
        raise TypeError(f"swap_attention does not know where the attention blocks of {type(model).__name__} are")
    return towers


def _is_timm_vit(m: nn.Module) -> bool:
    return hasattr(m, "blocks") and hasattr(m, "patch_embed") and type(m).__module__.startswith("timm.")


def _image_tower_blocks(visual: nn.Module) -> list[nn.Module]:
    trunk = getattr(visual, "trunk", None)  # open_clip TimmModel
    if trunk is not None:
        if not hasattr(trunk, "blocks"):
            raise TypeError(f"timm image tower {type(trunk).__name__} has no .blocks to swap")
        return list(trunk.blocks)
    if hasattr(getattr(visual, "transformer", None), "resblocks"):
        return list(visual.transformer.resblocks)
    raise TypeError(f"image tower {type(visual).__name__} has no Transformer blocks to swap (ResNet towers have none)")


def _resolve_layers(layers: Layers, tower: str, n: int) -> list[int]:
    if isinstance(layers, dict):
        layers = layers.get(tower)
    if layers is None:
        return list(range(n))
    idx = [layers] if isinstance(layers, int) else list(layers)
    out = []
    for i in idx:
        if not -n <= i < n:
            raise IndexError(f"layer {i} is out of range for the {tower} tower ({n} layers)")
        out.append(i % n)
    return sorted(set(out))


def _build(w: StdAttnWeights, attn_type: str, init: str, *, layer_idx: int, lambda_init, backend,
           generator) -> nn.Module:
    if init == "upcycle":
        return upcycle(w, attn_type, layer_idx=layer_idx, lambda_init=lambda_init, backend=backend,
                       generator=generator)
    return create_attention(attn_type, w.dim, w.num_heads, layer_idx=layer_idx, lambda_init=lambda_init,
                            causal=w.causal, qkv_bias=w.qkv_bias, proj_bias=w.proj_bias, backend=backend)


def swap_attention(model: nn.Module, *, towers: Union[None, str, Iterable[str]] = None, layers: Layers = None,
                   init: str = "scratch", attn_type: str = "diff", lambda_init: Union[str, float] = "constant",
                   backend: Optional[str] = None, generator: Optional[torch.Generator] = None) -> nn.Module:
    """Replace the attention of chosen towers and layers, in place; returns ``model``.

    Args:
        model: open_clip ``CLIP`` / ``CustomTextCLIP`` (ViT or timm image tower), timm ViT, or diffmm ``DiffCLIP``.
        towers: ``'visual'`` and/or ``'text'``; default: every tower the model has (a timm ViT has only
            ``'visual'``). Naming a tower the model lacks is an error.
        layers: None (all), an index, a list (negative counts from the end), or ``{tower: indices}``.
        init: ``'scratch'`` (the new layer's own init) or ``'upcycle'`` (function-preserving).
        attn_type: a registered attention type (``'diff'``, ``'diff_v2'``, ``'standard'``, ...). With
            ``init='upcycle'``, ``'diff'`` builds :class:`diffmm.models.upcycle.UpcycledDiffAttention`.
        lambda_init: ``'constant'`` (0.8, DiffCLIP), ``'depth'`` (by the index within the tower) or a number.
        backend: attention backend of the new layers (default: the replaced diffmm layer's, else automatic).
        generator: RNG for the upcycled layers' random parts.
    """
    if init not in INITS:
        raise ValueError(f"init {init!r}; expected one of {', '.join(INITS)}")
    if attn_type not in ATTENTION_LAYERS:
        raise ValueError(f"unknown attention type {attn_type!r}; expected one of {', '.join(ATTENTION_LAYERS)}")
    found = find_towers(model)
    towers = list(found) if towers is None else [towers] if isinstance(towers, str) else list(towers)
    missing = [t for t in towers if t not in found]
    if missing:
        raise ValueError(f"{type(model).__name__} has no {', '.join(missing)} tower; it has: {', '.join(found)}")
    record = []
    for tower in towers:
        blocks = found[tower]
        idx = _resolve_layers(layers, tower, len(blocks))
        for i in idx:
            old = blocks[i].attn
            where = f"{tower} layer {i} ({type(old).__name__})"
            w, convention, attrs = extract_weights(old, where)
            ref = old.out_proj.weight if hasattr(old, "out_proj") else old.proj.weight
            new = _build(w, attn_type, init, layer_idx=i, lambda_init=lambda_init,
                         backend=backend if backend is not None else getattr(old, "backend", None),
                         generator=generator)
            new = adapt(new.to(device=ref.device, dtype=ref.dtype), convention,
                        **{k: v for k, v in attrs.items() if v is not None})
            new.train(old.training)
            blocks[i].attn = new
        record.append({"tower": tower, "layers": idx, "init": init, "attn_type": attn_type,
                       "lambda_init": lambda_init})
    _update_config(model, record)
    model.diffmm_swaps = getattr(model, "diffmm_swaps", []) + record
    return model


def _update_config(model: nn.Module, record: list[dict]) -> None:
    """Keep a DiffCLIP's config describing its layers, so an export of the swapped model reloads."""
    from diffmm.models.clip.config import layer_attn_types
    from diffmm.models.clip.model import DiffCLIP
    from diffmm.models.upcycle import UPCYCLED

    if not isinstance(model, DiffCLIP):
        return
    for r in record:
        cfg = model.config.vision_cfg if r["tower"] == "visual" else model.config.text_cfg
        types = layer_attn_types(cfg)
        new_type = UPCYCLED if (r["init"] == "upcycle" and r["attn_type"] == "diff") else r["attn_type"]
        for i in r["layers"]:
            types[i] = new_type
        cfg.attn_type = types[0] if len(set(types)) == 1 else types
        cfg.lambda_init = r["lambda_init"]
