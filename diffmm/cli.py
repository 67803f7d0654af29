"""The ``diffmm`` command.

``diffmm fit|validate|test|predict`` is a LightningCLI (:mod:`diffmm.train.cli`). Every other command runs one
function, and its flags and ``--help`` come from that function's signature and docstring (jsonargparse, as litgpt
builds its command line): ``diffmm eval <task>`` and ``diffmm classify`` (:mod:`diffmm.eval.commands`), ``diffmm
shards <tool>`` (:mod:`diffmm.data.shard_tools`) and ``diffmm export`` (:func:`diffmm.hub.export.export`).
``diffmm eval lm-eval`` takes lm-eval's own arguments (:func:`diffmm.eval.harness.lm_eval_cli`). Flags are the
parameter names (``--batch_size 8``, ``--progress false``, lists as ``--seq_len '[64,128]'``; dashes are aliases:
``--batch-size 8``). Bad input ends with one ``diffmm <command>: error: ...`` line and exit status 2.

:func:`run_commands` runs any such table of functions: an application built on diffmm gets the same command line
from its own functions (the demo's ``python -m diffmm_demo``).
"""
from __future__ import annotations

import collections.abc
import inspect
import logging
import sys
import typing
from typing import Callable, Optional

import docstring_parser
from jsonargparse import ArgumentError, ArgumentParser

from diffmm.data.shard_tools import (check_shards, index_shards, write_shards_from_captions, write_shards_from_folders,
                                     write_shards_from_text)
from diffmm.eval import commands
from diffmm.eval.clip_benchmark import clip_benchmark
from diffmm.hub.export import export
from diffmm.train.cli import main as lightning_main

#: the commands ``main`` hands to the LightningCLI (:mod:`diffmm.train.cli`), with their line in ``diffmm --help``
LIGHTNING_HELP = {"fit": "train a model (LightningCLI): diffmm fit --config FILE; diffmm fit --help lists its options",
                  "validate": "validation metrics of a model (LightningCLI, as fit)",
                  "test": "test metrics of a model (LightningCLI, as fit)",
                  "predict": "predictions of a model on a data set, e.g. CLIP features (LightningCLI, as fit)"}
LIGHTNING_SUBCOMMANDS = tuple(LIGHTNING_HELP)
#: errors that mean bad input (a file, a name, a value): one line and exit status 2
INPUT_ERRORS = (ValueError, KeyError, OSError)


COMMANDS: dict = {
    "_help": "differential attention for multimodal models; training: diffmm fit|validate|test|predict --help "
             "(LightningCLI)",
    "eval": {"_help": "zero-shot, retrieval, linear probe and language evaluations, pictures",
             "zeroshot": commands.zeroshot, "retrieval": commands.retrieval, "linear-probe": commands.linear_probe,
             "perplexity": commands.perplexity, "needle": commands.needle, "recall": commands.recall,
             "outliers": commands.outliers, "icl": commands.icl, "lm-eval": commands.lm_eval,
             "clip-benchmark": clip_benchmark,
             "plot-attention": commands.plot_attention, "plot-needle": commands.plot_needle,
             "plot-loss": commands.plot_loss},
    "classify": commands.classify,
    "shards": {"_help": "write, check and index webdataset shards",
               "from-captions": write_shards_from_captions, "from-folders": write_shards_from_folders,
               "from-text": write_shards_from_text, "check": check_shards, "index": index_shards},
    "export": export,
}


def _add_function(parser: ArgumentParser, fn: Callable) -> None:
    """Arguments of ``fn``: its required positional parameters in order (a list one takes one or more values, as in
    ``diffmm classify a.jpg b.jpg``, which jsonargparse's list positionals do not), then jsonargparse's flags."""
    hints = typing.get_type_hints(fn)
    docs = {p.arg_name: p.description for p in docstring_parser.parse(fn.__doc__).params}
    positional = [n for n, p in inspect.signature(fn).parameters.items()
                  if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty]
    for name in positional:
        many = typing.get_origin(hints[name]) in (list, collections.abc.Sequence)
        parser.add_argument(name, nargs="+" if many else None, help=docs.get(name))
    parser.add_function_arguments(fn, skip=set(positional), fail_untyped=True)


def _add_commands(parser: ArgumentParser, commands_: dict, prog: str, sub=None) -> None:
    sub = sub or parser.add_subcommands(required=True)
    for name, target in commands_.items():
        if name == "_help":
            continue
        if isinstance(target, dict):
            help_ = target["_help"]
        else:
            help_ = docstring_parser.parse(target.__doc__).short_description
        child = ArgumentParser(prog=f"{prog} {name}", description=help_, exit_on_error=False)
        sub.add_subcommand(name, child, help=help_)  # before its own subcommands: jsonargparse adds them in order
        if isinstance(target, dict):
            _add_commands(child, target, f"{prog} {name}")
        else:
            _add_function(child, target)


