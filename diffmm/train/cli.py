"""``diffmm fit | validate | test | predict``: a LightningCLI with diffmm's defaults.

    diffmm fit --config configs/diffclip_tiny_emoji.yaml
    diffmm fit --config configs/diffclip_tiny_emoji.yaml --ckpt_path last      # resume
    diffmm validate --config configs/diffclip_tiny_emoji.yaml --ckpt_path runs/diffclip-tiny/checkpoints/last.ckpt
    diffmm fit --config configs/diffclip_tiny_emoji.yaml --print_config         # the full resolved config

What it adds to a plain LightningCLI, through its public hooks (``add_arguments_to_parser``, ``parse_arguments``,
``before_instantiate_classes``, ``instantiate_classes``, ``instantiate_trainer``):

* always-on callbacks, configurable under their own keys: ``checkpoint`` (ModelCheckpoint with
  ``save_last``; default folder ``<trainer.default_root_dir>/checkpoints``, so ``--ckpt_path last``
  finds it), ``nonfinite`` (stop, or skip steps, on a NaN/Inf loss; exit status 3), ``lr_monitor``
  (skipped with ``trainer.logger: false``), ``data_stats`` (data counters per epoch), ``prediction_writer``,
  and a progress bar with real step counts;
* TensorBoard and CSV loggers under ``<trainer.default_root_dir>/{tensorboard,csv}`` unless
  ``trainer.logger`` is given;
* exact resume: :class:`~diffmm.train.resume.TrainingProgress` writes where training stands into every checkpoint;
* atomic checkpoint writes that never hold NaN/Inf (:class:`~diffmm.train.checkpoint_io.AtomicCheckpointIO`);
  ``--ckpt_path last`` resumes from the newest *intact* checkpoint (a damaged or unsafe ``last.ckpt`` falls back
  with a warning), and a damaged or unsafe checkpoint named with ``--ckpt_path FILE`` is one line
  (``--weights_only false`` trusts an unsafe one); a full disk during a save is one line;
* ``fit`` owns its folder while it runs (:class:`~diffmm.train.checkpoint_io.RunLock`): a second ``fit`` into it
  stops with one line naming the running PID;
* bad configs end with one ``error:`` line (set ``DIFFMM_TRACEBACK=1`` for the traceback).

The data modules follow the model themselves (its preprocessing, tokenizer, context length:
:mod:`diffmm.train.datamodules`), so a config names those once.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import pytorch_lightning as pl
from jsonargparse import ArgumentError
from pytorch_lightning import LightningDataModule, LightningModule
from pytorch_lightning.accelerators import CPUAccelerator
from pytorch_lightning.callbacks import DeviceStatsMonitor, LearningRateMonitor, ProgressBar
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.strategies import FSDPStrategy
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from diffmm.train.callbacks import Checkpoint, DataStatsMonitor, NonFiniteGuard, PredictionWriter, StepProgressBar
from diffmm.train.checkpoint_io import (TRUST_FLAG, UNSAFE, AtomicCheckpointIO, RunLock, checkpoint_damage,
                                        resume_checkpoint)
from diffmm.train.datamodules import check_shard_spec
from diffmm.train.errors import DIVERGED_EXIT_CODE, CheckpointSaveError, ConfigError, TrainingDiverged
from diffmm.train.resume import TrainingProgress

log = logging.getLogger("diffmm.train")

#: callbacks that raise without a logger; skipped (one info line) when ``trainer.logger`` is false
NEEDS_LOGGER = (LearningRateMonitor, DeviceStatsMonitor)

SUBCOMMANDS = ("fit", "validate", "test", "predict")


def is_global_zero_env() -> bool:
    """Whether this process is global rank 0 according to the launcher's environment (before a trainer exists)."""
    for var in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(var) is not None:
            return os.environ[var] == "0"
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


