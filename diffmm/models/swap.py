"""``swap_attention``: convert, in place, the attention layers of an existing model to another attention type.

Supported models (the table of blocks, layers read and call conventions: docs/models.md, ``swap_attention``):
open_clip ``CLIP`` / ``CustomTextCLIP`` (ViT, timm or text Transformer towers, a Hugging Face BERT-family text
tower), a timm ``VisionTransformer``, a Hugging Face BERT-family encoder, and diffmm's ``DiffCLIP`` /
``VisionTransformer``. ``init='scratch'``: a fresh layer of ``attn_type`` with the paper's init;
``init='upcycle'``: a function-preserving layer built from the pretrained weights (the type's ``upcycle_to`` and
``load_standard``, :class:`diffmm.nn.AttentionLayer`). The new layer is the adapter class of the replaced layer's
call convention (:mod:`diffmm.models.attn_adapters`), so the block calls it as it called the old one.
"""
from __future__ import annotations

import sys
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.nn as nn
from timm.layers import Attention as TimmAttention

from diffmm.models.attn_adapters import HFBertCall, adapter_class
from diffmm.models.clip.config import CLIPConfig, layer_attn_types
from diffmm.models.clip.vision import VisionTransformer as DiffmmViT
from diffmm.nn import UPCYCLE_TYPES, StdAttnWeights, get_attention_class
from diffmm.nn.attention import Attention as DiffmmAttention

INITS = ("scratch", "upcycle")
Layers = Union[None, int, Sequence[int], dict]


def _is_open_clip_attention(layer: nn.Module) -> bool:
    """Whether ``layer`` is open_clip's ``Attention``. Such a layer exists only once ``open_clip.transformer`` is
    imported, so this looks it up instead of importing open_clip (``import diffmm`` works without open_clip)."""
    oc = sys.modules.get("open_clip.transformer")
    return oc is not None and isinstance(layer, oc.Attention)


def _is_hf_bert_attention(layer: nn.Module) -> bool:
    """Whether ``layer`` is a Hugging Face BERT-family ``*Attention`` (``.self`` with query/key/value Linears and
    ``.output.dense``). Duck-typed, so ``import diffmm`` needs no transformers."""
    if not type(layer).__module__.startswith("transformers."):
        return False
    sa, out = getattr(layer, "self", None), getattr(layer, "output", None)
    return (all(isinstance(getattr(sa, n, None), nn.Linear) for n in ("query", "key", "value"))
            and isinstance(getattr(out, "dense", None), nn.Linear))


def _hf_encoder_layers(model: nn.Module) -> Optional[list[nn.Module]]:
    """The layers of a Hugging Face BERT-family encoder (``model.encoder.layer``), else None."""
    layers = getattr(getattr(model, "encoder", None), "layer", None)
    if layers is None or not type(model).__module__.startswith("transformers."):
        return None
    return list(layers)


