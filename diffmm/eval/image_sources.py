"""Image sources for evaluation, all streamed in batches with bounded memory.

Labelled (``(images float (B,3,S,S), labels long (B,))`` batches, for zero-shot and linear probes):

* :class:`ImageFolderSource`: ``ROOT/<class>/<image>`` (class index = sorted folder order).
* :class:`IdxSource`: IDX image + label files (MNIST / Fashion-MNIST), read item by item.
* :class:`ShardLabelSource`: webdataset shards with a label field (``cls`` or ``json:NAME``; an index or a
  class name).

Unlabelled (for ``diffmm classify``): a :class:`MapSource` of :class:`ImageFiles` over the files of
:func:`expand_image_inputs`, whose labels are the indices of the files.

Each counts skipped (unreadable) images in :attr:`skipped`; ``num_samples`` (if known) sizes the progress bar.
"""
from __future__ import annotations

import glob
import logging
import os
import warnings
from collections import Counter
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from diffmm.data.image_text import ImageLabelDataset
from diffmm.data.stream import ShardLoader
from diffmm.eval.common import EvalError
from diffmm.eval.idx import IdxArray, find_idx_pair

log = logging.getLogger("diffmm.eval")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
UNLABELLED = ("a flat folder (or glob) of images has no labels, so accuracy cannot be measured; give labelled "
              "ROOT/<class>/<image> folders, IDX files or label shards, or predict labels of unlabelled images with "
              "`diffmm classify --labels ...`")
GLOB_CHARS = ("*", "?", "[")


class ImageFiles(Dataset):
    """Items ``(image tensor, label, "")`` of image files, or ``(None, label, why)`` for an unreadable one."""

    def __init__(self, files: list[tuple[str, int]], transform: Callable) -> None:
        self.files, self.transform = files, transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path, label = self.files[i]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Image.open(path) as img:
                    img.load()
                    return self.transform(img), label, ""
        except Exception as e:  # PIL raises many types on bad files
            return None, label, f"{path}: {type(e).__name__}: {e}"


class IdxImages(Dataset):
    """Items ``(image tensor, label, "")`` of IDX images (N, H, W) uint8 and their labels."""

    def __init__(self, images: IdxArray, labels: np.ndarray, transform: Callable) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        img = Image.fromarray(np.ascontiguousarray(self.images[i]))  # uint8 (H, W) -> mode L
        return self.transform(img), int(self.labels[i]), ""


def _collate(items):
    """Stack the readable ``(image, label, "")`` items; also return the reasons of the unreadable ones."""
    good = [(im, lb) for im, lb, _ in items if im is not None]
    images = torch.stack([im for im, _ in good]) if good else None
    return images, torch.tensor([lb for _, lb in good], dtype=torch.long), [why for im, _, why in items if im is None]


class MapSource:
    """Batches of a map-style dataset of :class:`ImageFiles` / :class:`IdxImages` items through a DataLoader;
    unreadable images are counted in :attr:`skipped` (``unreadable_image``) and the first one is logged."""

    def __init__(self, dataset: Dataset, batch_size: int, num_workers: int, name: str) -> None:
        self.dataset, self.batch_size, self.num_workers, self.name = dataset, batch_size, num_workers, name
        self.skipped: Counter = Counter()
        self.classnames: Optional[list[str]] = None

    @property
    def num_samples(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.skipped = Counter()
        for images, labels, unreadable in DataLoader(self.dataset, batch_size=self.batch_size,
                                                     num_workers=self.num_workers, collate_fn=_collate):
            if unreadable:
                if not self.skipped:
                    log.warning(f"{self.name}: skipped {unreadable[0]} (unreadable_image); further ones are only "
                                f"counted")
                self.skipped["unreadable_image"] += len(unreadable)
            if images is not None:
                yield images, labels


class ImageFolderSource(MapSource):
    """``root/<class>/<image>`` images; labels follow the sorted class folder names.

    Args:
        root: the folder.
        transform: PIL image -> tensor (the model's eval preprocess).
        classnames: names to use in prompts, one per class folder (default: folder names, ``_`` -> space).
        batch_size: images per batch.
        num_workers: DataLoader workers.
    """

    def __init__(self, root: str, transform: Callable, classnames: Optional[Sequence[str]] = None,
                 batch_size: int = 64, num_workers: int = 2) -> None:
        if not os.path.isdir(root):
            raise EvalError(f"image folder not found: {root}")
        folders = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not folders:
            if any(e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS) for e in os.scandir(root)):
                raise EvalError(f"{root}: {UNLABELLED}")
            raise EvalError(f"{root}: no class subfolders (expected ROOT/<class>/<image>)")
        if classnames is not None and len(classnames) != len(folders):
            raise EvalError(f"{len(classnames)} class names given but {root} has {len(folders)} class subfolders "
                            f"({', '.join(folders[:6])}{', ...' if len(folders) > 6 else ''})")
        files = [(os.path.join(d, n), label) for label, folder in enumerate(folders)
                 for d, _, names in sorted(os.walk(os.path.join(root, folder)))
                 for n in sorted(names) if n.lower().endswith(IMAGE_EXTENSIONS)]
        if not files:
            raise EvalError(f"{root}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in the class subfolders")
        super().__init__(ImageFiles(files, transform), batch_size, num_workers, name=root)
        self.classnames = list(classnames) if classnames is not None else [f.replace("_", " ") for f in folders]


