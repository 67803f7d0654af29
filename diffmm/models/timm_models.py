"""timm integration: diffmm attention as a timm ``attn_layer``, and diffmm's ViTs as ``timm.create_model`` names.

- :func:`timm_attn_layer` returns a class timm's ``VisionTransformer(attn_layer=...)`` / ``Block`` can build
  (timm's constructor and call signature; diffmm's parameter names ``q_proj`` / ``k_proj`` / ``v_proj`` /
  ``out_proj`` / lambdas / ``diff_norm``).
- Every image tower of ``diffmm/model_configs`` is registered as ``diffmm_<config name>`` (lower case, ``-`` ->
  ``_``; e.g. ``diffmm_diffclip_vit_b_16``, ``diffmm_diffclip_star_tiny``, ``diffmm_clip_vit_b_16``): a timm
  ``VisionTransformer`` whose state dict equals ``DiffCLIP.visual``'s (``diffmm_vit_to_timm``), with timm's
  features (``forward_features``, ``forward_intermediates``, ``reset_classifier``, ...). ``num_classes``
  defaults to 0 (a feature extractor). Local weights: ``pretrained=True,
  pretrained_cfg_overlay=dict(file=PATH)``.

Importing :mod:`diffmm.models.clip` imports this module.
"""
from __future__ import annotations

import sys
from functools import partial
from typing import Optional

import torch.nn as nn
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from diffmm.models.attn_adapters import adapter_class
from diffmm.nn import ATTENTION_LAYERS, QuickGELU
from diffmm.nn.lambdas import resolve_lambda_init

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_LAYER_CLASSES: dict[tuple, type] = {}


def timm_attn_layer(attn_type: str = "diff", *, lambda_init: Optional[str | float] = None,
                    backend: Optional[str] = None) -> type:
    """A timm ``attn_layer`` class for a registered diffmm attention type.

    Args:
        attn_type: ``'diff'``, ``'standard'``, ``'diff_v2'``, ...
        lambda_init: default ``'depth'`` (the paper; timm's DiffAttention); ``'constant'`` for DiffCLIP.
        backend: attention backend of every layer built from the class.
    """
    if attn_type not in ATTENTION_LAYERS:
        raise ValueError(f"unknown attention type {attn_type!r}; expected one of {', '.join(ATTENTION_LAYERS)}")
    base = adapter_class("timm", ATTENTION_LAYERS[attn_type][0])
    if lambda_init is None and backend is None:
        return base
    key = (base, lambda_init, backend)
    if key not in _LAYER_CLASSES:
        suffix = "_".join(str(s).replace(".", "p") for s in (lambda_init, backend) if s is not None)
        name = f"{base.__name__}_{suffix}"
        attrs = {"__module__": __name__}
        if lambda_init is not None:
            attrs["default_lambda_init"] = lambda_init
        if backend is not None:
            attrs["default_backend"] = backend
        cls = type(name, (base,), attrs)
        setattr(sys.modules[__name__], name, cls)
        _LAYER_CLASSES[key] = cls
    return _LAYER_CLASSES[key]


def set_layer_depths(model: nn.Module) -> nn.Module:
    """Give each ``model.blocks[i].attn`` (diffmm layers) ``layer_idx = i`` and re-resolve its lambda_init.

    timm passes the block depth only to its own DiffAttention; call this after building a timm model with a
    diffmm ``attn_layer`` whose lambda_init is ``'depth'``.
    """
    for i, blk in enumerate(model.blocks):
        attn = blk.attn
        if hasattr(attn, "set_layer_idx"):
            attn.set_layer_idx(i)
        elif hasattr(attn, "lambda_init_spec"):
            attn.layer_idx, attn.lambda_init = i, resolve_lambda_init(attn.lambda_init_spec, i)
        elif hasattr(attn, "layer_idx"):
            attn.layer_idx = i
    return model


def vit_kwargs(vision_cfg, attn_backend: Optional[str] = None) -> dict:
    """timm ``VisionTransformer`` kwargs of a diffmm :class:`~diffmm.models.clip.config.VisionCfg` (uniform
    attention type only)."""
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
                attn_layer=timm_attn_layer(v.attn_type, lambda_init=v.lambda_init, backend=attn_backend))


def _slug(config_name: str) -> str:
    return "diffmm_" + config_name.lower().replace("-", "_")


def _entrypoint(variant: str, config_name: str):
    def create(pretrained: bool = False, **kwargs) -> VisionTransformer:
        from diffmm.models.clip.factory import get_model_config

        v = get_model_config(config_name).vision_cfg
        args = vit_kwargs(v, kwargs.pop("attn_backend", None))
        args.update(kwargs)
        model = build_model_with_cfg(VisionTransformer, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                                     feature_cfg=dict(out_indices=3, feature_cls="getter"), **args)
        return set_layer_depths(model)

    create.__name__ = create.__qualname__ = variant
    create.__module__ = __name__
    create.__doc__ = f"The image tower of diffmm's ``{config_name}`` as a timm VisionTransformer."
    return create


def _register_all() -> list[str]:
    from diffmm.models.clip.factory import get_model_config, list_models

    cfgs, names = {}, []
    for name in list_models():
        if "-dagger-" in name:  # DiffCLIP-dagger's image tower is DiffCLIP's
            continue
        v = get_model_config(name).vision_cfg
        variant = _slug(name)
        cfgs[variant] = dict(url="", num_classes=0, input_size=(3, v.image_size, v.image_size), pool_size=None,
                             crop_pct=1.0, interpolation="bicubic", mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD,
                             first_conv="patch_embed.proj", classifier="head", license="apache-2.0")
        timm_attn_layer(v.attn_type, lambda_init=v.lambda_init)  # create the class now: whole-model pickles find it
        fn = _entrypoint(variant, name)
        setattr(sys.modules[__name__], variant, fn)
        names.append(variant)
    global default_cfgs
    default_cfgs = generate_default_cfgs(cfgs)
    for variant in names:
        register_model(getattr(sys.modules[__name__], variant))
    return names


default_cfgs: dict = {}
TIMM_MODELS = _register_all()