def build_parser(commands: Optional[dict] = None, prog: str = "diffmm") -> ArgumentParser:
    """The parser of a table of ``commands`` (its ``_help`` line, then name -> function or name -> a table of
    subcommands); default: every ``diffmm`` command, the Lightning ones listed only (``main`` hands them to the
    LightningCLI before parsing)."""
    commands = COMMANDS if commands is None else commands
    own = commands is COMMANDS
    parser = ArgumentParser(prog=prog, exit_on_error=False, description=commands.get("_help"))
    sub = parser.add_subcommands(required=True)
    if own:
        for name, help_ in LIGHTNING_HELP.items():
            sub.add_subcommand(name, ArgumentParser(prog=f"{prog} {name}", description=help_), help=help_)
    _add_commands(parser, commands, prog, sub)
    return parser


def parse(argv: list[str], commands: Optional[dict] = None, prog: str = "diffmm"
          ) -> tuple[list[str], Callable, dict]:
    """``(command names, function, keyword arguments)`` of a command line (``argv`` without the program) of a table
    of ``commands`` (default: diffmm's).

    ``diffmm eval lm-eval ARGS`` takes lm-eval's own arguments: lm-eval's parser checks them, and the function is
    :func:`diffmm.eval.harness.lm_eval_cli` with ``argv=ARGS``.

    Raises:
        ArgumentError: a bad command line.
        SystemExit: ``--help``, or bad lm-eval arguments (lm-eval's argparse).
    """
    commands = COMMANDS if commands is None else commands
    if commands is COMMANDS and argv[:2] == ["eval", "lm-eval"]:
        from diffmm.eval.harness import check_lm_eval_args, lm_eval_cli  # lm-eval: optional, seconds to import

        check_lm_eval_args(argv[2:])
        return ["eval", "lm-eval"], lm_eval_cli, {"argv": argv[2:]}
    node, target, names = build_parser(commands, prog).parse_args(argv), commands, []
    while isinstance(target, dict):
        names.append(node["subcommand"])
        node, target = node[names[-1]], target[names[-1]]
    return names, target, node.as_dict()


def _command_words(argv: list[str], commands: dict) -> list[str]:
    """The command words at the start of ``argv`` (``['eval', 'zeroshot']``), for error messages."""
    words, level = [], commands
    for word in argv:
        if not isinstance(level, dict) or word not in level:
            break
        words.append(word)
        level = level[word]
    return words


def one_line(error: BaseException) -> str:
    """An error's message on one line: a KeyError's key text, and a message that carries a traceback (a DataLoader
    worker's) without the traceback's indented frames."""
    text = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.startswith((" ", "\t", "Traceback", "Original Traceback"))]
    return " ".join(lines)


def underscore_flags(argv: list[str]) -> list[str]:
    """``--batch-size 8`` -> ``--batch_size 8``: flags are the parameter names (underscores, as in ``diffmm fit`` and
    the field's tools); dashes are accepted as aliases. Values (``--out my-file.json``) are left alone."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2 and not arg.startswith("---"):
            name, eq, value = arg[2:].partition("=")
            arg = "--" + name.replace("-", "_") + eq + value
        out.append(arg)
    return out


def run_commands(commands: dict, argv: list[str], prog: str) -> int:
    """Parse ``argv`` against a table of ``commands`` and run the function it names; returns the exit status.

    The table has a ``_help`` line and maps a command name to a function or to a table of subcommands. Flags and
    ``--help`` come from each function's signature and docstring; bad input (a parse error, or a ``ValueError``,
    ``KeyError`` or ``OSError`` from the function) prints one ``PROG COMMAND: error: ...`` line and returns 2; a
    function that returns False gives 1, one that returns an int gives that int, anything else 0.
    """
    if not argv:
        print(build_parser(commands, prog).format_help())
        return 0
    argv = underscore_flags(argv)
    try:
        names, fn, kwargs = parse(argv, commands, prog)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except ArgumentError as e:
        words = _command_words(argv, commands)
        message = " ".join(str(e).split()).replace('Parser key "', "--").replace('": ', ": ")
        message = message.replace(".".join(words) + ".", "")  # "required: eval.zeroshot.data" -> "required: data"
        where = " ".join([prog, *words])
        print(f"{where}: error: {message} (see {where} --help)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = fn(**kwargs)
    except INPUT_ERRORS as e:
        print(f"{' '.join([prog, *names])}: error: {one_line(e)}", file=sys.stderr)
        return 2
    if result is False:  # diffmm shards check found damage
        return 1
    return result if type(result) is int else 0


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``diffmm``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LIGHTNING_SUBCOMMANDS:
        return lightning_main(argv)
    return run_commands(COMMANDS, argv, "diffmm")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
