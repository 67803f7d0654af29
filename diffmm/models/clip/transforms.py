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


def transforms_for(model, *, mean: Optional[tuple] = None, std: Optional[tuple] = None,
                   aug_cfg: Optional[dict] = None) -> tuple[Callable, Callable]:
    """(train, val) transforms a built model expects: its image size and its normalisation (diffmm config
    ``vision_cfg.image_mean`` / ``image_std``, or open_clip's ``visual.preprocess_cfg``); ``mean`` / ``std``
    override."""
    vision = getattr(getattr(model, "config", None), "vision_cfg", None) or getattr(model, "cfg", None)
    if vision is not None and hasattr(vision, "mean"):  # diffmm CLIP or ViT
        return clip_transforms(image_size_of(model), mean=mean or vision.mean, std=std or vision.std, aug_cfg=aug_cfg)
    pp = dict(getattr(getattr(model, "visual", None), "preprocess_cfg", None) or {})
    if pp:  # an open_clip model: its own preprocessing
        from open_clip.transform import PreprocessCfg, image_transform_v2

        pp.update({k: v for k, v in (("mean", mean), ("std", std)) if v is not None})
        cfg = PreprocessCfg(**pp)
        aug = {"scale": tuple(DEFAULT_TRAIN_SCALE), **(aug_cfg or {})}
        return image_transform_v2(cfg, is_train=True, aug_cfg=aug), image_transform_v2(cfg, is_train=False)
    return clip_transforms(image_size_of(model), mean=mean, std=std, aug_cfg=aug_cfg)
