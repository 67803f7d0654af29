"""timm integration: diffmm attention as a timm ``attn_layer``, and diffmm's ViTs as ``timm.create_model`` names
(what each gives, with examples: docs/models.md, "timm").

- :func:`timm_attn_layer`: the class for timm's ``attn_layer=`` (timm's constructor and call, diffmm's parameter
  names); timm passes it only its own arguments, so :func:`set_layer_depths` sets depth, lambda_init and backend.
- Every image tower of ``diffmm/model_configs`` is registered as ``diffmm_<config name>`` (:func:`timm_name`): a
  timm ``VisionTransformer`` whose state dict equals ``DiffCLIP.visual``'s, built as timm builds its ViTs
  (:func:`build_vit`, ``build_model_with_cfg``).
- Weight sources are the pretrained tags (``diffmm.hub.clip_convert.TAGS``) with their mean/std in
  ``pretrained_cfg``; nothing is downloaded: a local file of any layout diffmm reads (:func:`checkpoint_filter`).

``import diffmm`` imports this module, which registers the names.
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Union

import torch.nn as nn
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model, resolve_pretrained_cfg
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from diffmm.hub.clip_convert import (TAGS, diffmm_vit_to_timm, key_layout, open_clip_to_diffmm, tags_of, timm_name,
                                     timm_vit_to_diffmm)
from diffmm.models.attn_adapters import adapter_class
from diffmm.models.clip.config import (IMAGENET_MEAN, IMAGENET_STD, OPENAI_MEAN, OPENAI_STD, VisionCfg,
                                       get_model_config, list_models)
from diffmm.nn import QuickGELU, get_attention_class
from diffmm.nn.lambdas import resolve_lambda_init


def timm_attn_layer(attn_type: str = "diff") -> type:
    """The timm ``attn_layer`` class of a registered diffmm attention type (lambda_init ``'depth'``, the paper's
    and timm's DiffAttention's; automatic backend; see :func:`set_layer_depths` for others).

    Args:
        attn_type: ``'diff'``, ``'standard'``, ``'diff_v2'``, ``'diff_upcycled'`` or any other registered type.
    """
    return adapter_class("timm", get_attention_class(attn_type))


def set_layer_depths(model: nn.Module, *, lambda_init: Union[str, float, None] = None,
                     backend: Optional[str] = None) -> nn.Module:
    """Give each ``model.blocks[i].attn`` (diffmm layers) ``layer_idx = i`` and re-resolve its lambda_init.

    timm passes the block depth only to its own DiffAttention; call this after building a timm model with a
    diffmm ``attn_layer``.

    Args:
        model: a timm ViT (``model.blocks``), or timm's ``features_only`` wrapper of one (``model.model``).
        lambda_init: also replace the layers' lambda_init (``'depth'``, ``'constant'`` or a number).
        backend: also set the layers' attention backend.
    """
    vit = model if hasattr(model, "blocks") else getattr(model, "model", None)  # FeatureGetterNet keeps .model
    if not hasattr(vit, "blocks"):
        raise ValueError(f"set_layer_depths needs a timm ViT with .blocks; got {type(model).__name__}")
    for i, blk in enumerate(vit.blocks):
        attn = blk.attn
        if not hasattr(attn, "layer_idx"):
            continue  # not a diffmm layer
        if backend is not None:
            attn.backend = backend
        attn.layer_idx = i
        if hasattr(attn, "lambda_init_spec"):
            if lambda_init is not None:
                attn.lambda_init_spec = lambda_init
            attn.lambda_init = resolve_lambda_init(attn.lambda_init_spec, i)
    return model


def build_vit(*, lambda_init: Union[str, float, None] = None, attn_backend: Optional[str] = None,
              **kwargs) -> VisionTransformer:
    """timm's ``VisionTransformer(**kwargs)`` whose diffmm attention layers know their depth (and lambda_init,
    backend) as it is returned: the ``model_cls`` given to timm's ``build_model_with_cfg``, so what timm does after
    building (loading weights, wrapping for ``features_only``) sees a finished model.

    Args:
        lambda_init: the layers' lambda_init (``'depth'``, ``'constant'`` or a number; None keeps the class's).
        attn_backend: the layers' attention backend (None: automatic).
        **kwargs: timm's ``VisionTransformer`` arguments.
    """
    return set_layer_depths(VisionTransformer(**kwargs), lambda_init=lambda_init, backend=attn_backend)


def vit_kwargs(vision_cfg: VisionCfg) -> dict:
    """timm ``VisionTransformer`` kwargs of a diffmm :class:`~diffmm.models.clip.config.VisionCfg` (uniform
    attention type only; then :func:`set_layer_depths` with the config's lambda_init)."""
    v = vision_cfg
    if not isinstance(v.attn_type, str):
        raise ValueError("a timm ViT needs one attention type for all layers; got a per-layer list")
    if v.patch_bias == v.pre_norm:
        raise ValueError(f"timm's ViT has a patch bias exactly when it has no pre-norm; got pre_norm={v.pre_norm}, "
                         f"patch_bias={v.patch_bias}")
    acts = {"gelu": nn.GELU, "quick_gelu": QuickGELU}
    if v.act not in acts:
        raise ValueError(f"vision act {v.act!r}; timm ViTs here support {', '.join(acts)}")
    return dict(img_size=v.image_size, patch_size=v.patch_size, embed_dim=v.width, depth=v.layers,
                num_heads=v.heads, mlp_ratio=v.mlp_ratio, qkv_bias=v.qkv_bias, proj_bias=v.proj_bias,
                class_token=True, global_pool="token" if v.pool_type == "tok" else "avg",
                fc_norm=False, pre_norm=v.pre_norm, final_norm=True,
                norm_layer=partial(nn.LayerNorm, eps=v.norm_eps), act_layer=acts[v.act],
                init_values=v.layer_scale_init, attn_layer=timm_attn_layer(v.attn_type))


def timm_tags(config_name: str) -> list[str]:
    """The pretrained tags of a config's timm model, the default (``diffmm``, which takes timm files too) first."""
    return [tag for tag in tags_of(config_name) if tag != "timm"]


def checkpoint_filter(state_dict: dict, model: VisionTransformer) -> dict:
    """timm's ``pretrained_filter_fn``: a local file's state dict (as timm read it: ``state_dict`` key taken,
    ``module.`` stripped) -> this model's keys, then timm's ViT filter (position-embedding / patch resampling).

    The layout must be one of the model's tag's (``diffmm.hub.clip_convert.TAGS``): an open_clip file under
    ``.official`` is an error. The layout cannot tell every source apart: an official DiffCLIP state dict saved as
    ``.safetensors`` has diffmm's keys, so under the default ``.diffmm`` tag it loads with the config's (OpenAI)
    mean/std; name ``.official`` for official weights.
    """
    cfg = getattr(model, "pretrained_cfg", None) or {}
    tag, source = cfg.get("tag") or "diffmm", cfg.get("file") or "checkpoint"
    layout = key_layout(state_dict)
    if layout is None:
        raise KeyError(f"{source}: no visual.conv1.weight, visual.patch_embed.proj.weight or patch_embed.proj.weight: "
                       f"not a CLIP (open_clip, official DiffCLIP, diffmm) or timm ViT state dict")
    if tag in TAGS and layout not in TAGS[tag].layouts:
        arch = cfg.get("architecture", "")
        fits = [f"{arch}.{t}" for t in timm_tags(_CONFIG_OF.get(arch, "")) if layout in TAGS[t].layouts]
        raise ValueError(f"{source}: {layout}-layout weights under the pretrained tag {tag!r}, which takes "
                         f"{' or '.join(TAGS[tag].layouts)} layout; "
                         + (f"load them as {' or '.join(fits)}" if fits else f"{arch} has no tag for them"))
    if layout == "open_clip":
        state_dict = diffmm_vit_to_timm(open_clip_to_diffmm(state_dict, source=source))
    elif layout == "diffclip":
        state_dict = diffmm_vit_to_timm(state_dict)
    else:  # fused qkv (a standard timm ViT) splits into q/k/v; sub_norm (timm's DiffAttention) -> diff_norm
        if layout == "open_clip_timm":  # open_clip's TimmModel: the timm ViT under visual.trunk
            state_dict = {k[len("visual.trunk."):]: v for k, v in state_dict.items() if k.startswith("visual.trunk.")}
        state_dict = timm_vit_to_diffmm(state_dict, prefix="", drop_head=False, source=source)
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear) or state_dict.get("head.weight", head.weight).shape != head.weight.shape:
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith("head.")}  # a head of another size
    return checkpoint_filter_fn(state_dict, model)


