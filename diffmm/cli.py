"""The ``diffmm`` command.

``diffmm fit|validate|test|predict`` is a LightningCLI (``diffmm.train.cli``); the other
subcommands are diffmm's own tools. Each subcommand lives in its own module and is imported
lazily, so ``diffmm shards --help`` does not pay for importing Lightning.
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). The module must define ``main(argv: list[str]) -> int | None``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("diffmm.train.cli", "train a model (LightningCLI)"),
    "validate": ("diffmm.train.cli", "validate a model (LightningCLI)"),
    "test": ("diffmm.train.cli", "test a model (LightningCLI)"),
    "predict": ("diffmm.train.cli", "predict with a model (LightningCLI)"),
    "shards": ("diffmm.shards_cli", "write webdataset shards and build the demo datasets"),
    "eval": ("diffmm.eval.cli", "zero-shot, retrieval, linear probe and language evaluations"),
    "classify": ("diffmm.eval.classify", "zero-shot labels for your own images (one row per image: CSV/JSON)"),
    "export": ("diffmm.hub.export_cli", "write a diffmm export folder from a checkpoint (Lightning .ckpt, any format)"),
    "demo": ("diffmm.demo.cli", "the main job: demo data, tiny CLIP vs DiffCLIP, report"),
}

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def _usage() -> str:
    lines = ["usage: diffmm <command> [options]", "", "commands:"]
    for name, (_, help_) in SUBCOMMANDS.items():
        lines.append(f"  {name:<10} {help_}")
    lines.append("")
    lines.append("Run `diffmm <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        print(f"diffmm: unknown command {cmd!r}; expected one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[cmd][0])
    if cmd in LIGHTNING_SUBCOMMANDS:
        rc = module.main([cmd, *rest])
    else:
        rc = module.main(rest)
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
