"""The ``diffmm`` command: every subcommand's flags and help come from its function; errors are one line."""
from __future__ import annotations

import inspect

import docstring_parser
import pytest

from diffmm.cli import COMMANDS, main, one_line, parse, underscore_flags


def _functions(commands: dict, prefix: str = "diffmm"):
    for name, target in commands.items():
        if isinstance(target, dict):
            yield from _functions(target, f"{prefix} {name}")
        elif name != "_help":
            yield f"{prefix} {name}", target


@pytest.mark.parametrize("command,fn", list(_functions(COMMANDS)), ids=lambda v: v if isinstance(v, str) else "")
def test_every_flag_has_help_from_the_docstring(command, fn):
    doc = docstring_parser.parse(fn.__doc__)
    documented = {p.arg_name for p in doc.params if p.description}
    assert doc.short_description, f"{command}: no one-line description"
    missing = [n for n in inspect.signature(fn).parameters if n not in documented]
    assert not missing, f"{command}: parameters without a docstring entry (their --help): {missing}"


def test_parse_maps_a_command_line_to_its_function():
    names, fn, kwargs = parse(["eval", "recall", "--lm", "config:transformer-tiny", "--seq_len", "[16, 32]",
                               "--attention", "false"])
    assert names == ["eval", "recall"] and fn is COMMANDS["eval"]["recall"]
    assert kwargs["seq_len"] == [16, 32] and kwargs["attention"] is False and kwargs["pairs"] == (4, 8, 16, 32)
    names, fn, kwargs = parse(["shards", "from-text", "out", "a.txt", "b/"])  # positionals in signature order
    assert names == ["shards", "from-text"] and (kwargs["out"], kwargs["files"]) == ("out", ["a.txt", "b/"])


def test_the_library_cli_holds_no_application():
    """The demo is an application beside the package (``python -m diffmm_demo``): ``diffmm`` keeps the generic shard
    writers and no demo command, and the package imports nothing of the demo."""
    assert "demo" not in COMMANDS
    assert sorted(n for n in COMMANDS["shards"] if n != "_help") == ["check", "from-captions", "from-folders",
                                                                       "from-text", "index"]
    assert all(not fn.__module__.startswith("diffmm_demo") for _, fn in _functions(COMMANDS))


def test_usage_and_errors(tmp_path, capsys):
    assert main([]) == 0 and "shards" in capsys.readouterr().out
    assert main(["eval", "--help"]) == 0 and "zeroshot" in capsys.readouterr().out
    for argv, want in ((["nope"], "diffmm: error: argument subcommand: invalid choice: 'nope'"),
                       (["eval", "needle", "--lm", "x", "--trials", "ten"], "diffmm eval needle: error: --trials:"),
                       (["shards", "demo-emoji"], "diffmm shards: error: ")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], (argv, err)


def test_help_lists_the_lightning_commands(capsys):
    """``fit|validate|test|predict`` go to the LightningCLI before the parser, yet ``diffmm --help`` lists them."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    usage = out.splitlines()[0]
    assert "{fit,validate,test,predict,eval,classify,shards,export}" in usage, usage
    assert "LightningCLI" in out


def test_dashed_flags_are_aliases_of_the_parameter_names():
    argv = ["eval", "recall", "--lm", "config:transformer-tiny", "--seq-len=[16, 32]", "--batch-size", "4",
            "--out", "my-file--x.json"]
    assert underscore_flags(argv)[4:] == ["--seq_len=[16, 32]", "--batch_size", "4", "--out", "my-file--x.json"]
    dashed = parse(underscore_flags(argv))
    assert dashed == parse(["eval", "recall", "--lm", "config:transformer-tiny", "--seq_len", "[16, 32]",
                            "--batch_size", "4", "--out", "my-file--x.json"])
    assert dashed[2]["batch_size"] == 4 and dashed[2]["seq_len"] == [16, 32]


def test_an_error_carrying_a_worker_traceback_is_one_line():
    worker = ValueError("Caught ValueError in DataLoader worker process 1.\n"
                        "Original Traceback (most recent call last):\n"
                        '  File "x.py", line 3, in f\n    raise ValueError(...)\n'
                        "ValueError: No samples found; fewer shards than workers.\nTurn off empty_check.")
    assert one_line(worker) == ("Caught ValueError in DataLoader worker process 1. ValueError: No samples found; "
                                "fewer shards than workers. Turn off empty_check.")
    assert one_line(KeyError("config.json: no key 'model'")) == "config.json: no key 'model'"
