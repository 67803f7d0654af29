"""timm integration: diffmm attention as a timm ``attn_layer``, and diffmm's ViTs as ``timm.create_model`` names.

- :func:`timm_attn_layer` returns the class timm's ``VisionTransformer(attn_layer=...)`` / ``Block`` builds
  (timm's constructor and call signature; diffmm's parameter names ``q_proj`` / ``k_proj`` / ``v_proj`` /
  ``out_proj`` / lambdas / ``diff_norm``). timm checks ``issubclass(attn_layer, ...)``, so it must be the class
  itself (a ``functools.partial`` is refused) and timm passes it only its own arguments: the depth, another
  lambda_init and the backend are set after building with :func:`set_layer_depths`.
- Every image tower of ``diffmm/model_configs`` is registered as ``diffmm_<config name>`` (lower case, ``-`` ->
  ``_``; e.g. ``diffmm_diffclip_vit_b_16``, ``diffmm_diffclip_star_tiny``, ``diffmm_clip_vit_b_16``): a timm
  ``VisionTransformer`` whose state dict equals ``DiffCLIP.visual``'s (``diffmm_vit_to_timm``), with timm's
  features (``forward_features``, ``forward_intermediates``, ``reset_classifier``, ...). ``num_classes``
  defaults to 0 (a feature extractor). Local weights: ``pretrained=True,
  pretrained_cfg_overlay=dict(file=PATH)``.

``import diffmm`` imports this module, which registers the names.
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Union

import torch.nn as nn
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from diffmm.models.attn_adapters import adapter_class
from diffmm.models.clip.config import VisionCfg, get_model_config, list_models
from diffmm.nn import ATTENTION_LAYERS, QuickGELU
from diffmm.nn.lambdas import resolve_lambda_init


def timm_attn_layer(attn_type: str = "diff") -> type:
    """The timm ``attn_layer`` class of a registered diffmm attention type (lambda_init ``'depth'``, the paper's
    and timm's DiffAttention's; automatic backend; see :func:`set_layer_depths` for others).

    Args:
        attn_type: ``'diff'``, ``'standard'``, ``'diff_v2'``, ``'diff_upcycled'``.
    """
    if attn_type not in ATTENTION_LAYERS:
        raise ValueError(f"unknown attention type {attn_type!r}; expected one of {', '.join(ATTENTION_LAYERS)}")
    return adapter_class("timm", ATTENTION_LAYERS[attn_type][0])


def set_layer_depths(model: nn.Module, *, lambda_init: Union[str, float, None] = None,
                     backend: Optional[str] = None) -> nn.Module:
    """Give each ``model.blocks[i].attn`` (diffmm layers) ``layer_idx = i`` and re-resolve its lambda_init.

    timm passes the block depth only to its own DiffAttention; call this after building a timm model with a
    diffmm ``attn_layer``.

    Args:
        model: a timm ViT (``model.blocks``).
        lambda_init: also replace the layers' lambda_init (``'depth'``, ``'constant'`` or a number).
        backend: also set the layers' attention backend.
    """
    for i, blk in enumerate(model.blocks):
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
                attn_layer=timm_attn_layer(v.attn_type))


def timm_name(config_name: str) -> str:
    """``DiffCLIP-ViT-B-16`` -> ``diffmm_diffclip_vit_b_16``."""
    return "diffmm_" + config_name.lower().replace("-", "_")


def create_timm_vit(config_name: str, pretrained: bool = False, **kwargs) -> VisionTransformer:
    """The image tower of a diffmm config as a timm ``VisionTransformer`` (what ``timm.create_model(
    timm_name(config_name))`` builds); ``attn_backend=`` sets the attention backend, other kwargs are timm's."""
    v = get_model_config(config_name).vision_cfg
    backend = kwargs.pop("attn_backend", None)
    model = build_model_with_cfg(VisionTransformer, timm_name(config_name), pretrained,
                                 pretrained_filter_fn=checkpoint_filter_fn,
                                 feature_cfg=dict(out_indices=3, feature_cls="getter"), **{**vit_kwargs(v), **kwargs})
    return set_layer_depths(model, lambda_init=v.lambda_init, backend=backend)


def _entrypoint(config_name: str):
    """The function timm registers for ``config_name`` (timm keys its registry by the function's name)."""
    def create(pretrained: bool = False, **kwargs) -> VisionTransformer:
        return create_timm_vit(config_name, pretrained, **kwargs)

    create.__name__ = create.__qualname__ = timm_name(config_name)
    create.__doc__ = f"The image tower of diffmm's ``{config_name}`` as a timm VisionTransformer."
    return create


def _pretrained_cfg(config_name: str) -> dict:
    v = get_model_config(config_name).vision_cfg
    return dict(url="", num_classes=0, input_size=(3, v.image_size, v.image_size), pool_size=None, crop_pct=1.0,
                interpolation="bicubic", mean=v.mean, std=v.std, first_conv="patch_embed.proj", classifier="head",
                license="apache-2.0")


#: the configs registered with timm (DiffCLIP-dagger's image tower is DiffCLIP's)
TIMM_CONFIGS = [name for name in list_models() if "-dagger-" not in name]
default_cfgs = generate_default_cfgs({timm_name(n): _pretrained_cfg(n) for n in TIMM_CONFIGS})  # read by timm
TIMM_MODELS = [register_model(_entrypoint(name)).__name__ for name in TIMM_CONFIGS]
