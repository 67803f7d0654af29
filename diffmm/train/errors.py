"""Errors of the training CLI that are shown as one line (no traceback)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad training config value; the message names the config key and what was expected."""