class DiffmmCLI(LightningCLI):
    """LightningCLI with diffmm's always-on callbacks, loggers, atomic checkpoints and resume rules; a ``fit`` owns
    its folders (:class:`~diffmm.train.checkpoint_io.RunLock`) while it runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock: RunLock | None = None
        try:
            super().__init__(*args, **kwargs)  # parses, builds and runs the subcommand
        finally:
            if self._lock is not None:
                self._lock.release()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(Checkpoint, "checkpoint")
        # the run owns its folder: a resumed run writes the names it would have written (no last-v1.ckpt)
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 1,
                             "checkpoint.enable_version_counter": False})
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")
        # not a callback key: instantiate_trainer adds it only when the run has a logger
        parser.add_class_arguments(LearningRateMonitor, "lr_monitor", fail_untyped=False, sub_configs=True)
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        parser.add_lightning_class_args(DataStatsMonitor, "data_stats")
        parser.add_lightning_class_args(PredictionWriter, "prediction_writer")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI reads a named checkpoint's hyperparameters right after parsing: check the file first, so a
        # damaged one the user named is one line naming it (no fallback: it is what the user asked for)
        sub = self.config.get("subcommand")
        path = self.config[sub].get("ckpt_path") if sub else None
        trust = bool(sub) and self.config[sub].get("weights_only") is False
        damage = checkpoint_damage(os.fspath(path), trust) if path and path != "last" and os.path.isfile(path) else None
        if damage is not None and damage.startswith(UNSAFE):
            raise ConfigError(f"ckpt_path: {path} is {damage}; if you trust the file, pass {TRUST_FLAG}")
        if damage is not None:
            raise ConfigError(f"ckpt_path: {path} is damaged ({damage}); give an intact checkpoint, or --ckpt_path "
                              f"last to resume from the newest intact one")

    def _subcommand_config(self, config: Any) -> Any:
        """The part of ``config`` of the subcommand (all of it with ``run=False``)."""
        return config[self.subcommand] if self.subcommand else config

    def before_instantiate_classes(self) -> None:
        # Check shard paths before jsonargparse instantiates the data module: an error raised inside
        # instantiation comes back wrapped in a long "Union subtypes" report.
        config = self._subcommand_config(self.config)
        init = getattr(config.get("data"), "init_args", None) or {}
        for key in ("train_shards", "val_shards", "test_shards", "predict_shards"):
            check_shard_spec(init.get(key) if hasattr(init, "get") else None, f"data.{key}")
        root = os.fspath(config.get("trainer", {}).get("default_root_dir") or os.getcwd())
        ckpt_dir = os.fspath(config.get("checkpoint", {}).get("dirpath") or os.path.join(root, "checkpoints"))
        if self.subcommand == "fit" and is_global_zero_env():
            # a second fit into these folders stops here, naming the owner (the root's lock covers folders inside it)
            inside = os.path.realpath(ckpt_dir).startswith(os.path.join(os.path.realpath(root), ""))
            self._lock = RunLock([root] if inside else [root, ckpt_dir])
        if config.get("ckpt_path") == "last":
            # the newest intact checkpoint: falls back past a damaged or unsafe last.ckpt (rank 0 moves damaged aside)
            newest = resume_checkpoint(ckpt_dir, root, move_damaged=is_global_zero_env(),
                                       trust=config.get("weights_only") is False)
            if newest is not None:
                config["ckpt_path"] = newest

    def instantiate_classes(self) -> None:
        # a run that resumes from a checkpoint takes every weight from it: a pretrained file gone since is not read
        # (the model's hyperparameters keep its path, so checkpoints still say where the run started from)
        config = self._subcommand_config(self.config)
        ckpt, init = config.get("ckpt_path"), getattr(config.get("model"), "init_args", None)
        pretrained = init.get("pretrained") if ckpt and hasattr(init, "get") else None
        gone = isinstance(pretrained, str) and not os.path.exists(os.path.expanduser(pretrained))
        if gone:
            log.warning("model.pretrained %s is not there; it is not read: the run resumes from %s, which holds "
                        "every weight", pretrained, ckpt)
            init["pretrained"] = None
        super().instantiate_classes()
        if gone:
            init["pretrained"] = pretrained
            if "pretrained" in getattr(self.model, "hparams", {}):
                self.model.hparams["pretrained"] = pretrained

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        config = self._subcommand_config(self.config_init)
        trainer = config["trainer"]
        root = trainer.get("default_root_dir") or os.getcwd()
        if config["checkpoint"].dirpath is None:
            config["checkpoint"].dirpath = os.path.realpath(os.path.join(os.fspath(root), "checkpoints"))
        if trainer.get("logger") in (None, True):
            trainer["logger"] = [TensorBoardLogger(root, name="tensorboard"), CSVLogger(root, name="csv")]
        callbacks = trainer.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if trainer["logger"]:
            callbacks.append(config["lr_monitor"])
        else:  # false / []: no logger, so no monitor that needs one
            dropped = {type(cb).__name__ for cb in (*callbacks, config["lr_monitor"]) if isinstance(cb, NEEDS_LOGGER)}
            callbacks = [cb for cb in callbacks if not isinstance(cb, NEEDS_LOGGER)]
            log.info("trainer.logger is false: skipping %s (needs a logger)", ", ".join(sorted(dropped)))
        if trainer.get("enable_progress_bar", True) is not False and not any(isinstance(cb, ProgressBar)
                                                                             for cb in callbacks):
            callbacks.append(StepProgressBar())  # real step counts on resumed / extended runs
        callbacks.append(TrainingProgress())  # where training stands, in every checkpoint: exact resume
        trainer["callbacks"] = callbacks
        if not trainer.get("plugins"):
            trainer["plugins"] = [AtomicCheckpointIO()]
        built = super().instantiate_trainer(**kwargs)
        if isinstance(built.strategy, FSDPStrategy) and isinstance(built.accelerator, CPUAccelerator):
            raise ConfigError("trainer.strategy: FSDP shards over GPUs and does not run on CPU; on CPU use "
                              "strategy ddp (gloo, several processes) or a single device; FSDP needs "
                              "accelerator gpu")
        return built


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
    except SystemExit as e:  # --help, --print_config and jsonargparse's own error messages
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except (TrainingDiverged, ConfigError, ArgumentError, CheckpointSaveError, FileNotFoundError,
            MisconfigurationException, ValueError) as e:
        # the non-finite-loss guard (naming the step and the last good checkpoint), bad paths and values (naming the
        # config key): one line; other exceptions keep their traceback
        if os.environ.get("DIFFMM_TRACEBACK"):
            raise
        named = isinstance(e, (TrainingDiverged, ConfigError, ArgumentError, CheckpointSaveError))  # says where
        hint = "" if named else " (DIFFMM_TRACEBACK=1 shows where)"
        print(f"diffmm {cmd}: error: {condense(e)}{hint}", file=sys.stderr)
        if isinstance(e, ArgumentError):
            print(f"diffmm {cmd}: see `diffmm {cmd} --help` or `--print_config` for the accepted keys", file=sys.stderr)
        return DIVERGED_EXIT_CODE if isinstance(e, TrainingDiverged) else 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
