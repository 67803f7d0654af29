"""``diffmm fit | validate | test | predict``: a LightningCLI with diffmm's defaults.

    diffmm fit --config configs/diffclip_tiny_emoji.yaml
    diffmm fit --config configs/diffclip_tiny_emoji.yaml --ckpt_path last      # resume
    diffmm validate --config configs/diffclip_tiny_emoji.yaml --ckpt_path runs/diffclip-tiny/checkpoints/last.ckpt
    diffmm fit --config configs/diffclip_tiny_emoji.yaml --print_config         # the full resolved config

What it adds to a plain LightningCLI:

* always-on callbacks, configurable under their own keys: ``checkpoint`` (ModelCheckpoint with
  ``save_last``; default folder ``<trainer.default_root_dir>/checkpoints``, so ``--ckpt_path last``
  finds it; never writes NaN weights), ``nonfinite`` (stop, or skip steps, on a NaN/Inf loss; exit
  status 3), ``lr_monitor`` (skipped with ``trainer.logger: false``), ``data_stats`` (data counters per
  epoch), ``prediction_writer``, and a progress bar with real step counts;
* TensorBoard and CSV loggers under ``<trainer.default_root_dir>/{tensorboard,csv}`` unless
  ``trainer.logger`` is given;
* atomic checkpoint writes (:class:`~diffmm.train.checkpoint_io.AtomicCheckpointIO`); ``--ckpt_path last``
  resumes from the newest *intact* checkpoint (a damaged ``last.ckpt`` falls back with a warning);
* links from the model to the data: ``context_length``, ``image_size``, ``tokenizer`` and the model's
  preprocessing, ``image_mean``, ``image_std``, ``truncate`` (:data:`LINKED`). A linked data argument is the
  model's: setting it in the data config to a different value is an error (one line naming both), not a silent
  override;
* bad configs end with one ``error:`` line (set ``DIFFMM_TRACEBACK=1`` for the traceback).
"""
from __future__ import annotations

import inspect
import logging
import math
import os
import sys
import warnings
from typing import Any, Optional

import pytorch_lightning as pl
from jsonargparse import ArgumentError
from pytorch_lightning import LightningDataModule, LightningModule
from pytorch_lightning.callbacks import DeviceStatsMonitor, LearningRateMonitor, ModelCheckpoint, ProgressBar
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from diffmm.train.callbacks import Checkpoint, DataStatsMonitor, NonFiniteGuard, PredictionWriter, default_progress_bar
from diffmm.train.checkpoint_io import (AtomicCheckpointIO, check_resume_file, is_global_zero_env, newest_last,
                                        resume_checkpoint)
from diffmm.train.datamodules import check_shard_spec
from diffmm.train.errors import DIVERGED_EXIT_CODE, ConfigError, TrainingDiverged

log = logging.getLogger("diffmm.train")

#: callbacks that raise without a logger; skipped (one info line) when ``trainer.logger`` is false
NEEDS_LOGGER = (LearningRateMonitor, DeviceStatsMonitor)

SUBCOMMANDS = ("fit", "validate", "test", "predict")
#: model attributes linked to the data module's arguments of the same names (the data module's transforms and
#: tokenizer follow the model: an official DiffCLIP checkpoint trains with ImageNet mean/std and ``truncate: cut``)
LINKED = ("context_length", "image_size", "tokenizer", "image_mean", "image_std", "truncate")


def _checkpoint_dirs(config: Any) -> tuple[str, str]:
    root = config.get("trainer", {}).get("default_root_dir") or os.getcwd()
    ckpt_dir = config.get("checkpoint", {}).get("dirpath") or os.path.join(root, "checkpoints")
    return os.fspath(ckpt_dir), os.fspath(root)


