"""Image-text and image-label batches from img2dataset-style shards (``KEY.jpg|png|webp`` + ``KEY.txt`` +
``KEY.json``)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from diffmm.data.decode import MAX_IMAGE_PIXELS, class_index, decode_image, decode_text, parse_label
from diffmm.data.stream import ShardLoader, ShardStream
from diffmm.models.clip.preprocess import image_transform
from diffmm.models.clip.tokenizer import CLIPTokenizer


class _ImageStream(ShardStream):
    def __init__(self, urls: str | Sequence[str], batch_size: int, transform: Callable | None = None,
                 image_size: int = 224, train: bool = True, max_image_pixels: int | None = MAX_IMAGE_PIXELS,
                 **kwargs: Any) -> None:
        kwargs.setdefault("shuffle", train)
        kwargs.setdefault("equalize", train)
        super().__init__(urls, batch_size, **kwargs)
        self.transform = transform if transform is not None else image_transform(image_size, train=train)
        self.max_image_pixels = max_image_pixels

    def _image(self, sample: dict) -> torch.Tensor | None:
        where = f"{sample['__url__']}:{sample['__key__']}"
        img = decode_image(sample, self.stats, where, self.max_image_pixels)
        if img is None:
            return None
        try:
            return self.transform(img)
        except Exception as e:
            self.stats.skip("corrupt_image", where, f"transform failed: {type(e).__name__}: {e}")
            return None


class ImageTextDataset(_ImageStream):
    """Batches ``(images float (B,3,S,S), tokens long (B, context_length))``.

    Decoding, the transform and tokenization run in the DataLoader workers. Samples with a
    corrupt or missing image, no ``.txt`` or a non-UTF-8 caption are skipped and counted in
    :attr:`stats`. See :class:`~diffmm.data.stream.ShardStream` for the sharding/epoch arguments.

    Args:
        urls: shard spec.
        batch_size: per-rank batch size.
        transform: PIL -> tensor; default :func:`~diffmm.models.clip.preprocess.image_transform` (``image_size``,
            ``train``; OpenAI CLIP's mean/std). A model's own: ``diffmm.models.clip.preprocess.transforms_for(model)``.
        tokenizer: list[str] -> LongTensor; default the CLIP BPE with ``context_length`` (open_clip's truncation).
            A model's own: ``diffmm.models.clip.preprocess.tokenizer_for(model)``.
        image_size: for the default transform.
        context_length: for the default tokenizer.
        train: default transform kind; also the default for ``shuffle`` and ``equalize``.
        text_field: caption field (file extension).
        max_image_pixels: skip images with more pixels than this (``image_too_large``; default: Pillow's
            decompression-bomb threshold, about 89 M; ``None``: no cap).
        **kwargs: :class:`ShardStream` options (also ``stages``, ``handler``, ``max_member_bytes``,
            ``pipe_timeout``).

    Example (webdataset stages on the raw samples, before the decoding above)::

        ds = ImageTextDataset(urls, 64, stages=[wds.select(is_wide), wds.map(add_prefix)],
                              handler=wds.warn_and_continue)
    """

    def __init__(self, urls: str | Sequence[str], batch_size: int, transform: Callable | None = None,
                 tokenizer: Callable | None = None, image_size: int = 224, context_length: int = 77,
                 train: bool = True, text_field: str = "txt", **kwargs: Any) -> None:
        super().__init__(urls, batch_size, transform, image_size, train, **kwargs)
        self.tokenizer = tokenizer if tokenizer is not None else CLIPTokenizer(context_length)
        self.text_field = text_field

    def _process(self, sample: dict) -> tuple[torch.Tensor, str] | None:
        caption = decode_text(sample, self.text_field, self.stats, f"{sample['__url__']}:{sample['__key__']}")
        if caption is None:
            return None
        image = self._image(sample)
        return None if image is None else (image, caption.strip())

    def _collate(self, items: list[tuple[torch.Tensor, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.stack([im for im, _ in items])
        tokens = self.tokenizer([c for _, c in items])
        return images, torch.as_tensor(tokens, dtype=torch.long)


class ImageLabelDataset(_ImageStream):
    """Batches ``(images float (B,3,S,S), labels long (B,))`` for zero-shot and linear-probe evaluation.

    Args:
        label_field: ``"cls"`` (a ``KEY.cls`` text file) or ``"json:NAME"`` (a field of ``KEY.json``): a class
            index, or a class name of ``classnames``.
        classnames: the class names, in label order (labels that are names map to their index).
        Other arguments as :class:`ImageTextDataset`; ``train`` defaults to False here.
    """

    def __init__(self, urls: str | Sequence[str], batch_size: int, transform: Callable | None = None,
                 image_size: int = 224, label_field: str = "cls", train: bool = False,
                 classnames: Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(urls, batch_size, transform, image_size, train, **kwargs)
        self.label_field = label_field
        self.label_names = class_index(classnames) if classnames is not None else None

    def _process(self, sample: dict) -> tuple[torch.Tensor, int] | None:
        where = f"{sample['__url__']}:{sample['__key__']}"
        try:
            label = parse_label(sample, self.label_field, self.label_names)
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            self.stats.skip("bad_label", where, f"{self.label_field}: {type(e).__name__}: {e}")
            return None
        image = self._image(sample)
        return None if image is None else (image, label)

    def _collate(self, items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([im for im, _ in items]), torch.tensor([lb for _, lb in items], dtype=torch.long)


def image_text_loader(urls: str | Sequence[str], batch_size: int, num_workers: int = 2, *,
                      persistent_workers: bool = False, pin_memory: bool = False,
                      multiprocessing_context: str | None = None, **dataset_kwargs: Any) -> ShardLoader:
    """A :class:`ShardLoader` over an :class:`ImageTextDataset` (kwargs go to the dataset).

    Example:
        >>> loader = image_text_loader("data/emoji/noto/emoji-noto-{000000..000003}.tar", 64,
        ...                            num_workers=2, image_size=64)          # doctest: +SKIP
        >>> images, tokens = next(iter(loader))                                # doctest: +SKIP
    """
    ds = ImageTextDataset(urls, batch_size, **dataset_kwargs)
    return ShardLoader(ds, num_workers=num_workers, persistent_workers=persistent_workers and num_workers > 0,
                       pin_memory=pin_memory, multiprocessing_context=multiprocessing_context)


def image_label_loader(urls: str | Sequence[str], batch_size: int, num_workers: int = 2,
                       **dataset_kwargs: Any) -> ShardLoader:
    """A :class:`ShardLoader` over an :class:`ImageLabelDataset` (kwargs go to the dataset)."""
    return ShardLoader(ImageLabelDataset(urls, batch_size, **dataset_kwargs), num_workers=num_workers)
