"""LightningDataModules over ``diffmm.data``: image-text shards (CLIP), text shards (LMs) and generated associative
recall (MQAR, :mod:`diffmm.data.recall`).

Each data module follows the model it feeds: in ``setup`` it reads from ``trainer.lightning_module`` what the data
must match (a CLIP model's preprocessing through :func:`~diffmm.models.clip.preprocess.transforms_for` and
:func:`~diffmm.models.clip.preprocess.tokenizer_for`; an LM module's ``tokenizer`` and ``context_length``; the
recall vocabulary), so a config names them once. Such an argument set in the data config to a different value is
a one-line :class:`~diffmm.train.errors.ConfigError` naming both; without a model (data-only use) the arguments
and their defaults apply. Shard training loaders are :class:`~diffmm.train.resume.ResumableLoader`\\ s that start each
epoch where :class:`~diffmm.train.resume.TrainingProgress` says training stands, so ``fit --ckpt_path`` resumes
exactly. Shards need no ``sizes.json``: they are counted once and cached
(:mod:`diffmm.data.sizes`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Literal, Optional

import pytorch_lightning as pl
import torch

from diffmm.data.decode import MAX_IMAGE_PIXELS
from diffmm.data.image_text import ImageTextDataset
from diffmm.data.recall import SAMPLERS, RecallStream, RecallTask, eval_batches, task_grid
from diffmm.data.stream import ShardLoader
from diffmm.data.tar_reader import MAX_MEMBER_BYTES, PIPE_TIMEOUT
from diffmm.data.text import TextDataset
from diffmm.data.tokenizers import load_lm_tokenizer
from diffmm.data.urls import check_shards_exist, expand_sources
from diffmm.models.clip.config import OPENAI_MEAN, OPENAI_STD, TRUNCATE_MODES
from diffmm.models.clip.preprocess import (image_size_of, image_transform, normalization_of, tokenizer_for,
                                          transforms_for, truncate_of)
from diffmm.models.clip.tokenizer import CLIPTokenizer
from diffmm.train.errors import ConfigError
from diffmm.train.resume import ResumableLoader, TrainingProgress

log = logging.getLogger("diffmm.train")


def check_shard_spec(spec: Optional[str], key: str) -> None:
    """Raise a one-line :class:`ConfigError` naming ``key`` when local shards of ``spec`` are missing."""
    if spec:
        try:
            check_shards_exist([u for s in expand_sources(spec) for u in s.urls])
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"{key}: {e}") from None


def _plain(value: Any) -> Any:
    """A config value as YAML writes it (tuples as lists), for comparing and showing."""
    return [float(v) for v in value] if isinstance(value, (tuple, list)) else value


def follow_model(data: Any, model_values: dict[str, Any]) -> None:
    """Set the attributes ``model_values`` names on ``data`` to the model's values (None: keep the data's own).

    Raises:
        ConfigError: the data config set one of them (``data.given``) to a different value.
    """
    for key, value in model_values.items():
        given, value = _plain(data.given.get(key)), _plain(value)
        if given is not None and value is not None and given != value:
            raise ConfigError(f"data.{key} is {given!r} but the model's {key} is {value!r}; data.{key} is "
                              f"linked from the model: remove it from the data config (or change the model)")
        if value is not None:
            setattr(data, key, tuple(value) if isinstance(value, list) else value)


def trained_module(data: pl.LightningDataModule) -> Optional[pl.LightningModule]:
    """The LightningModule the trainer of ``data`` runs (None without a trainer)."""
    return getattr(data.trainer, "lightning_module", None) if data.trainer is not None else None


def rank_and_world(data: pl.LightningDataModule) -> tuple[int, int]:
    """``(global rank, world size)`` of the trainer of ``data`` (``(0, 1)`` without a trainer)."""
    return (data.trainer.global_rank, data.trainer.world_size) if data.trainer is not None else (0, 1)


class ShardDataModule(pl.LightningDataModule):
    """Shared logic of the shard data modules (see subclasses for the arguments)."""

    #: evaluation streams cut equal batch counts per rank even on one device (else only under DDP)
    equalize_eval = False

    def __init__(self, train_shards: Optional[str], val_shards: Optional[str], test_shards: Optional[str],
                 predict_shards: Optional[str], batch_size: int, val_batch_size: Optional[int], num_workers: int,
                 seed: int, resampled: bool, samples_per_epoch: Optional[int], train_weights: Optional[list[float]],
                 shuffle_buffer: int, max_member_bytes: Optional[int],
                 pipe_timeout: Optional[float], stages: Optional[list[Callable]], handler: Optional[Callable]) -> None:
        super().__init__()
        self.shards = {"train": train_shards, "val": val_shards, "test": test_shards or val_shards,
                       "predict": predict_shards or val_shards}
        #: stages that fall back to the validation shards and have not said so yet
        self._unsaid_fallback = {stage for stage, given in (("test", test_shards), ("predict", predict_shards))
                                 if not given}
        for stage, spec in self.shards.items():  # val before test/predict: a bad val_shards is named as such
            check_shard_spec(spec, f"data.{stage}_shards")
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.num_workers, self.seed = num_workers, seed
        self.resampled, self.samples_per_epoch, self.train_weights = resampled, samples_per_epoch, train_weights
        self.shuffle_buffer = shuffle_buffer
        #: options of every dataset (``stages`` / ``handler``: webdataset stages on the raw samples, see
        #: :mod:`diffmm.data.stages`)
        self.read_kwargs: dict[str, Any] = {"max_member_bytes": max_member_bytes, "pipe_timeout": pipe_timeout,
                                            "stages": list(stages or ())}
        if handler is not None:
            self.read_kwargs["handler"] = handler
        self._loaders: dict[str, ResumableLoader] = {}

    def make_dataset(self, urls: str, train: bool, batch_size: int, **kwargs: Any):
        """The dataset of a stage (subclasses)."""
        raise NotImplementedError

    def _loader(self, stage: str) -> Optional[ResumableLoader]:
        spec = self.shards[stage]
        if not spec:
            return None
        rank, world = rank_and_world(self)
        common = dict(rank=rank, world_size=world, name=f"{stage}-data", **self.read_kwargs)
        if stage == "train":
            ds = self.make_dataset(spec, True, self.batch_size, resampled=self.resampled,
                                   samples_per_epoch=self.samples_per_epoch, weights=self.train_weights,
                                   shuffle_buffer=self.shuffle_buffer, seed=self.seed, **common)
            hooks = dict(progress=self._progress(), signature=self._signature)
        else:
            # evaluation: every rank the same number of batches under DDP (uneven counts can hang collectives; the
            # last incomplete global batch is dropped), except predict, which reads every sample and keeps its key
            equalize = (world > 1 or self.equalize_eval) and stage != "predict"
            ds = self.make_dataset(spec, False, self.val_batch_size, shuffle=False, equalize=equalize, **common)
            ds.with_keys = stage == "predict"
            hooks = dict(progress=lambda: {"epoch": 0, "batches": 0})
        loader = ResumableLoader(ShardLoader(ds, num_workers=self.num_workers), seed=self.seed, rank=rank, **hooks)
        self._loaders[stage] = loader
        return loader

    def _eval_loader(self, stage: str) -> ResumableLoader:
        if not self.shards[stage]:
            raise ConfigError(f"data.{stage}_shards (or data.val_shards) is not set; {stage} needs shards")
        if stage in self._unsaid_fallback and rank_and_world(self)[0] == 0:
            self._unsaid_fallback.discard(stage)
            log.info("%s: data.%s_shards is not set; using the validation shards (data.val_shards: %s)",
                     stage, stage, self.shards[stage])
        return self._loader(stage)

    def train_dataloader(self):
        if not self.shards["train"]:
            raise ConfigError("data.train_shards is not set; fit needs training shards")
        return self._loader("train")

    def val_dataloader(self):
        return self._loader("val") or []

    def test_dataloader(self):
        return self._eval_loader("test")

    def predict_dataloader(self):
        return self._eval_loader("predict")

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
                "world_size": rank_and_world(self)[1], "num_workers": self.num_workers, "resampled": self.resampled}

    def _progress(self) -> Optional[Callable[[], dict]]:
        """Where training stands (:class:`~diffmm.train.resume.TrainingProgress`, which the CLI adds); without it
        (a plain ``Trainer``) the loader counts epochs itself and a mid-epoch resume is not exact (warned)."""
        tracker = next((cb for cb in self.trainer.callbacks if isinstance(cb, TrainingProgress)),
                       None) if self.trainer is not None else None
        if tracker is None and self.trainer is not None:
            log.warning("no diffmm.train.resume.TrainingProgress callback: resuming mid-epoch is not exact "
                        "(add it to trainer.callbacks; the diffmm CLI does)")
        return tracker.position if tracker is not None else None


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
        image_size, context_length, image_mean, image_std, truncate: the preprocessing; a model being trained sets
            them (its image size and normalisation, its tokenizer's context and truncation, through
            :func:`~diffmm.models.clip.preprocess.transforms_for` / ``tokenizer_for``): leave them unset. Without a
            model: 224, 77, OpenAI CLIP's mean/std and ``eot`` (open_clip's truncation; ``cut``: the official
            DiffCLIP tokenizer's).
        crop_scale: RandomResizedCrop area range of training (DiffCLIP: 0.5-1.0).
        text_field: caption extension in the shards.
        max_member_bytes: skip samples with a tar member larger than this, without reading it
            (default 64 MiB; ``null``: no cap).
        max_image_pixels: skip images with more pixels than this (default: Pillow's
            decompression-bomb threshold, 89,478,485; ``null``: no cap).
        pipe_timeout: seconds a ``pipe:`` shard command may send nothing before it is killed and
            the shard counted as failed (default 120; ``null``: wait forever).
        stages: webdataset pipeline stages run on every raw sample before decoding (``wds.select(...)``,
            ``wds.map(...)`` or a generator function; :mod:`diffmm.data.stages`).
        handler: webdataset exception handler of the stages (e.g. ``webdataset.warn_and_continue``; default: raise).
    """

    def __init__(self, train_shards: Optional[str] = None, val_shards: Optional[str] = None,
                 test_shards: Optional[str] = None, predict_shards: Optional[str] = None, batch_size: int = 64,
                 val_batch_size: Optional[int] = None, num_workers: int = 2, seed: int = 0, resampled: bool = False,
                 samples_per_epoch: Optional[int] = None, train_weights: Optional[list[float]] = None,
                 shuffle_buffer: int = 1000, image_size: Optional[int] = None,
                 context_length: Optional[int] = None, image_mean: Optional[tuple[float, float, float]] = None,
                 image_std: Optional[tuple[float, float, float]] = None, truncate: Optional[str] = None,
                 crop_scale: tuple[float, float] = (0.5, 1.0), text_field: str = "txt",
                 max_member_bytes: Optional[int] = MAX_MEMBER_BYTES, max_image_pixels: Optional[int] = MAX_IMAGE_PIXELS,
                 pipe_timeout: Optional[float] = PIPE_TIMEOUT, stages: Optional[list[Callable]] = None,
                 handler: Optional[Callable] = None) -> None:
        super().__init__(train_shards, val_shards, test_shards, predict_shards, batch_size, val_batch_size,
                         num_workers, seed, resampled, samples_per_epoch, train_weights, shuffle_buffer,
                         max_member_bytes, pipe_timeout, stages, handler)
        for key, value in (("image_mean", image_mean), ("image_std", image_std)):
            if value is not None and (len(value) != 3 or (key == "image_std" and min(value) <= 0)):
                raise ConfigError(f"data.{key} must be 3 {'positive ' if key == 'image_std' else ''}numbers "
                                  f"(one per RGB channel), got {list(value)}")
        if truncate not in (None, *TRUNCATE_MODES):
            raise ConfigError(f"data.truncate {truncate!r}; expected one of {', '.join(TRUNCATE_MODES)}")
        #: the preprocessing arguments the config set (a model being trained must agree with them)
        self.given = dict(image_size=image_size, context_length=context_length, image_mean=image_mean,
                          image_std=image_std, truncate=truncate)
        self.image_size, self.context_length, self.truncate = image_size or 224, context_length or 77, truncate or "eot"
        self.image_mean = tuple(float(v) for v in image_mean or OPENAI_MEAN)
        self.image_std = tuple(float(v) for v in image_std or OPENAI_STD)
        self.crop_scale, self.text_field, self.max_image_pixels = tuple(crop_scale), text_field, max_image_pixels
        self.model: Optional[torch.nn.Module] = None

    def setup(self, stage: str) -> None:
        model = getattr(trained_module(self), "model", None)
        if model is None or not hasattr(model, "encode_image"):
            return
        mean, std = normalization_of(model)
        follow_model(self, dict(image_size=image_size_of(model), context_length=tokenizer_for(model).context_length,
                                image_mean=mean, image_std=std, truncate=truncate_of(model)))
        self.model = model

    def make_dataset(self, urls: str, train: bool, batch_size: int, **kwargs: Any) -> ImageTextDataset:
        if self.model is not None:  # the model's own preprocessing (open_clip-built models keep open_clip's)
            transform = transforms_for(self.model, scale=self.crop_scale)[0 if train else 1]
            tokenizer = tokenizer_for(self.model)
        else:
            transform = image_transform(self.image_size, train, self.crop_scale, self.image_mean, self.image_std)
            tokenizer = CLIPTokenizer(self.context_length, self.truncate)
        return ImageTextDataset(urls, batch_size, transform=transform, tokenizer=tokenizer,
                                context_length=self.context_length, train=train, text_field=self.text_field,
                                max_image_pixels=self.max_image_pixels, **kwargs)