def create_timm_vit(config_name: str, pretrained: bool = False, **kwargs) -> VisionTransformer:
    """The image tower of a diffmm config as a timm ViT (what ``timm.create_model(timm_name(config_name))`` builds);
    ``attn_backend=`` sets the attention backend, ``out_indices=`` the ``features_only`` maps (default: the last
    3 blocks, timm's ViT default), other kwargs are timm's."""
    v = get_model_config(config_name).vision_cfg
    if pretrained and not resolve_pretrained_cfg(timm_name(config_name), kwargs.get("pretrained_cfg"),
                                                 kwargs.get("pretrained_cfg_overlay")).has_weights:
        raise ValueError(f"{timm_name(config_name)}: no weights to download; give a local file with "
                         f"pretrained_cfg_overlay=dict(file=PATH) (tags: {', '.join(timm_tags(config_name))})")
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(build_vit, timm_name(config_name), pretrained,
                                pretrained_filter_fn=checkpoint_filter,
                                feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
                                **{**vit_kwargs(v), "lambda_init": v.lambda_init, **kwargs})


def _entrypoint(config_name: str):
    """The function timm registers for ``config_name`` (timm keys its registry by the function's name)."""
    def create(pretrained: bool = False, **kwargs) -> VisionTransformer:
        return create_timm_vit(config_name, pretrained, **kwargs)

    create.__name__ = create.__qualname__ = timm_name(config_name)
    create.__doc__ = f"The image tower of diffmm's ``{config_name}`` as a timm VisionTransformer."
    return create


