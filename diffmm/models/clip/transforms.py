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