def newest_checkpoint(config: Any) -> Optional[str]:
    """The newest of ``<checkpoint dir>/last*.ckpt`` and SLURM's ``<default_root_dir>/hpc_ckpt_*.ckpt`` (or None).

    A job requeued after SLURM's pre-emption signal (which writes an ``hpc_ckpt``) and a job restarted
    after a crash resume from whichever is more recent. ``--ckpt_path last`` resolves to this file when
    it is intact, else to the newest intact checkpoint (:func:`~diffmm.train.checkpoint_io.resume_checkpoint`).
    """
    return newest_last(*_checkpoint_dirs(config))


class DiffmmCLI(LightningCLI):
    """LightningCLI with diffmm's always-on callbacks, loggers, atomic checkpoints and model -> data links."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(Checkpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 1})
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        parser.add_lightning_class_args(DataStatsMonitor, "data_stats")
        parser.add_lightning_class_args(PredictionWriter, "prediction_writer")
        for key in LINKED:
            parser.link_arguments(f"model.{key}", f"data.init_args.{key}", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        # Check shard paths before jsonargparse instantiates the data module: an error raised inside
        # instantiation comes back wrapped in a long "Union subtypes" report.
        config = self.config[self.subcommand] if self.subcommand else self.config
        data = config.get("data")
        init = getattr(data, "init_args", None) or {}
        self._data_given = _given_linked_values(data)
        for key in ("train_shards", "val_shards", "test_shards", "predict_shards"):
            spec = init.get(key) if hasattr(init, "get") else None
            if spec:
                check_shard_spec(spec, f"data.{key}")
        if config.get("ckpt_path") == "last":
            # the newest intact checkpoint: falls back past a damaged last.ckpt (rank 0 moves it aside)
            newest = resume_checkpoint(*_checkpoint_dirs(config), move_damaged=is_global_zero_env())
            if newest is not None:
                config["ckpt_path"] = newest

    def instantiate_classes(self) -> None:
        # a run that resumes from a checkpoint takes every weight from it: a pretrained file gone since is not needed
        from diffmm.train.clip_module import resuming_from

        config = self.config[self.subcommand] if self.subcommand else self.config
        ckpt = config.get("ckpt_path")
        with resuming_from(os.fspath(ckpt) if ckpt and os.path.isfile(os.fspath(ckpt)) else None):
            super().instantiate_classes()

    def after_instantiate_classes(self) -> None:
        # jsonargparse overwrites a linked data argument with the model's value, whatever the data config said:
        # a value the user set that differs from the model's is an error instead of a silent change
        for key, given in getattr(self, "_data_given", {}).items():
            linked = getattr(self.model, key, None)
            if linked is not None and not _same_value(given, linked):
                raise ConfigError(f"data.{key} is {_show(given)} but the model's {key} is {_show(linked)}; data.{key} "
                                  f"is linked from the model: remove it from the data config (or change the model)")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads a named checkpoint's hyperparameters right after parsing: check the file first,
        # so a damaged one the user named is one line naming it (no fallback: it is what the user asked for)
        sub = self.config.get("subcommand")
        path = self.config[sub].get("ckpt_path") if sub else None
        if path and path != "last":
            check_resume_file(os.fspath(path))
        super()._parse_ckpt_path()

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> pl.Trainer:
        root = config.get("default_root_dir") or os.getcwd()
        for cb in callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is None:
                cb.dirpath = os.path.realpath(os.path.join(os.fspath(root), "checkpoints"))
        if config.get("logger") in (None, True):
            config["logger"] = [TensorBoardLogger(root, name="tensorboard"), CSVLogger(root, name="csv")]
        user = config.get("callbacks") or []
        user = config["callbacks"] = user if isinstance(user, list) else [user]
        if not config.get("logger"):  # false / []: no logger, so drop the monitors that need one
            dropped = sorted({type(cb).__name__ for cb in (*callbacks, *user) if isinstance(cb, NEEDS_LOGGER)})
            callbacks[:] = [cb for cb in callbacks if not isinstance(cb, NEEDS_LOGGER)]
            user[:] = [cb for cb in user if not isinstance(cb, NEEDS_LOGGER)]
            if dropped:
                log.info("trainer.logger is false: skipping %s (needs a logger)", ", ".join(dropped))
        if config.get("enable_progress_bar", True) is not False and not any(
                isinstance(cb, ProgressBar) for cb in (*callbacks, *user)):
            callbacks.append(default_progress_bar())  # real step counts on resumed / extended runs
        if not config.get("plugins"):
            config["plugins"] = [AtomicCheckpointIO()]
        return super()._instantiate_trainer(config, callbacks)


def _given_linked_values(data: Any) -> dict[str, Any]:
    """The :data:`LINKED` arguments the data config sets to something other than the data class's defaults (diffmm's
    data modules default them to None, so every value written in the config counts)."""
    class_path = getattr(data, "class_path", None)
    init = getattr(data, "init_args", None)
    if not isinstance(class_path, str) or "." not in class_path or init is None:
        return {}
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}
    return {key: init[key] for key in LINKED
            if key in params and key in init and not _same_value(init[key], params[key].default)}


def _same_value(a: Any, b: Any) -> bool:
    """Equal config values: sequences element-wise (floats to 1e-6), strings naming one file as the same path."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, str) and isinstance(b, str) and a != b and os.path.isfile(a) and os.path.isfile(b):
        return os.path.samefile(a, b)
    return a == b