def _pretrained_cfg(config_name: str, tag: str) -> dict:
    """timm's pretrained cfg of one weight source: official DiffCLIP weights were trained with ImageNet mean/std
    (the official SLIP pipeline), open_clip's ViT weights with OpenAI CLIP's, diffmm's with its config's."""
    v = get_model_config(config_name).vision_cfg
    mean, std = {"official": (IMAGENET_MEAN, IMAGENET_STD), "open_clip": (OPENAI_MEAN, OPENAI_STD)}.get(
        tag, (v.mean, v.std))
    return dict(url="", num_classes=0, input_size=(3, v.image_size, v.image_size), pool_size=None, crop_pct=1.0,
                interpolation="bicubic", fixed_input_size=True, mean=mean, std=std, first_conv="patch_embed.proj",
                classifier="head", license="apache-2.0")


#: the configs registered with timm (DiffCLIP-dagger's image tower is DiffCLIP's; a timm ViT has one attention type,
#: so configs with a per-layer list, such as LiT-DiffCLIP-DINOv2-MiniLM's upcycled last block, are left out)
TIMM_CONFIGS = [name for name in list_models()
                if "-dagger-" not in name and isinstance(get_model_config(name).vision_cfg.attn_type, str)]
default_cfgs = generate_default_cfgs({  # read by timm; the first tag (diffmm) is the default
    f"{timm_name(n)}.{tag}": _pretrained_cfg(n, tag) for n in TIMM_CONFIGS for tag in timm_tags(n)})
_CONFIG_OF = {timm_name(n): n for n in TIMM_CONFIGS}
TIMM_MODELS = [register_model(_entrypoint(name)).__name__ for name in TIMM_CONFIGS]