class IdxSource(MapSource):
    """The IDX images (N, H, W) uint8 and labels (N,) of one split in a folder (MNIST file names), e.g. Fashion-MNIST.

    Args:
        folder: the folder holding ``train-*`` / ``t10k-*`` IDX files (gzipped or not).
        transform: PIL image -> tensor.
        split: ``train`` or ``test``.
        num_classes: if given, every label must be below it (one-line error otherwise).
        batch_size: images per batch.
        num_workers: DataLoader workers.
    """

    def __init__(self, folder: str, transform: Callable, *, split: str = "test", num_classes: Optional[int] = None,
                 batch_size: int = 64, num_workers: int = 0) -> None:
        images, labels = find_idx_pair(folder, split)
        img, lab = IdxArray(images), IdxArray(labels)
        if len(img.shape) != 3 or img.dtype != np.uint8:
            raise EvalError(f"{images}: expected uint8 images of shape (N, H, W); got {img.dtype} {img.shape}")
        if lab.shape != (len(img),):
            raise EvalError(f"{labels}: expected {len(img)} labels (one per image of {images}); got shape {lab.shape}")
        label_arr = lab.read_all().astype(np.int64)
        if num_classes is not None and len(label_arr) and int(label_arr.max()) >= num_classes:
            raise EvalError(f"{labels}: labels go up to {int(label_arr.max())} ({int(label_arr.max()) + 1} classes) "
                            f"but {num_classes} class names were given")
        super().__init__(IdxImages(img, label_arr, transform), batch_size, num_workers, name=images)


class ShardLabelSource:
    """Webdataset shards with images and a label (``diffmm.data.ImageLabelDataset``).

    Args:
        urls: shard spec (brace expansion allowed).
        transform: PIL image -> tensor.
        label_field: ``cls`` or ``json:NAME``: a class index, or a class name of ``classnames``.
        batch_size: images per batch.
        num_workers: DataLoader workers.
        classnames: the class names, in label order (labels that are names map to their index).
    """

    def __init__(self, urls: str | Sequence[str], transform: Callable, label_field: str = "cls",
                 batch_size: int = 64, num_workers: int = 2, classnames: Optional[Sequence[str]] = None) -> None:
        try:
            self.dataset = ImageLabelDataset(urls, batch_size, transform=transform, label_field=label_field,
                                             train=False, shuffle=False, equalize=False, name="eval",
                                             classnames=classnames)
        except (FileNotFoundError, ValueError) as e:
            raise EvalError(f"shards {urls}: {e}") from None
        self.loader, self.batch_size = ShardLoader(self.dataset, num_workers=num_workers), batch_size
        self.skipped: Counter = Counter()
        self.classnames: Optional[list[str]] = None
        self.name = str(urls)

    @property
    def num_samples(self) -> Optional[int]:
        """Images in the shards when their sizes are known (``sizes.json``, counted once), else None."""
        return self.dataset.samples_per_epoch if self.dataset.shard_counts() is not None else None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from self.loader
        snap = self.dataset.stats.snapshot()
        self.skipped = Counter({k[len("skip_"):]: v for k, v in snap.items() if k.startswith("skip_") and v})
        self.skipped.update({k: snap[k] for k in ("shards_failed", "shards_truncated") if snap.get(k)})


def open_image_source(spec: str, transform: Callable, *, classnames: Optional[Sequence[str]] = None,
                      label_field: str = "cls", split: str = "test", batch_size: int = 64,
                      num_workers: int = 2) -> MapSource | ShardLabelSource:
    """The labelled source of ``spec``: a folder of IDX files (or ``idx:FOLDER``), an image folder, or a shard spec
    (``.tar``)."""
    is_idx = spec.startswith("idx:") or (os.path.isdir(spec) and any(
        n.endswith(("idx3-ubyte", "idx3-ubyte.gz")) for n in os.listdir(spec)))
    if is_idx:
        return IdxSource(spec.removeprefix("idx:"), transform, split=split, batch_size=batch_size,
                         num_workers=num_workers, num_classes=len(classnames) if classnames else None)
    if os.path.isdir(spec):
        return ImageFolderSource(spec, transform, classnames, batch_size=batch_size, num_workers=num_workers)
    if ".tar" in spec or spec.startswith("pipe:"):
        return ShardLabelSource(spec, transform, label_field, batch_size=batch_size, num_workers=num_workers,
                                classnames=classnames)
    if any(c in spec for c in GLOB_CHARS) or (os.path.isfile(spec) and spec.lower().endswith(IMAGE_EXTENSIONS)):
        raise EvalError(f"{spec}: {UNLABELLED}")
    raise EvalError(f"dataset {spec!r}: not a folder, idx:FOLDER or a .tar shard spec")


# ------------------------------------------------------------------------------------------- unlabelled images
def expand_image_inputs(specs: Sequence[str]) -> list[str]:
    """Image files of command-line inputs, in order, each once: files as given, folders searched recursively
    (sorted; files with an image extension), glob patterns (``**`` allowed) expanded and sorted.

    A spec that matches nothing is a one-line error naming it. Files are not opened here: unreadable ones are
    skipped and counted by the :class:`MapSource` that reads them.
    """
    out: dict[str, None] = {}
    for spec in specs:
        if os.path.isdir(spec):
            found = [os.path.join(d, n) for d, _, names in sorted(os.walk(spec)) for n in sorted(names)
                     if n.lower().endswith(IMAGE_EXTENSIONS) and not n.startswith(".")]
            if not found:
                raise EvalError(f"{spec}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in this folder")
        elif os.path.isfile(spec):
            found = [spec]
        elif any(c in spec for c in GLOB_CHARS):
            found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not found:
                raise EvalError(f"{spec}: the pattern matches no files")
        else:
            raise EvalError(f"{spec}: no such image file, folder or pattern")
        out.update(dict.fromkeys(found))
    return list(out)

