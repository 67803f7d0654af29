"""open_clip-style image transforms for a model config (image size from ``vision_cfg``)."""
from __future__ import annotations

from typing import Callable, Optional

# SPEC section 3 recipe: RandomResizedCrop(scale 0.5-1.0); open_clip's default is (0.9, 1.0).
DEFAULT_TRAIN_SCALE = (0.5, 1.0)


def clip_transforms(image_size: int, *, mean: Optional[tuple] = None, std: Optional[tuple] = None,
                    train_scale: tuple[float, float] = DEFAULT_TRAIN_SCALE,
                    aug_cfg: Optional[dict] = None) -> tuple[Callable, Callable]:
    """(train, val) transforms: PIL image -> normalised (3, S, S) tensor.

    Train: ``RandomResizedCrop(S, scale=train_scale)`` (bicubic), RGB, ToTensor, Normalize.
    Val: resize the short side to S (bicubic), center crop, RGB, ToTensor, Normalize.
    ``aug_cfg`` is open_clip's ``AugmentationCfg`` as a dict and overrides ``train_scale``.
    """
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
    from open_clip.transform import image_transform

    mean, std = mean or OPENAI_DATASET_MEAN, std or OPENAI_DATASET_STD
    aug = {"scale": tuple(train_scale), **(aug_cfg or {})}
    train = image_transform(image_size, is_train=True, mean=mean, std=std, aug_cfg=aug)
    val = image_transform(image_size, is_train=False, mean=mean, std=std)
    return train, val


def image_size_of(model) -> int:
    """Input side of a model's image tower: diffmm configs, open_clip (``visual.image_size``) or timm ViTs."""
    cfg = getattr(model, "config", None)
    vision = getattr(cfg, "vision_cfg", None) or getattr(model, "cfg", None)  # DiffCLIP / diffmm ViT
    size = getattr(vision, "image_size", None)
    visual = getattr(model, "visual", None)
    if size is None:
        size = getattr(visual, "image_size", None) or getattr(getattr(visual, "patch_embed", None), "img_size", None)
    if isinstance(size, (tuple, list)):
        size = size[0]
    if size is None:
        raise ValueError(f"cannot tell the image size of {type(model).__name__}")
    return int(size)


def _diffmm_vision_cfg(model):
    """The ``VisionCfg`` of a diffmm CLIP (``config.vision_cfg``) or ViT (``cfg``), else None."""
    vision = getattr(getattr(model, "config", None), "vision_cfg", None) or getattr(model, "cfg", None)
    return vision if vision is not None and hasattr(vision, "mean") else None


def _open_clip_preprocess_cfg(model) -> dict:
    """An open_clip model's ``visual.preprocess_cfg`` (mean, std, interpolation, resize mode), else {}."""
    return dict(getattr(getattr(model, "visual", None), "preprocess_cfg", None) or {})


def normalization_of(model) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` of the image normalisation a built model expects: a diffmm config's ``vision_cfg.mean`` /
    ``std`` (CLIP or ViT), open_clip's ``visual.preprocess_cfg``, else OpenAI CLIP's. The one answer to that question:
    :func:`transforms_for`, evaluation and training (``CLIPModule.image_mean`` / ``image_std``) all read it."""
    from diffmm.models.clip.config import OPENAI_MEAN, OPENAI_STD

    vision = _diffmm_vision_cfg(model)
    if vision is not None:
        return tuple(vision.mean), tuple(vision.std)
    pp = _open_clip_preprocess_cfg(model)
    if pp.get("mean") is not None and pp.get("std") is not None:
        return tuple(float(x) for x in pp["mean"]), tuple(float(x) for x in pp["std"])
    return OPENAI_MEAN, OPENAI_STD


def transforms_for(model, *, mean: Optional[tuple] = None, std: Optional[tuple] = None,
                   aug_cfg: Optional[dict] = None) -> tuple[Callable, Callable]:
    """(train, val) transforms a built model expects: its image size and its normalisation
    (:func:`normalization_of`); open_clip models keep the rest of their ``visual.preprocess_cfg`` (interpolation,
    resize mode). ``mean`` / ``std`` override."""
    model_mean, model_std = normalization_of(model)
    mean, std = mean or model_mean, std or model_std
    pp = _open_clip_preprocess_cfg(model)
    if pp and _diffmm_vision_cfg(model) is None:  # an open_clip model: its own preprocessing
        from open_clip.transform import PreprocessCfg, image_transform_v2

        cfg = PreprocessCfg(**{**pp, "mean": mean, "std": std})
        aug = {"scale": tuple(DEFAULT_TRAIN_SCALE), **(aug_cfg or {})}
        return image_transform_v2(cfg, is_train=True, aug_cfg=aug), image_transform_v2(cfg, is_train=False)
    return clip_transforms(image_size_of(model), mean=mean, std=std, aug_cfg=aug_cfg)
