"""Optional zero-shot classification during training, through ``diffmm.eval.zeroshot`` (what ``diffmm eval
zeroshot`` runs)."""
from __future__ import annotations

import logging
from typing import Optional

import torch.nn as nn

from diffmm.eval.classnames import get_classnames
from diffmm.eval.image_sources import open_image_source
from diffmm.eval.zeroshot import zero_shot
from diffmm.models.clip.preprocess import tokenizer_for, transforms_for

log = logging.getLogger("diffmm.train")


class ZeroShotHook:
    """Zero-shot top-1/top-5 on a labelled image set, run at the end of validation epochs on rank 0.

    Args:
        dataset: image source spec of ``diffmm.eval.image_sources.open_image_source`` (image folder,
            ``idx:FOLDER`` for Fashion-MNIST, or label shards).
        classnames: built-in name, file or list (``diffmm.eval.classnames.get_classnames``).
        templates: built-in name, file or list of prompt templates.
        every_n_epochs: run when ``(epoch + 1) % every_n_epochs == 0``.
        batch_size, num_workers: of the image source.
        max_batches: stop after this many batches (quick checks).
        label_field: label key of shards (``cls`` or ``json:NAME``).
        split: IDX split (``train``/``test``).
    """

    def __init__(self, dataset: str, classnames: str | list[str], templates: str | list[str] = "simple",
                 every_n_epochs: int = 1, batch_size: int = 64, num_workers: int = 0,
                 max_batches: Optional[int] = None, label_field: str = "cls", split: str = "test") -> None:
        self.dataset, self.classnames, self.templates = dataset, classnames, templates
        self.every_n_epochs, self.batch_size, self.num_workers = max(1, every_n_epochs), batch_size, num_workers
        self.max_batches, self.label_field, self.split = max_batches, label_field, split

    def run(self, model: nn.Module, *, epoch: int, rank: int = 0) -> dict[str, float]:
        """Evaluate ``model`` with its own preprocessing (image size, mean/std, tokenizer truncation: what
        ``diffmm eval`` uses); returns ``{"top1": ..., "top5": ...}`` or ``{}`` when skipped."""
        if rank != 0 or (epoch + 1) % self.every_n_epochs:
            return {}
        names = get_classnames(self.classnames)
        _, transform = transforms_for(model)
        source = open_image_source(self.dataset, transform, classnames=names, label_field=self.label_field,
                                   split=self.split, batch_size=self.batch_size, num_workers=self.num_workers)
        was_training = model.training
        model.eval()
        try:
            result = zero_shot(model, tokenizer_for(model), source, names, self.templates,
                               show_progress=False, max_batches=self.max_batches)
        finally:
            model.train(was_training)
        log.info("zero-shot epoch %d: top1 %.4f top5 %.4f on %d images", epoch, result.top1, result.top5, result.n)
        return {"top1": result.top1, "top5": result.top5}