def _hf_bert(layer: nn.Module, where: str) -> StdAttnWeights:
    """The weights of a Hugging Face ``BertAttention`` (q/k/v in ``.self``, the out-projection in ``.output``)."""
    sa, dense = layer.self, layer.output.dense
    heads, E = sa.num_attention_heads, dense.out_features
    problems = [n for n, on in (("cross-attention", getattr(layer, "is_cross_attention", False)),
                                ("all_head_size != hidden_size", sa.query.out_features != E),
                                ("scaling != head_dim ** -0.5",
                                 abs(getattr(sa, "scaling", (E // heads) ** -0.5) - (E // heads) ** -0.5) > 1e-12),
                                ("relative position embeddings",
                                 getattr(sa, "position_embedding_type", "absolute") != "absolute")) if on]
    if problems:
        raise ValueError(f"{where}: Hugging Face attention with {', '.join(problems)} cannot be swapped")
    return StdAttnWeights(sa.query.weight, sa.key.weight, sa.value.weight, dense.weight, sa.query.bias,
                          sa.key.bias, sa.value.bias, dense.bias, heads, causal=bool(getattr(sa, "is_causal", False)))


def _fused(qkv_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor], out: nn.Linear, heads: int) -> StdAttnWeights:
    """The weights of a layer with one fused (q, k, v) input projection (rows ordered q, k, v)."""
    q, k, v = qkv_weight.chunk(3)
    bq, bk, bv = qkv_bias.chunk(3) if qkv_bias is not None else (None, None, None)
    return StdAttnWeights(q, k, v, out.weight, bq, bk, bv, out.bias, heads)


def extract_weights(layer: nn.Module, where: str) -> tuple[StdAttnWeights, str, dict]:
    """Weights of a standard self-attention layer, its call convention and adapter attributes.

    Raises a one-line error naming ``where`` for layers that are not plain multi-head self-attention.
    """
    if isinstance(layer, nn.MultiheadAttention):
        if not layer._qkv_same_embed_dim or layer.bias_k is not None or layer.add_zero_attn:
            raise ValueError(f"{where}: nn.MultiheadAttention with separate kdim/vdim, bias_k/bias_v or "
                             f"add_zero_attn cannot be swapped")
        w = _fused(layer.in_proj_weight, layer.in_proj_bias, layer.out_proj, layer.num_heads)
        return w, "mha", {"batch_first": layer.batch_first, "mask_heads": layer.num_heads}
    if _is_open_clip_attention(layer):
        extras = [n for n, on in (("scaled_cosine", layer.logit_scale is not None),
                                  ("scale_heads", layer.head_scale is not None),
                                  ("qk_norm", not isinstance(layer.ln_q, nn.Identity)),
                                  ("inner_norm", not isinstance(layer.ln_inner, nn.Identity))) if on]
        if extras:
            raise ValueError(f"{where}: open_clip Attention with {', '.join(extras)} cannot be swapped")
        w = _fused(layer.in_proj_weight, layer.in_proj_bias, layer.out_proj, layer.num_heads)
        return w, "open_clip", {"mask_heads": layer.num_heads}
    if type(layer) is TimmAttention:
        extras = [n for n, on in (("qk_norm", not isinstance(layer.q_norm, nn.Identity)),
                                  ("scale_norm", not isinstance(layer.norm, nn.Identity)),
                                  ("gated", getattr(layer, "gate", None) is not None),
                                  ("dim_out != dim", layer.proj.out_features != layer.qkv.in_features)) if on]
        if extras:
            raise ValueError(f"{where}: timm Attention with {', '.join(extras)} cannot be swapped")
        w = _fused(layer.qkv.weight, layer.qkv.bias, layer.proj, layer.num_heads)
        return w, "timm", {"mask_heads": layer.num_heads}
    if _is_hf_bert_attention(layer):
        return _hf_bert(layer, where), "hf_bert", {}
    if isinstance(layer, DiffmmAttention):
        if layer.num_kv_heads != layer.num_heads or layer.use_rope:
            raise ValueError(f"{where}: GQA / RoPE standard attention is not supported by swap_attention")
        w = StdAttnWeights(layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.out_proj.weight,
                           layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias, layer.out_proj.bias,
                           layer.num_heads, causal=layer.causal)
        return w, getattr(layer, "convention", "native"), {"mask_heads": getattr(layer, "mask_heads", None)}
    raise TypeError(f"{where}: {type(layer).__name__} is not a standard self-attention layer that swap_attention "
                    f"can read (nn.MultiheadAttention, open_clip Attention, timm Attention, Hugging Face "
                    f"BertAttention, diffmm Attention)")


def find_towers(model: nn.Module) -> dict[str, Optional[list[nn.Module]]]:
    """Tower name -> its Transformer blocks (each with an ``.attn``, or a Hugging Face ``.attention``), for every
    model type swap supports; None for a tower without Transformer blocks (an open_clip ResNet image tower)."""
    hf = _hf_encoder_layers(model)
    if hf is not None:  # a bare Hugging Face encoder: the text tower
        return {"text": hf}
    if _is_diffclip(model):
        text = model.text.transformer.encoder.layer if hasattr(model, "text") else model.transformer.resblocks
        return {"visual": list(model.visual.blocks), "text": list(text)}
    if isinstance(model, DiffmmViT) or _is_timm_vit(model):
        return {"visual": list(model.blocks)}
    towers: dict[str, Optional[list[nn.Module]]] = {}
    visual = getattr(model, "visual", None)
    if visual is not None:
        towers["visual"] = _image_tower_blocks(visual)
    if hasattr(model, "text") and isinstance(model.text, nn.Module):  # CustomTextCLIP
        tr = getattr(model.text, "transformer", None)
        hf = _hf_encoder_layers(tr) if tr is not None else None
        if hf is not None:  # open_clip HFTextEncoder
            towers["text"] = hf
        elif tr is None or not hasattr(tr, "resblocks"):
            raise TypeError(f"text tower {type(model.text).__name__} has no Transformer blocks to swap")
        else:
            towers["text"] = list(tr.resblocks)
    elif hasattr(getattr(model, "transformer", None), "resblocks"):  # CLIP keeps the text tower at top level
        towers["text"] = list(model.transformer.resblocks)
    if not towers and hasattr(getattr(model, "transformer", None), "resblocks"):
        towers["visual"] = list(model.transformer.resblocks)  # a bare open_clip VisionTransformer
    if not any(towers.values()):
        raise TypeError(f"swap_attention does not know where the attention blocks of {type(model).__name__} are")
    return towers


def _is_diffclip(model: nn.Module) -> bool:
    """A diffmm ``DiffCLIP`` (known by its config, so that the model module may use swap itself)."""
    return (isinstance(getattr(model, "config", None), CLIPConfig)
            and isinstance(getattr(model, "visual", None), DiffmmViT))


def _is_timm_vit(m: nn.Module) -> bool:
    return hasattr(m, "blocks") and hasattr(m, "patch_embed") and type(m).__module__.startswith("timm.")


def _image_tower_blocks(visual: nn.Module) -> Optional[list[nn.Module]]:
    trunk = getattr(visual, "trunk", None)  # open_clip TimmModel
    if trunk is not None:
        if not hasattr(trunk, "blocks"):
            raise TypeError(f"timm image tower {type(trunk).__name__} has no .blocks to swap")
        return list(trunk.blocks)
    if hasattr(getattr(visual, "transformer", None), "resblocks"):
        return list(visual.transformer.resblocks)
    return None  # a ResNet image tower has no Transformer blocks


def get_attn(block: nn.Module) -> nn.Module:
    """The attention layer of ``block`` that swap reads: ``block.attn``; for a Hugging Face layer its
    ``BertAttention`` (or, once swapped, the diffmm layer in ``attention.self``)."""
    if hasattr(block, "attn"):
        return block.attn
    att = block.attention
    return att.self if isinstance(att.self, HFBertCall) else att


def set_attn(block: nn.Module, new: nn.Module) -> None:
    """Put ``new`` where :func:`get_attn` reads. In a Hugging Face layer the new layer includes the output
    projection, so ``attention.output.dense`` becomes ``nn.Identity`` (its dropout and LayerNorm stay)."""
    if hasattr(block, "attn"):
        block.attn = new
        return
    block.attention.self = new
    block.attention.output.dense = nn.Identity()


def _out_weight(layer: nn.Module) -> torch.Tensor:
    """The output-projection weight of a layer :func:`extract_weights` reads (for device and dtype)."""
    if _is_hf_bert_attention(layer):
        return layer.output.dense.weight
    return layer.out_proj.weight if hasattr(layer, "out_proj") else layer.proj.weight


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


def replacement_layer(old: nn.Module, *, attn_type: str = "diff", init: str = "scratch", layer_idx: int = 0,
                      lambda_init: Union[str, float] = "constant", backend: Optional[str] = None,
                      generator: Optional[torch.Generator] = None, where: str = "layer") -> nn.Module:
    """The layer that replaces ``old``: ``attn_type`` (``init='upcycle'``: its function-preserving type and weights)
    as the adapter class of ``old``'s call convention, on ``old``'s device and dtype, in ``old``'s train mode."""
    w, convention, attrs = extract_weights(old, where)
    target = UPCYCLE_TYPES[attn_type] if init == "upcycle" else attn_type
    layer_cls = adapter_class(convention, get_attention_class(target))
    new = layer_cls.build(w.dim, w.num_heads, layer_idx=layer_idx, lambda_init=lambda_init, causal=w.causal,
                          qkv_bias=w.qkv_bias, proj_bias=w.proj_bias,
                          backend=backend if backend is not None else getattr(old, "backend", None))
    if init == "upcycle":
        new.load_standard(w, generator=generator)
    ref = _out_weight(old)
    new.to(device=ref.device, dtype=ref.dtype)
    for k, v in attrs.items():  # the replaced layer's call details (batch_first, heads of 3-dim masks)
        if v is not None:
            setattr(new, k, v)
    return new.train(old.training)


def swap_attention(model: nn.Module, *, towers: Union[None, str, Iterable[str]] = None, layers: Layers = None,
                   init: str = "scratch", attn_type: str = "diff", lambda_init: Union[str, float] = "constant",
                   backend: Optional[str] = None, generator: Optional[torch.Generator] = None) -> nn.Module:
    """Replace the attention of chosen towers and layers, in place; returns ``model``.

    Args:
        model: open_clip ``CLIP`` / ``CustomTextCLIP`` (ViT or timm image tower; open_clip or Hugging Face
            BERT-family text tower), timm ViT, Hugging Face BERT-family encoder (its one tower is ``'text'``),
            or diffmm ``DiffCLIP``.
        towers: ``'visual'`` and/or ``'text'``; default: every tower with Transformer blocks (a timm ViT has only
            ``'visual'``; an open_clip ResNet CLIP only ``'text'``). Naming a tower the model lacks, or a ResNet
            tower, is an error.
        layers: None (all), an index, a list (negative counts from the end), or ``{tower: indices}``.
        init: ``'scratch'`` (the new layer's own init) or ``'upcycle'`` (function-preserving).
        attn_type: a registered attention type (``'diff'``, ``'diff_v2'``, ``'standard'``, ...). With
            ``init='upcycle'``, ``'diff'`` builds :class:`diffmm.nn.UpcycledDiffAttention`.
        lambda_init: ``'constant'`` (0.8, DiffCLIP), ``'depth'`` (by the index within the tower) or a number.
        backend: attention backend of the new layers (default: the replaced diffmm layer's, else automatic).
        generator: RNG for the upcycled layers' random parts.
    """
    if init not in INITS:
        raise ValueError(f"init {init!r}; expected one of {', '.join(INITS)}")
    get_attention_class(attn_type)  # a one-line error for an unknown type
    if init == "upcycle" and attn_type not in UPCYCLE_TYPES:
        raise NotImplementedError(f"init='upcycle' is implemented for attn_type in {', '.join(UPCYCLE_TYPES)}; "
                                  f"got {attn_type!r} (use init='scratch')")
    found = find_towers(model)
    towers = [t for t in found if found[t] is not None] if towers is None else (
        [towers] if isinstance(towers, str) else list(towers))
    missing = [t for t in towers if t not in found]
    if missing:
        raise ValueError(f"{type(model).__name__} has no {', '.join(missing)} tower; it has: {', '.join(found)}")
    for t in towers:
        if found[t] is None:
            raise TypeError(f"{t} tower {type(getattr(model, 'visual', model)).__name__} has no Transformer blocks "
                            f"to swap (ResNet towers have none); swap the others with towers=...")
    record = []
    for tower in towers:
        blocks = found[tower]
        idx = _resolve_layers(layers, tower, len(blocks))
        for i in idx:
            old = get_attn(blocks[i])
            set_attn(blocks[i], replacement_layer(old, attn_type=attn_type, init=init, layer_idx=i,
                                                  lambda_init=lambda_init, backend=backend, generator=generator,
                                                  where=f"{tower} layer {i} ({type(old).__name__})"))
        record.append({"tower": tower, "layers": idx, "init": init, "attn_type": attn_type,
                       "lambda_init": lambda_init})
    _update_config(model, record)
    model.diffmm_swaps = getattr(model, "diffmm_swaps", []) + record
    return model


def _update_config(model: nn.Module, record: list[dict]) -> None:
    """Keep a DiffCLIP's config describing its layers, so an export of the swapped model reloads."""
    if not _is_diffclip(model):
        return
    for r in record:
        cfg = model.config.vision_cfg if r["tower"] == "visual" else model.config.text_cfg
        types = layer_attn_types(cfg)
        new_type = UPCYCLE_TYPES[r["attn_type"]] if r["init"] == "upcycle" else r["attn_type"]
        for i in r["layers"]:
            types[i] = new_type
        cfg.attn_type = types[0] if len(set(types)) == 1 else types
        cfg.lambda_init = r["lambda_init"]
