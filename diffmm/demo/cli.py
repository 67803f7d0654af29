"""``diffmm demo``: the options of :func:`~diffmm.demo.run.run_demo`, from its signature and docstring (jsonargparse)."""
from jsonargparse import CLI

from diffmm.demo.run import run_demo


def main(argv: list[str]) -> int:
    """Run ``diffmm demo ARGV`` (a bare ``--quick`` means ``--quick true``); returns the exit status."""
    return CLI(run_demo, args=["--quick=true" if a == "--quick" else a for a in argv])
