"""LightningDataModules over ``diffmm.data``: image-text shards (CLIP) and text shards (LMs).

The tokenizer, context length, image size and the model's preprocessing (image mean/std, caption
truncation) are linked from the model by the CLI (``diffmm.train.cli``), so a config names them once. Training loaders are
:class:`~diffmm.train.resume.ResumableLoader`\\ s: Lightning saves their position (epoch, batches
consumed) in every checkpoint through the stateful-dataloader protocol and ``fit --ckpt_path``
restores it. Shards need no ``sizes.json``: they are counted once and cached
(:mod:`diffmm.data.sizes`).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import pytorch_lightning as pl

from diffmm.data.tar_reader import MAX_MEMBER_BYTES, PIPE_TIMEOUT
from diffmm.train.errors import ConfigError
from diffmm.train.resume import ResumableLoader

log = logging.getLogger("diffmm.train")

STAGES = ("train", "val", "test", "predict")
#: Pillow's decompression-bomb threshold (``diffmm.data.decode.MAX_IMAGE_PIXELS``), without importing PIL here
MAX_IMAGE_PIXELS = 89_478_485


def check_shard_spec(spec: Optional[str], key: str) -> None:
    """Raise a one-line :class:`ConfigError` naming ``key`` when local shards of ``spec`` are missing."""
    if not spec:
        return
    from diffmm.data.urls import check_shards_exist, expand_sources

    try:
        urls = [u for s in expand_sources(spec) for u in s.urls]
        check_shards_exist(urls)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from None


class ShardDataModule(pl.LightningDataModule):
    """Shared logic of the shard data modules (see subclasses for the arguments)."""

    def __init__(self, train_shards: Optional[str], val_shards: Optional[str], test_shards: Optional[str],
                 predict_shards: Optional[str], batch_size: int, val_batch_size: Optional[int], num_workers: int,
                 seed: int, resampled: bool, samples_per_epoch: Optional[int], train_weights: Optional[list[float]],
                 shuffle_buffer: int, val_samples: Optional[int], max_member_bytes: Optional[int] = None,
                 pipe_timeout: Optional[float] = None) -> None:
        super().__init__()
        self.shards = {"train": train_shards, "val": val_shards, "test": test_shards or val_shards,
                       "predict": predict_shards or val_shards}
        self._own_shards = {"test": bool(test_shards), "predict": bool(predict_shards)}
        for key, spec in (("train_shards", train_shards), ("val_shards", val_shards), ("test_shards", test_shards),
                          ("predict_shards", predict_shards)):
            check_shard_spec(spec, f"data.{key}")
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.num_workers, self.seed = num_workers, seed
        self.resampled, self.samples_per_epoch, self.train_weights = resampled, samples_per_epoch, train_weights
        self.shuffle_buffer, self.val_samples = shuffle_buffer, val_samples
        self.read_kwargs: dict[str, Any] = {"max_member_bytes": max_member_bytes, "pipe_timeout": pipe_timeout}
        self._loaders: dict[str, ResumableLoader] = {}
        self._restored: Optional[dict] = None
        self._said_fallback: set[str] = set()

    # ----- subclass hooks -----------------------------------------------------------------------
    def make_dataset(self, urls: str, train: bool, batch_size: int, **kwargs: Any):
        raise NotImplementedError

    def eval_equalize(self) -> bool:
        """Whether evaluation streams give every rank the same number of batches.

        On by default under DDP (uneven evaluation batch counts can hang collectives in forward);
        then the last incomplete global batch is dropped.
        """
        return self._world()[1] > 1

    # ----- helpers ------------------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        return 0, 1

    def _trainer_epoch(self) -> int:
        if self.trainer is None:
            return 0
        return int(self.trainer.fit_loop.epoch_progress.current.processed)

    def _loader(self, stage: str) -> Optional[ResumableLoader]:
        from diffmm.data.stream import ShardLoader

        spec = self.shards[stage]
        if not spec:
            return None
        rank, world = self._world()
        train = stage == "train"
        if train:
            ds = self.make_dataset(spec, True, self.batch_size, resampled=self.resampled,
                                   samples_per_epoch=self.samples_per_epoch, weights=self.train_weights,
                                   shuffle_buffer=self.shuffle_buffer, seed=self.seed, rank=rank, world_size=world,
                                   name=f"{stage}-data", **self.read_kwargs)
        else:
            kwargs: dict[str, Any] = dict(shuffle=False, equalize=self.eval_equalize(), rank=rank, world_size=world,
                                          name=f"{stage}-data", **self.read_kwargs)
            if self.val_samples is not None:
                kwargs["samples_per_epoch"] = self.val_samples
            if stage == "predict":  # predictions carry the sample keys, and every sample is predicted
                kwargs["equalize"] = False
            ds = self.make_dataset(spec, False, self.val_batch_size, **kwargs)
            ds.with_keys = stage == "predict"
        if train:
            loader = ResumableLoader(ShardLoader(ds, num_workers=self.num_workers), seed=self.seed, rank=rank,
                                     default_epoch=self._trainer_epoch, position=self._train_position,
                                     signature=self._signature)
        else:
            loader = ResumableLoader(ShardLoader(ds, num_workers=self.num_workers), seed=self.seed, rank=rank,
                                     default_epoch=lambda: 0)
        if train and self._restored is not None:
            self._apply_position(loader, self._restored)
            self._restored = None
        self._loaders[stage] = loader
        return loader

    def _say_fallback(self, stage: str) -> None:
        """One info line when test/predict read the validation shards because their own are not set."""
        if stage not in self._said_fallback and not self._own_shards[stage] and self.shards[stage]:
            self._said_fallback.add(stage)
            if self._world()[0] == 0:
                log.info("%s: data.%s_shards is not set; using the validation shards (data.val_shards: %s)",
                         stage, stage, self.shards[stage])

    def train_dataloader(self):
        if not self.shards["train"]:
            raise ConfigError("data.train_shards is not set; fit needs training shards")
        return self._loader("train")

    def val_dataloader(self):
        return self._loader("val") or []

    def test_dataloader(self):
        if not self.shards["test"]:
            raise ConfigError("data.test_shards (or data.val_shards) is not set; test needs shards")
        self._say_fallback("test")
        return self._loader("test")

    def predict_dataloader(self):
        if not self.shards["predict"]:
            raise ConfigError("data.predict_shards (or data.val_shards) is not set; predict needs shards")
        self._say_fallback("predict")
        return self._loader("predict")

    def predict_keys(self) -> list[str]:
        """Sample keys of the rows ``predict`` has read so far on this rank, in prediction order
        (image-text: the shard sample key; LM rows: ``KEY:T``, the document and token where the row starts)."""
        loader = self._loaders.get("predict")
        return list(loader.keys) if loader is not None else []

    def data_stats(self, stage: str = "train"):
        """The :class:`~diffmm.data.stats.DataStats` of a stage's stream (None before it exists)."""
        loader = self._loaders.get(stage)
        return None if loader is None else loader.dataset.stats

    # ----- data position in checkpoints ---------------------------------------------------------
    def _signature(self) -> dict:
        return {"train_shards": self.shards["train"], "batch_size": self.batch_size, "seed": self.seed,
                "world_size": self._world()[1], "num_workers": self.num_workers, "resampled": self.resampled}

    def _train_position(self) -> dict:
        """``{"epoch", "batches", "epoch_batches"}`` of the training stream from the trainer's progress."""
        loader = self._loaders["train"]
        if self.trainer is None:
            return {"epoch": loader.epoch, "batches": loader._yielded}
        done = int(self.trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        total = self.trainer.num_training_batches
        epoch, batches = (loader.epoch + 1, 0) if done >= total else (loader.epoch, done)
        return {"epoch": epoch, "batches": batches, "epoch_batches": total}

    def load_state_dict(self, state: dict) -> None:
        """Restore a data position that older checkpoints kept in the data module's own state (newer
        ones keep it in the training loader's state, see :class:`~diffmm.train.resume.ResumableLoader`)."""
        if not state or "epoch" not in state:
            return
        if "train" in self._loaders:
            self._loaders["train"].load_state_dict(state)
        else:
            self._restored = state

    @staticmethod
    def _apply_position(loader: ResumableLoader, state: dict) -> None:
        loader.load_state_dict(state)


class ImageTextDataModule(ShardDataModule):
    """(images, tokens) batches from img2dataset-style shards for contrastive training.

    Args:
        train_shards: shard spec (brace expansion, ``::`` between sources, ``pipe:`` commands).
        val_shards: held-out shards for validation (also test/predict unless those are given).
        test_shards, predict_shards: shards of ``diffmm test`` / ``diffmm predict``.
        batch_size: per-device training batch (global = batch_size x devices x nodes).
        val_batch_size: per-device evaluation batch (default ``batch_size``).
        num_workers: DataLoader workers per device (decode, augment, tokenize).
        seed: shuffling and augmentation seed (the same on every rank; the rank is mixed in).
        resampled: draw shards with replacement (needs ``samples_per_epoch`` or sizes.json).
        samples_per_epoch: samples per epoch over all ranks; default from ``sizes.json``.
        train_weights: per-source sampling weights (``resampled`` only).
        shuffle_buffer: sample shuffle buffer.
        val_samples: evaluation samples per epoch over all ranks (default: all).
        image_size, context_length, tokenizer: linked from the model by the CLI (None: 224, 77, ``clip``).
        image_mean, image_std: image normalisation of every stage (train/val/test/predict); linked from the
            model by the CLI (its config's ``vision_cfg.image_mean`` / ``image_std``, or an open_clip model's
            ``preprocess_cfg``); None: OpenAI CLIP's.
        truncate: how captions over ``context_length`` tokens are cut: ``eot`` (open_clip: end-of-text kept last)
            or ``cut`` (the official DiffCLIP tokenizer); linked from the model's ``text_cfg.truncate`` by the CLI
            (None: ``eot``).

    Under the CLI the linked arguments are the model's: a different value set in the data config is an error.
        crop_scale: RandomResizedCrop area range (DiffCLIP: 0.5-1.0).
        text_field: caption extension in the shards.
        max_member_bytes: skip samples with a tar member larger than this, without reading it
            (default 64 MiB; ``null``: no cap).
        max_image_pixels: skip images with more pixels than this (default: Pillow's
            decompression-bomb threshold, 89,478,485; ``null``: no cap).
        pipe_timeout: seconds a ``pipe:`` shard command may send nothing before it is killed and
            the shard counted as failed (default 120; ``null``: wait forever).
    """

    def __init__(self, train_shards: Optional[str] = None, val_shards: Optional[str] = None,
                 test_shards: Optional[str] = None, predict_shards: Optional[str] = None, batch_size: int = 64,
                 val_batch_size: Optional[int] = None, num_workers: int = 2, seed: int = 0, resampled: bool = False,
                 samples_per_epoch: Optional[int] = None, train_weights: Optional[list[float]] = None,
                 shuffle_buffer: int = 1000, val_samples: Optional[int] = None, image_size: Optional[int] = None,
                 context_length: Optional[int] = None, tokenizer: Optional[str] = None,
                 image_mean: Optional[tuple[float, float, float]] = None,
                 image_std: Optional[tuple[float, float, float]] = None, truncate: Optional[str] = None,
                 crop_scale: tuple[float, float] = (0.5, 1.0), text_field: str = "txt",
                 max_member_bytes: Optional[int] = MAX_MEMBER_BYTES, max_image_pixels: Optional[int] = MAX_IMAGE_PIXELS,
                 pipe_timeout: Optional[float] = PIPE_TIMEOUT) -> None:
        super().__init__(train_shards, val_shards, test_shards, predict_shards, batch_size, val_batch_size,
                         num_workers, seed, resampled, samples_per_epoch, train_weights, shuffle_buffer, val_samples,
                         max_member_bytes, pipe_timeout)
        self.max_image_pixels = max_image_pixels
        if tokenizer not in (None, "clip", "clip-bpe"):
            raise ConfigError(f"data.tokenizer {tokenizer!r}: image-text training uses the CLIP BPE ('clip')")
        from diffmm.models.clip.config import OPENAI_MEAN, OPENAI_STD, TRUNCATE_MODES

        self.image_size, self.context_length = image_size or 224, context_length or 77
        self.image_mean = _normalisation(image_mean, OPENAI_MEAN, "data.image_mean")
        self.image_std = _normalisation(image_std, OPENAI_STD, "data.image_std")
        if any(s <= 0 for s in self.image_std):
            raise ConfigError(f"data.image_std must be positive, got {list(self.image_std)}")
        if truncate not in (None, *TRUNCATE_MODES):
            raise ConfigError(f"data.truncate {truncate!r}; expected one of {', '.join(TRUNCATE_MODES)}")
        self.truncate = truncate or "eot"
        self.crop_scale, self.text_field = tuple(crop_scale), text_field

    def make_dataset(self, urls: str, train: bool, batch_size: int, **kwargs: Any):
        from diffmm.data.image_text import ImageTextDataset
        from diffmm.data.transforms import image_transform
        from diffmm.models.clip.tokenizer import CLIPTokenizer

        transform = image_transform(self.image_size, train=train, scale=self.crop_scale, mean=self.image_mean,
                                    std=self.image_std)
        tokenizer = CLIPTokenizer(self.context_length, self.truncate)
        return ImageTextDataset(urls, batch_size, transform=transform, tokenizer=tokenizer,
                                context_length=self.context_length, train=train, text_field=self.text_field,
                                max_image_pixels=self.max_image_pixels, **kwargs)


def _normalisation(value: Optional[tuple], default: tuple, key: str) -> tuple[float, ...]:
    """``value`` (or ``default`` when None) as a tuple of 3 floats; a one-line ConfigError naming ``key`` otherwise."""
    if value is None:
        return tuple(default)
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        out = ()
    if len(out) != 3:
        raise ConfigError(f"{key} must be 3 numbers (one per RGB channel), got {value!r}")
    return out


class TextDataModule(ShardDataModule):
    """Packed ``(B, context_length + 1)`` token rows from text shards for LM training.

    Args:
        train_shards, val_shards, test_shards, predict_shards, batch_size, val_batch_size, num_workers, seed,
            resampled, samples_per_epoch (rows), train_weights, shuffle_buffer (documents), val_samples
            (rows): as in :class:`ImageTextDataModule`.
        context_length: model sequence length (linked from the model; None: 128).
        tokenizer: ``clip`` or a ``tokenizer.json`` path (linked from the model; None: ``clip``).
        text_field: document extension in the shards.
        max_member_bytes, pipe_timeout: as in :class:`ImageTextDataModule`.

    Evaluation streams always cut an equal number of rows per rank (from ``tokens.json``).
    """

    def __init__(self, train_shards: Optional[str] = None, val_shards: Optional[str] = None,
                 test_shards: Optional[str] = None, predict_shards: Optional[str] = None, batch_size: int = 8,
                 val_batch_size: Optional[int] = None, num_workers: int = 1, seed: int = 0, resampled: bool = False,
                 samples_per_epoch: Optional[int] = None, train_weights: Optional[list[float]] = None,
                 shuffle_buffer: int = 100, val_samples: Optional[int] = None, context_length: Optional[int] = None,
                 tokenizer: Optional[str] = None, text_field: str = "txt",
                 max_member_bytes: Optional[int] = MAX_MEMBER_BYTES, pipe_timeout: Optional[float] = PIPE_TIMEOUT) -> None:
        super().__init__(train_shards, val_shards, test_shards, predict_shards, batch_size, val_batch_size,
                         num_workers, seed, resampled, samples_per_epoch, train_weights, shuffle_buffer, val_samples,
                         max_member_bytes, pipe_timeout)
        self.context_length = context_length or 128
        self.tokenizer_spec = tokenizer or "clip"
        self.text_field = text_field
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The loaded LM tokenizer."""
        if self._tokenizer is None:
            from diffmm.data.tokenizers import load_lm_tokenizer

            try:
                self._tokenizer = load_lm_tokenizer(self.tokenizer_spec)
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"data.tokenizer: {e}") from None
        return self._tokenizer

    def eval_equalize(self) -> bool:
        return True

    def make_dataset(self, urls: str, train: bool, batch_size: int, **kwargs: Any):
        from diffmm.data.text import TextDataset

        return TextDataset(urls, batch_size, self.context_length, tokenizer=self.tokenizer, train=train,
                           text_field=self.text_field, **kwargs)
