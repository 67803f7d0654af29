"""``python -m diffmm_demo``: the demo's command line is diffmm's (``run_commands``) over the demo's own functions."""
from __future__ import annotations

import subprocess
import sys

from diffmm.cli import parse

from diffmm_demo.__main__ import COMMANDS, PROG, main
from diffmm_demo.datasets import build_emoji
from diffmm_demo.run import run_demo


def test_parse_maps_a_demo_command_line_to_its_function():
    names, fn, kwargs = parse(["run", "--quick", "true", "--parts", "[clip]"], COMMANDS, PROG)
    assert names == ["run"] and fn is run_demo
    assert (kwargs["quick"], kwargs["parts"], kwargs["out"]) == (True, ["clip"], "report")
    names, fn, kwargs = parse(["data", "emoji", "--styles", "[noto]"], COMMANDS, PROG)
    assert names == ["data", "emoji"] and fn is build_emoji and kwargs["styles"] == ["noto"]


def test_usage_and_errors_are_one_line_naming_the_demo(tmp_path, capsys):
    assert main([]) == 0 and "montage" in capsys.readouterr().out
    assert main(["data", "--help"]) == 0 and "stamps" in capsys.readouterr().out
    for argv, want in ((["run", "--parts", "[vision]"], "python -m diffmm_demo run: error: --parts:"),
                       (["run", "--seeds", "[0,0]", "--out", str(tmp_path)], "seeds [0, 0] (distinct, at least one)"),
                       (["data", "stamps", "--root", str(tmp_path / "none"), "--out", str(tmp_path)],
                        "python -m diffmm_demo data stamps: error: ")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], (argv, err)


def test_runs_as_a_module_from_the_repository():
    out = subprocess.run([sys.executable, "-m", "diffmm_demo", "run", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "--threads" in out.stdout, out.stderr[-2000:]
