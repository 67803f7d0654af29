"""Conversions between open_clip / timm / official DiffCLIP layouts and diffmm's CLIP layout: state dicts, and
configs (open_clip's model configs, or configs read from a state dict's shapes); the one rule that tells the layouts
apart by their keys (:func:`key_layout`) and the pretrained tags, each naming a layout of local files (:data:`TAGS`).

diffmm's ``DiffCLIP`` state dict *is* the layout of the official DiffCLIP checkpoints (github
hammoudhasan/DiffCLIP) without the DDP ``module.`` prefix, so the official format needs only prefix stripping.
open_clip and timm keep q/k/v in one fused matrix (``in_proj_weight`` / ``qkv.weight``, rows ordered q, k, v),
which splits into ``q_proj`` / ``k_proj`` / ``v_proj``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, NamedTuple, Optional, Union

import torch

from diffmm.models.clip.config import LOGIT_SCALE_INIT, CLIPConfig, TextCfg, VisionCfg, get_model_config, list_models

Tensor = torch.Tensor
# open_clip vision block names -> diffmm / timm / official DiffCLIP names
VISION_BLOCK_RENAMES = {"ln_1.": "norm1.", "ln_2.": "norm2.", "mlp.c_fc.": "mlp.fc1.", "mlp.c_proj.": "mlp.fc2."}


def key_layout(keys: Iterable[str]) -> Optional[str]:
    """The layout of a state dict from its keys (DDP's ``module.`` prefix allowed): ``'open_clip'`` (ViT towers),
    ``'open_clip_timm'`` (open_clip with a timm image tower, ``visual.trunk.*``), ``'diffclip'`` (diffmm's and the
    official DiffCLIP's), ``'timm'`` (a timm ViT, or diffmm's image tower alone), or None."""
    keys = {k.removeprefix("module.") for k in keys}
    if "visual.class_embedding" in keys or "visual.conv1.weight" in keys:
        return "open_clip"
    for layout, key in (("open_clip_timm", "visual.trunk.patch_embed.proj.weight"),
                        ("diffclip", "visual.patch_embed.proj.weight"), ("timm", "patch_embed.proj.weight")):
        if key in keys:
            return layout
    return None


class Tag(NamedTuple):
    """A pretrained tag: the configs that have it (name prefix; '' = all), the key layouts of its files, the files."""
    prefix: str
    layouts: tuple[str, ...]
    files: str


#: pretrained tags: each names a format of local files that loads into a config (``diffmm.list_pretrained()``, the
#: timm models' tags of :mod:`diffmm.models.timm_models`)
TAGS = {
    "diffmm": Tag("", ("diffclip", "timm", "open_clip_timm"), "a Lightning .ckpt from diffmm fit, a diffmm export "
                  "folder, torch.save(model.state_dict()) of the same config, or open_clip_train's checkpoint of its "
                  "timm tower"),
    "official": Tag("DiffCLIP", ("diffclip",), "checkpoint_best.pt with trust_pickle=True, or its state dict as "
                    ".safetensors (ImageNet mean/std, the official tokenizer truncation)"),
    "open_clip": Tag("OpenCLIP-", ("open_clip",), "open_clip_model.safetensors, open_clip_pytorch_model.bin, "
                     "torch.save(model.state_dict()) of open_clip's CLIP, or local-dir:FOLDER"),
    "timm": Tag("", ("timm",), "a timm ViT state dict (.safetensors, .pth): fills the image tower"),
}


def tags_of(config_name: str) -> list[str]:
    """The pretrained tags of a diffmm config."""
    return [tag for tag, t in TAGS.items() if config_name.startswith(t.prefix)]


def timm_name(config_name: str) -> str:
    """``DiffCLIP-ViT-B-16`` -> ``diffmm_diffclip_vit_b_16`` (the timm name of a config's image tower)."""
    return "diffmm_" + config_name.lower().replace("-", "_")


def _split_qkv(sd: dict, out: dict, w_key: str, b_key: Optional[str], dst: str, where: str) -> None:
    w = sd.pop(w_key)
    if w.shape[0] % 3:
        raise KeyError(f"{where}: {w_key} has shape {tuple(w.shape)}; expected 3 * width rows (q, k, v)")
    for name, part in zip(("q_proj", "k_proj", "v_proj"), w.chunk(3, dim=0)):
        out[f"{dst}.{name}.weight"] = part.contiguous()
    if b_key is not None and b_key in sd:
        for name, part in zip(("q_proj", "k_proj", "v_proj"), sd.pop(b_key).chunk(3, dim=0)):
            out[f"{dst}.{name}.bias"] = part.contiguous()


def open_clip_to_diffmm(sd: dict[str, Tensor], *, source: str = "open_clip checkpoint") -> dict[str, Tensor]:
    """open_clip ``CLIP`` state dict (ViT or timm image tower, text Transformer) -> diffmm ``DiffCLIP`` state dict.

    Unknown keys are kept under their name, so a strict load afterwards names them.
    """
    sd = {(k[len("text."):] if k.startswith("text.") else k): v for k, v in sd.items()}  # CustomTextCLIP
    out: dict[str, Tensor] = {}
    trunk = {k[len("visual.trunk."):]: sd.pop(k) for k in list(sd) if k.startswith("visual.trunk.")}
    if trunk:  # open_clip's TimmModel: the timm ViT, then head.proj (a Linear: the transposed projection)
        out.update(timm_vit_to_diffmm(trunk, prefix="visual.", source=source))
        if "visual.head.proj.weight" in sd:
            out["image_projection"] = sd.pop("visual.head.proj.weight").t().contiguous()
    renames = {
        "visual.conv1.weight": "visual.patch_embed.proj.weight",
        "visual.ln_pre.weight": "visual.norm_pre.weight", "visual.ln_pre.bias": "visual.norm_pre.bias",
        "visual.ln_post.weight": "visual.norm.weight", "visual.ln_post.bias": "visual.norm.bias",
        "visual.proj": "image_projection",
    }
    if "visual.class_embedding" in sd:
        out["visual.cls_token"] = sd.pop("visual.class_embedding").reshape(1, 1, -1)
    if "visual.positional_embedding" in sd:
        out["visual.pos_embed"] = sd.pop("visual.positional_embedding").unsqueeze(0)
    block = re.compile(r"^(visual\.transformer|transformer)\.resblocks\.(\d+)\.(.+)$")
    for key in list(sd):
        if key in renames:
            out[renames[key]] = sd.pop(key)
            continue
        m = block.match(key)
        if not m:
            continue
        tower, i, rest = m.groups()
        if tower == "visual.transformer":
            dst = f"visual.blocks.{i}"
            for a, b in VISION_BLOCK_RENAMES.items():
                if rest.startswith(a):
                    rest = b + rest[len(a):]
        else:
            dst = f"transformer.resblocks.{i}"
        if rest == "attn.in_proj_weight":
            _split_qkv(sd, out, key, key.replace("in_proj_weight", "in_proj_bias"), f"{dst}.attn", source)
        elif rest == "attn.in_proj_bias":
            continue  # consumed with the weight
        else:
            out[f"{dst}.{rest}"] = sd.pop(key)
    out.update(sd)  # text embeddings, ln_final, text_projection, logit_scale, and anything unknown
    return out


def timm_vit_to_diffmm(sd: dict[str, Tensor], *, prefix: str = "visual.", drop_head: bool = True,
                       source: str = "timm checkpoint") -> dict[str, Tensor]:
    """timm ``VisionTransformer`` state dict -> diffmm ``VisionTransformer`` keys (under ``prefix``).

    timm's fused ``attn.qkv`` splits into q/k/v and ``attn.proj`` becomes ``out_proj``; a diffmm-attention timm
    model (``timm.create_model('diffmm_...')``) already uses diffmm's names. The classifier ``head.*`` is
    dropped when ``drop_head``.
    """
    out: dict[str, Tensor] = {}
    sd = dict(sd)
    qkv = re.compile(r"^blocks\.(\d+)\.attn\.qkv\.weight$")
    for key in [k for k in sd if qkv.match(k)]:  # fused q/k/v (and their biases) first
        _split_qkv(sd, out, key, key.replace(".weight", ".bias"), f"{prefix}blocks.{qkv.match(key).group(1)}.attn",
                   source)
    for key in list(sd):
        if drop_head and key.startswith("head."):
            sd.pop(key)
            continue
        new = re.sub(r"^(blocks\.\d+\.attn)\.proj\.", r"\1.out_proj.", key)
        new = re.sub(r"^(blocks\.\d+\.attn)\.sub_norm\.", r"\1.diff_norm.", new)  # timm DiffAttention
        out[prefix + new] = sd.pop(key)
    return out


def diffmm_vit_to_timm(sd: dict[str, Tensor], *, prefix: str = "visual.") -> dict[str, Tensor]:
    """diffmm image-tower keys -> the keys of the matching ``timm.create_model('diffmm_...')`` model."""
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def mha_text_to_diffmm(sd: dict[str, Tensor], *, source: str) -> dict[str, Tensor]:
    """Split any open_clip-style ``attn.in_proj_weight`` left in a DiffCLIP-layout dict (e.g. a standard text
    tower saved as ``nn.MultiheadAttention``) into q/k/v."""
    out: dict[str, Tensor] = {}
    sd = dict(sd)
    for key in [k for k in sd if k.endswith("attn.in_proj_weight")]:
        _split_qkv(sd, out, key, key.replace("in_proj_weight", "in_proj_bias"), key[:-len(".in_proj_weight")], source)
    out.update(sd)
    return out


def infer_clip_config(sd: dict[str, Tensor], *, head_width: Optional[int] = None, text_head_width: int = 64,
                      act: Optional[str] = None, lambda_init: Union[str, float] = "constant", norm_eps: float = 1e-5,
                      source: str = "checkpoint") -> CLIPConfig:
    """A :class:`CLIPConfig` from the shapes of a state dict in diffmm's layout (what the official DiffCLIP files
    and converted open_clip files are). Differential heads come from the lambda vectors; standard heads are
    ``head_width`` / ``text_head_width`` wide (shapes do not tell; open_clip's default 64). The image tower has
    timm's keys under ``visual.`` (:func:`infer_timm_vit_config`); ``act`` is both towers' (None: GELU for the
    image tower, QuickGELU for the text tower, as DiffCLIP)."""
    def need(key: str) -> Tensor:
        if key not in sd:
            raise KeyError(f"{source}: missing key {key} (not a CLIP checkpoint in a layout diffmm reads)")
        return sd[key]

    need("visual.patch_embed.proj.weight")  # a missing image tower names the layout, not a bare key
    vision = infer_timm_vit_config({k[len("visual."):]: v for k, v in sd.items() if k.startswith("visual.")},
                                   head_width=head_width, norm_eps=norm_eps, lambda_init=lambda_init, source=source)
    ctx, tw = need("positional_embedding").shape
    t_diff = "transformer.resblocks.0.attn.lambda_q1" in sd
    t_head = sd["transformer.resblocks.0.attn.lambda_q1"].shape[0] if t_diff else text_head_width
    layers = {int(m.group(1)) for k in sd for m in [re.match(r"transformer\.resblocks\.(\d+)\.", k)] if m}
    text = TextCfg(context_length=ctx, vocab_size=need("token_embedding.weight").shape[0], width=tw,
                   heads=max(tw // t_head, 1), layers=max(layers) + 1 if layers else 0,
                   mlp_ratio=need("transformer.resblocks.0.mlp.c_fc.weight").shape[0] / tw,
                   attn_type="diff" if t_diff else "standard", lambda_init=lambda_init, act=act or "quick_gelu")
    cfg = CLIPConfig(embed_dim=need("text_projection").shape[1], vision_cfg=dataclasses.replace(
        vision, act=act or vision.act), text_cfg=text,
        init_logit_bias=float(sd["logit_bias"]) if "logit_bias" in sd else None)
    cfg.validate(source)
    return cfg


def from_open_clip_config(oc: dict[str, Any], *, quick_gelu: bool = False,
                          source: str = "open_clip config") -> CLIPConfig:
    """The diffmm config (standard attention, open_clip layout) of an open_clip CLIP model config.

    Supports the plain ViT + text Transformer CLIP (``vision_cfg`` / ``text_cfg`` as in open_clip's
    ``model_configs``); timm / HF / ResNet towers and custom attention blocks are refused with the field name.
    """
    oc = dict(oc.get("model_cfg", oc))
    quick_gelu = bool(oc.pop("quick_gelu", quick_gelu))
    v, t = dict(oc.get("vision_cfg", {})), dict(oc.get("text_cfg", {}))
    if t.get("hf_model_name"):
        raise ValueError(f"{source}: text_cfg.hf_model_name={t['hf_model_name']!r} is not a plain Transformer tower; "
                         f"use diffmm.swap_attention on the open_clip model instead")
    timm_tower = _timm_tower(v, source) if v.get("timm_model_name") else None
    if isinstance(v.get("layers", 12), (list, tuple)):
        raise ValueError(f"{source}: vision_cfg.layers={v['layers']} is a ResNet; only ViT towers convert")
    unsupported = ("attentional_pool", "qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner",
                   "scale_attn", "scale_fc", "embed_cls", "no_causal_mask", "final_ln_after_pool", "ls_init_value",
                   "proj_bias", "act_kwargs", "norm_kwargs")
    for name, cfg in (("vision_cfg", {} if timm_tower else v), ("text_cfg", t)):
        bad = [k for k in unsupported if cfg.get(k)]
        if name == "text_cfg" and cfg.get("pool_type", "argmax") != "argmax":
            bad.append("pool_type")
        if name == "text_cfg" and cfg.get("proj_type", "linear") != "linear":
            bad.append("proj_type")
        if name == "vision_cfg" and cfg.get("pos_embed_type", "learnable") != "learnable":
            bad.append("pos_embed_type")
        if bad:
            raise ValueError(f"{source}: {name} uses {', '.join(bad)}, which diffmm's CLIP does not implement")
    act = "quick_gelu" if quick_gelu else "gelu"
    vision = VisionCfg(image_size=int(_first(v.get("image_size", 224))),
                       patch_size=int(_first(v.get("patch_size", 16))),
                       width=v.get("width", 768), layers=v.get("layers", 12), head_width=v.get("head_width", 64),
                       mlp_ratio=v.get("mlp_ratio", 4.0), attn_type="standard", act=act,
                       pre_norm=not v.get("no_ln_pre", False), patch_bias=False,
                       pool_type=v.get("pool_type", "tok"),
                       image_mean=_tuple_or_none(v.get("image_mean")), image_std=_tuple_or_none(v.get("image_std")))
    text = TextCfg(context_length=t.get("context_length", 77), vocab_size=t.get("vocab_size", 49408),
                   width=t.get("width", 512), heads=t.get("heads", 8), layers=t.get("layers", 12),
                   mlp_ratio=t.get("mlp_ratio", 4.0), attn_type="standard", act=act)
    cfg = CLIPConfig(embed_dim=oc.get("embed_dim", 512), vision_cfg=timm_tower or vision, text_cfg=text,
                     init_logit_scale=oc.get("init_logit_scale", LOGIT_SCALE_INIT),
                     init_logit_bias=oc.get("init_logit_bias"))
    cfg.validate(source)
    return cfg


def _timm_tower(v: dict[str, Any], source: str) -> VisionCfg:
    """The image tower of a diffmm config that open_clip builds as a timm tower (``timm_model_name:
    diffmm_<config>``, CLS pooling, a linear projection without bias): the config's own ``vision_cfg``."""
    name = v["timm_model_name"]
    config = next((n for n in list_models() if timm_name(n) == name), None)
    bad = [f"{k}={v.get(k, default)!r}" for k, want, default in (("timm_pool", "token", "avg"),
                                                                 ("timm_proj", "linear", "linear"),
                                                                 ("timm_proj_bias", False, False))
           if v.get(k, default) != want]
    if config is None or bad:
        raise ValueError(f"{source}: vision_cfg timm_model_name={name!r} {' '.join(bad)}; diffmm converts only its own "
                         f"timm towers (diffmm_<config>) with timm_pool token and a linear timm_proj without bias")
    vision = get_model_config(config).vision_cfg
    return dataclasses.replace(vision, image_size=int(_first(v.get("image_size", vision.image_size))))


def _tuple_or_none(x):
    return tuple(x) if x is not None else None


def _first(x):
    """open_clip allows (H, W) sizes; diffmm's ViT is square."""
    if isinstance(x, (list, tuple)):
        if len(set(x)) != 1:
            raise ValueError(f"non-square size {x}; diffmm's ViT takes square images and patches")
        return x[0]
    return x


def infer_timm_vit_config(sd: dict[str, Tensor], *, head_width: Optional[int] = None, norm_eps: float = 1e-6,
                          lambda_init="depth", source: str = "timm checkpoint") -> VisionCfg:
    """A diffmm :class:`VisionCfg` from a timm ViT state dict in diffmm keys (after :func:`timm_vit_to_diffmm`
    with ``prefix=''``). timm's LayerNorm eps is 1e-6 unless told otherwise; heads: from the lambda vectors of a
    differential ViT, else ``head_width`` (default 64)."""
    for bad, why in (("reg_token", "register tokens"), ("fc_norm.weight", "fc_norm (avg-pool head)"),
                     ("attn_pool.latent", "attention pooling")):
        if bad in sd:
            raise KeyError(f"{source}: {bad} ({why}) is not supported by diffmm's ViT")
    if "cls_token" not in sd or "pos_embed" not in sd:
        raise KeyError(f"{source}: missing cls_token / pos_embed (diffmm's ViT needs a class token and learned "
                       f"positions)")
    w = sd["patch_embed.proj.weight"]
    width, p = w.shape[0], w.shape[-1]
    n = sd["pos_embed"].shape[1] - 1
    grid = int(round(n ** 0.5))
    if grid * grid != n:
        raise KeyError(f"{source}: pos_embed has {n + 1} tokens; expected 1 + a square number of patches "
                       f"(class token embedded with the patches)")
    diff = "blocks.0.attn.lambda_q1" in sd
    if diff:
        head_width = sd["blocks.0.attn.lambda_q1"].shape[0]
    upcycled = "blocks.0.attn.norm_gate" in sd
    layers = 1 + max(int(m.group(1)) for k in sd for m in [re.match(r"blocks\.(\d+)\.", k)] if m)
    cfg = VisionCfg(image_size=grid * p, patch_size=p, width=width, layers=layers, head_width=head_width or 64,
                    mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / width,
                    attn_type="diff_upcycled" if upcycled else ("diff" if diff else "standard"),
                    lambda_init=lambda_init, pre_norm="norm_pre.weight" in sd,
                    patch_bias="patch_embed.proj.bias" in sd, qkv_bias="blocks.0.attn.q_proj.bias" in sd,
                    proj_bias="blocks.0.attn.out_proj.bias" in sd, norm_eps=norm_eps)
    if diff and not upcycled and sd["blocks.0.attn.q_proj.weight"].shape[0] != width:
        raise KeyError(f"{source}: differential q_proj has {sd['blocks.0.attn.q_proj.weight'].shape[0]} rows; "
                       f"expected width {width}")
    return cfg
