"""The one preprocessing path of a CLIP model: image transforms and tokenizer, read from the built model.

Training (the data module and the zero-shot hook), evaluation, ``diffmm classify`` and the demo all ask the model:
:func:`transforms_for` (image size and normalisation) and :func:`tokenizer_for` (context length and truncation),
or the single answers :func:`image_size_of`, :func:`normalization_of` and :func:`truncate_of`. A diffmm config
holds them (``vision_cfg.image_size`` / ``image_mean`` / ``image_std``, ``text_cfg.context_length`` /
``truncate``); a model that open_clip built keeps open_clip's ``visual.preprocess_cfg`` and tokenizer.

:func:`image_transform` equals open_clip's ``image_transform`` (bicubic, RGB, ``ToTensor``, ``Normalize``;
``tests/models/test_preprocess.py``) with the crop scale of DiffCLIP's training recipe as the default.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.nn as nn
from PIL import Image
from torchvision import transforms as T

from diffmm.models.clip.config import OPENAI_MEAN, OPENAI_STD, CLIPConfig
from diffmm.models.clip.hf_text import HFTokenizer
from diffmm.models.clip.tokenizer import CLIPTokenizer

#: crop area range of training's ``RandomResizedCrop``: the official DiffCLIP training code's (SLIP's) (0.5, 1.0);
#: open_clip's default is (0.9, 1.0)
DEFAULT_TRAIN_SCALE = (0.5, 1.0)


def _to_rgb(img: Image.Image) -> Image.Image:
    return img.convert("RGB") if img.mode != "RGB" else img


def image_transform(image_size: int, train: bool, scale: tuple[float, float] = DEFAULT_TRAIN_SCALE,
                    mean: tuple[float, ...] = OPENAI_MEAN, std: tuple[float, ...] = OPENAI_STD) -> Callable:
    """PIL image -> normalised float tensor (3, S, S).

    Args:
        image_size: output side S.
        train: ``RandomResizedCrop(S, scale)`` if True, else resize the short side to S and center crop.
        scale: crop area range for training.
        mean, std: normalisation (OpenAI CLIP's by default).
    """
    bicubic = T.InterpolationMode.BICUBIC
    if train:
        geometry = [T.RandomResizedCrop(image_size, scale=tuple(scale), interpolation=bicubic)]
    else:
        geometry = [T.Resize(image_size, interpolation=bicubic), T.CenterCrop(image_size)]
    return T.Compose([*geometry, _to_rgb, T.ToTensor(), T.Normalize(mean, std)])


def image_size_of(model: nn.Module) -> int:
    """Input side of a model's image tower: diffmm configs, open_clip (``visual.image_size``) or timm ViTs."""
    vision = getattr(getattr(model, "config", None), "vision_cfg", None) or getattr(model, "cfg", None)
    size = getattr(vision, "image_size", None)  # DiffCLIP / diffmm ViT
    visual = getattr(model, "visual", None)
    if size is None:
        size = getattr(visual, "image_size", None) or getattr(getattr(visual, "patch_embed", None), "img_size", None)
    if isinstance(size, (tuple, list)):
        size = size[0]
    if size is None:
        raise ValueError(f"cannot tell the image size of {type(model).__name__}")
    return int(size)


def _diffmm_vision_cfg(model: nn.Module):
    """The ``VisionCfg`` of a diffmm CLIP (``config.vision_cfg``) or ViT (``cfg``), else None."""
    vision = getattr(getattr(model, "config", None), "vision_cfg", None) or getattr(model, "cfg", None)
    return vision if vision is not None and hasattr(vision, "mean") else None


def _open_clip_preprocess_cfg(model: nn.Module) -> dict:
    """An open_clip model's ``visual.preprocess_cfg`` (mean, std, interpolation, resize mode), else {}."""
    return dict(getattr(getattr(model, "visual", None), "preprocess_cfg", None) or {})


def normalization_of(model: nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` of the image normalisation a built model expects: a diffmm config's ``vision_cfg.mean`` /
    ``std`` (CLIP or ViT), open_clip's ``visual.preprocess_cfg``, else OpenAI CLIP's."""
    vision = _diffmm_vision_cfg(model)
    if vision is not None:
        return tuple(vision.mean), tuple(vision.std)
    pp = _open_clip_preprocess_cfg(model)
    if pp.get("mean") is not None and pp.get("std") is not None:
        return tuple(float(x) for x in pp["mean"]), tuple(float(x) for x in pp["std"])
    return OPENAI_MEAN, OPENAI_STD


def transforms_for(model: nn.Module, *, mean: Optional[tuple] = None, std: Optional[tuple] = None,
                   scale: tuple[float, float] = DEFAULT_TRAIN_SCALE) -> tuple[Callable, Callable]:
    """(train, val) transforms a built model expects: its image size and normalisation (:func:`normalization_of`);
    a model that open_clip built keeps the rest of its ``visual.preprocess_cfg`` (interpolation, resize mode).

    Args:
        model: the built model.
        mean / std: override the model's normalisation.
        scale: crop area range of the train transform.
    """
    model_mean, model_std = normalization_of(model)
    mean, std = mean or model_mean, std or model_std
    pp = _open_clip_preprocess_cfg(model)
    if pp and _diffmm_vision_cfg(model) is None:  # open_clip built this model, so open_clip is installed
        from open_clip.transform import PreprocessCfg, image_transform_v2

        cfg = PreprocessCfg(**{**pp, "mean": mean, "std": std})
        return (image_transform_v2(cfg, is_train=True, aug_cfg={"scale": tuple(scale)}),
                image_transform_v2(cfg, is_train=False))
    size = image_size_of(model)
    return image_transform(size, True, scale, mean, std), image_transform(size, False, mean=mean, std=std)


def truncate_of(model: nn.Module) -> str:
    """How a built model's tokenizer cuts captions over the context (``TRUNCATE_MODES``): a diffmm config's
    ``text_cfg.truncate``, else open_clip's ``'eot'``."""
    cfg = getattr(model, "config", None)
    return cfg.text_cfg.truncate if isinstance(cfg, CLIPConfig) else "eot"


def tokenizer_for(model: nn.Module, context_length: Optional[int] = None):
    """The tokenizer a built model expects: ``tokenizer(list_of_str) -> LongTensor (B, context_length)``.

    A diffmm CLIP: the CLIP BPE with its config's context length and truncation; with a Hugging Face text tower
    (``text_cfg.hf_model_name``), that encoder's own tokenizer. A model that open_clip built
    (``open_clip:NAME`` of an architecture diffmm does not implement): ``open_clip.get_tokenizer`` of that name.
    """
    cfg = getattr(model, "config", None)
    oc_name = getattr(model, "diffmm_open_clip_name", None)
    if oc_name is not None and not isinstance(cfg, CLIPConfig):
        import open_clip  # open_clip built this model, so it is installed

        return open_clip.get_tokenizer(oc_name, context_length=context_length)
    if isinstance(cfg, CLIPConfig) and cfg.text_cfg.hf_model_name:
        return HFTokenizer(cfg.text_cfg.hf_model_name, context_length or cfg.text_cfg.context_length)
    if isinstance(cfg, CLIPConfig):
        ctx = cfg.text_cfg.context_length
    else:
        ctx = getattr(model, "context_length", None) or getattr(getattr(model, "text", None), "context_length", None)
    return CLIPTokenizer(context_length or ctx or 77, truncate_of(model))