def _show(value: Any) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def run_cli(argv: list[str], **kwargs: Any):
    """Build and run the CLI on ``argv`` (``[subcommand, options...]``); returns the LightningCLI object."""
    defaults = {"log_every_n_steps": 10}
    # raise parse errors (condensed by main()) instead of printing the whole usage
    parser_kwargs = {"exit_on_error": False, **{c: {"exit_on_error": False} for c in SUBCOMMANDS}}
    if argv == sys.argv[1:]:
        argv = None  # the console entry point: let LightningCLI read sys.argv itself (no warning)
    return DiffmmCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                     args=argv, seed_everything_default=0, trainer_defaults=defaults, parser_kwargs=parser_kwargs,
                     save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False, **kwargs)


#: lines of jsonargparse's union-type reports that only repeat what the user wrote
_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value",
          "Expected a <class 'NoneType'>", "tip: For details")


def condense(e: BaseException) -> str:
    """The exception message on one line, without jsonargparse's echo of the given values."""
    text = str(e).strip() or type(e).__name__
    lines = [ln.strip().lstrip("- ").strip() for ln in text.splitlines()]
    text = " ".join(ln for ln in lines if ln and not ln.startswith(_NOISE))
    if len(text) > 1 and text[0] == text[-1] == "'":  # a KeyError's repr-quoted message
        text = text[1:-1]
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``diffmm fit|validate|test|predict``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else "fit"
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # diffmm's shard streams split work over ranks and workers themselves; their length is exact
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    try:
        run_cli(argv)
    except TrainingDiverged as e:  # the non-finite-loss guard: one line naming the step and the last good checkpoint
        if os.environ.get("DIFFMM_TRACEBACK"):
            raise
        print(f"diffmm {cmd}: error: {condense(e)}", file=sys.stderr)
        return DIVERGED_EXIT_CODE
    except SystemExit as e:  # --help, --print_config and jsonargparse's own error messages
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except (ConfigError, ArgumentError, FileNotFoundError, MisconfigurationException, ValueError) as e:
        # bad paths and values: one line (naming the config key); other exceptions keep their traceback
        if os.environ.get("DIFFMM_TRACEBACK"):
            raise
        hint = "" if isinstance(e, (ConfigError, ArgumentError)) else " (DIFFMM_TRACEBACK=1 shows where)"
        print(f"diffmm {cmd}: error: {condense(e)}{hint}", file=sys.stderr)
        if isinstance(e, ArgumentError):
            print(f"diffmm {cmd}: see `diffmm {cmd} --help` or `--print_config` for the accepted keys", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