class TextDataModule(ShardDataModule):
    """Packed ``(B, context_length + 1)`` token rows from text shards for LM training.

    Args:
        train_shards, val_shards, test_shards, predict_shards, batch_size, val_batch_size, num_workers, seed,
            resampled, samples_per_epoch (rows), train_weights, shuffle_buffer (documents): as in
            :class:`ImageTextDataModule`.
        context_length: sequence length; an LM module being trained sets it (None: 128).
        tokenizer: ``clip`` or a ``tokenizer.json`` path; an LM module being trained sets it (None: ``clip``).
        text_field: document extension in the shards.
        max_member_bytes, pipe_timeout, stages, handler: as in :class:`ImageTextDataModule`.

    Evaluation streams always cut an equal number of rows per rank (from ``tokens.json``).
    """

    equalize_eval = True

    def __init__(self, train_shards: Optional[str] = None, val_shards: Optional[str] = None,
                 test_shards: Optional[str] = None, predict_shards: Optional[str] = None, batch_size: int = 8,
                 val_batch_size: Optional[int] = None, num_workers: int = 1, seed: int = 0, resampled: bool = False,
                 samples_per_epoch: Optional[int] = None, train_weights: Optional[list[float]] = None,
                 shuffle_buffer: int = 100, context_length: Optional[int] = None,
                 tokenizer: Optional[str] = None, text_field: str = "txt",
                 max_member_bytes: Optional[int] = MAX_MEMBER_BYTES, pipe_timeout: Optional[float] = PIPE_TIMEOUT,
                 stages: Optional[list[Callable]] = None, handler: Optional[Callable] = None) -> None:
        super().__init__(train_shards, val_shards, test_shards, predict_shards, batch_size, val_batch_size,
                         num_workers, seed, resampled, samples_per_epoch, train_weights, shuffle_buffer,
                         max_member_bytes, pipe_timeout, stages, handler)
        self.given = dict(context_length=context_length, tokenizer=tokenizer)
        self.context_length, self.tokenizer, self.text_field = context_length or 128, tokenizer or "clip", text_field

    def setup(self, stage: str) -> None:
        module = trained_module(self)
        follow_model(self, {k: getattr(module, k, None) for k in ("context_length", "tokenizer")})

    def make_dataset(self, urls: str, train: bool, batch_size: int, **kwargs: Any) -> TextDataset:
        try:
            tokenizer = load_lm_tokenizer(self.tokenizer)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"data.tokenizer: {e}") from None
        return TextDataset(urls, batch_size, self.context_length, tokenizer=tokenizer, train=train,
                           text_field=self.text_field, **kwargs)


