"""open_clip-style image transforms (CLIP mean/std, bicubic)."""
from __future__ import annotations

from typing import Callable

from PIL import Image
from torchvision import transforms as T

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _to_rgb(img: Image.Image) -> Image.Image:
    return img.convert("RGB") if img.mode != "RGB" else img


def image_transform(image_size: int, train: bool, scale: tuple[float, float] = (0.5, 1.0),
                    mean: tuple[float, ...] = CLIP_MEAN, std: tuple[float, ...] = CLIP_STD) -> Callable:
    """PIL image -> normalised float tensor (3, S, S).

    Args:
        image_size: output side S.
        train: ``RandomResizedCrop(S, scale)`` if True, else resize the short side to S and center crop.
        scale: crop area range for training (the DiffCLIP recipe uses 0.5-1.0).
        mean, std: normalisation (CLIP's by default).
    """
    bicubic = T.InterpolationMode.BICUBIC
    if train:
        geometry = [T.RandomResizedCrop(image_size, scale=scale, interpolation=bicubic)]
    else:
        geometry = [T.Resize(image_size, interpolation=bicubic), T.CenterCrop(image_size)]
    return T.Compose([*geometry, _to_rgb, T.ToTensor(), T.Normalize(mean, std)])
