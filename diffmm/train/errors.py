"""Errors of the training CLI that are shown as one line (no traceback)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad training config value; the message names the config key and what was expected."""


class CheckpointSaveError(OSError):
    """A checkpoint could not be saved (the disk is full); the message names the folder, its free space and the
    newest intact checkpoint."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN/Inf (or too many such steps were skipped); the message names the step and the
    last good checkpoint. ``diffmm fit`` exits with :data:`DIVERGED_EXIT_CODE`."""


#: exit status of ``diffmm fit`` when training stopped on a non-finite loss
DIVERGED_EXIT_CODE = 3