class RecallDataModule(pl.LightningDataModule):
    """Generated multi-query associative recall (MQAR) batches ``(inputs, targets)`` (B, T): targets are -100
    except at the answers, so :class:`~diffmm.train.lm_module.LMModule` scores the answers only. No files: every
    batch is rebuilt from its seed (:mod:`diffmm.data.recall`).

        data:
          class_path: diffmm.train.RecallDataModule
          init_args: {seq_lens: [64, 128], num_pairs: [4, 8, 16], noise: 1.0, batch_size: 32}

    Training batches mix the settings of the grid ``seq_lens x num_pairs`` (those that do not fit are left out);
    validation uses a fixed set of ``val_examples`` sequences per setting, from a stream disjoint from training.
    The training position (batches consumed) is saved in checkpoints, so ``fit --ckpt_path`` resumes with the
    very next batch.

    Args:
        vocab_size: task vocabulary; default (None) the model's ``vocab_size``.
        seq_lens, num_pairs: the training grid.
        noise: distractor level (probability of a random key/value token on a filler position).
        num_queries: queries per sequence (capped at the pairs); None = every pair.
        query_power: query-offset law exponent (Zoology 0.01; 1 = uniform).
        sampler: ``diffmm`` (queried pairs in random order) or ``zoology`` (Zoology's published
            ``multiquery_ar``: every pair queried, early pairs asked first more often; :mod:`diffmm.data.recall`).
        val_seq_lens, val_num_pairs: validation grid (default the training grid).
        val_examples: validation sequences per setting.
        batch_size, val_batch_size: sequences per batch.
        batch_tokens: when set, training batches hold ``batch_tokens // seq_len`` sequences of their setting
            (the same tokens per step for every length) instead of ``batch_size``.
        num_workers: DataLoader workers (generation is cheap: 0 runs it in the training process).
        seed: data seed (training stream and validation set).
        context_length: the longest sequence must fit it; an LM module being trained sets it.
    """

    def __init__(self, vocab_size: Optional[int] = None, seq_lens: list[int] = (64, 128),
                 num_pairs: list[int] = (4, 8, 16), noise: float = 1.0, num_queries: Optional[int] = None,
                 query_power: float = 0.01, sampler: Literal["diffmm", "zoology"] = "diffmm",
                 val_seq_lens: Optional[list[int]] = None,
                 val_num_pairs: Optional[list[int]] = None, val_examples: int = 256, batch_size: int = 32,
                 val_batch_size: Optional[int] = None, batch_tokens: Optional[int] = None, num_workers: int = 0,
                 seed: int = 0, context_length: Optional[int] = None) -> None:
        super().__init__()
        if min(batch_size, val_batch_size or 1, batch_tokens or 1) < 1 or val_examples < 0:
            raise ConfigError(f"data: batch_size, val_batch_size and batch_tokens must be >= 1 and val_examples >= 0, "
                              f"got {batch_size}, {val_batch_size}, {batch_tokens}, {val_examples}")
        if sampler not in SAMPLERS:
            raise ConfigError(f"data.sampler must be one of {SAMPLERS}, got {sampler!r}")
        self.grid = dict(seq_lens=list(seq_lens), num_pairs=list(num_pairs), noise=float(noise),
                         num_queries=num_queries, query_power=float(query_power), sampler=sampler)
        self.val_grid = dict(self.grid, seq_lens=list(val_seq_lens or seq_lens),
                             num_pairs=list(val_num_pairs or num_pairs))
        self.val_examples, self.batch_size, self.val_batch_size = val_examples, batch_size, val_batch_size or batch_size
        self.batch_tokens, self.num_workers, self.seed = batch_tokens, num_workers, seed
        self.given = {"context_length": context_length}
        self.vocab_size, self.context_length = vocab_size, context_length
        self.train_tasks: list[RecallTask] = []
        self.val_tasks: list[RecallTask] = []
        self._start = 0  # training batches of this rank already consumed (restored from a checkpoint)
        if vocab_size is not None:
            self._build()

    def _build(self) -> None:
        self.train_tasks = self._grid(self.grid, "data")
        self.val_tasks = self._grid(self.val_grid, "data.val") if self.val_examples else []
        longest = max(t.seq_len for t in self.train_tasks + self.val_tasks)
        if self.context_length is not None and longest > self.context_length:
            raise ConfigError(f"data: sequences of {longest} tokens exceed the model's context_length "
                              f"{self.context_length} (raise model block_size)")

    def _grid(self, grid: dict, what: str) -> list[RecallTask]:
        try:
            tasks, skipped = task_grid(self.vocab_size, **grid)
        except ValueError as e:
            raise ConfigError(f"{what}: {e}") from None
        if skipped:
            log.info("%s: left out %d setting(s) that do not fit: %s", what, len(skipped), ", ".join(skipped))
        return tasks

    def setup(self, stage: str) -> None:
        module = trained_module(self)
        follow_model(self, {"context_length": getattr(module, "context_length", None)})
        model_vocab = getattr(getattr(getattr(module, "model", None), "config", None), "vocab_size", None)
        if self.vocab_size is None and model_vocab is None:
            raise ConfigError("data.vocab_size is not set and the model has no config.vocab_size")
        if self.vocab_size is not None and model_vocab is not None and self.vocab_size > model_vocab:
            raise ConfigError(f"data.vocab_size {self.vocab_size} exceeds the model's vocab_size {model_vocab}")
        self.vocab_size = self.vocab_size or model_vocab
        self._build()


    def train_dataloader(self) -> torch.utils.data.DataLoader:
        rank, world = rank_and_world(self)
        ds = RecallStream(self.train_tasks, self.batch_size, seed=self.seed, rank=rank, world_size=world,
                          start=self._start, batch_tokens=self.batch_tokens)
        self._start = 0
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=self.num_workers)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        rank, world = rank_and_world(self)
        batches = [(b.inputs, b.targets) for t in self.val_tasks
                   for b in eval_batches(t, self.val_examples, self.val_batch_size, self.seed)]
        return torch.utils.data.DataLoader(batches[rank::world], batch_size=None)

    test_dataloader = predict_dataloader = val_dataloader

    def state_dict(self) -> dict[str, Any]:
        if self.trainer is None:
            return {}
        done = int(self.trainer.fit_loop.epoch_loop.batch_progress.total.processed)
        return {"batches": done, "seed": self.seed, "batch_size": self.batch_size, "batch_tokens": self.batch_tokens,
                "tasks": [t.name for t in self.train_tasks], "sampler": self.grid["sampler"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, now in (("seed", self.seed), ("batch_size", self.batch_size), ("batch_tokens", self.batch_tokens),
                         ("sampler", self.grid["sampler"]),
                         ("tasks", [t.name for t in self.train_tasks] or state.get("tasks"))):
            if key in state and state[key] != now:
                log.warning("resume: data.%s changed since the checkpoint (%s -> %s); the batches differ from "
                            "the uninterrupted run", key, state[key], now)
        self._start = int(state.get("batches", 0))
