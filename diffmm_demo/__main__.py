"""``python -m diffmm_demo``: the demo's command line, built by diffmm's own (:func:`diffmm.cli.run_commands`): each
command's flags and ``--help`` come from its function's signature and docstring.

    python -m diffmm_demo run --quick true --out report-quick    # what make demo-quick runs
    python -m diffmm_demo data all --out data                    # the demo datasets (make demo-data installs sources)
    python -m diffmm_demo montage --data data                    # docs/img/demo_montage.png
"""
from __future__ import annotations

import sys
from typing import Optional

from diffmm.cli import run_commands

from diffmm_demo.datasets import build_demo_data, build_emoji, build_fashion_mnist, build_python_docs
from diffmm_demo.imageset import build_icons, build_stamps
from diffmm_demo.montage import draw_demo_montage
from diffmm_demo.run import run_demo

PROG = "python -m diffmm_demo"
COMMANDS: dict = {
    "_help": "the diffmm demo: tiny models with standard and differential attention, trained and compared on CPU",
    "run": run_demo,
    "data": {"_help": "build the demo datasets from their Debian and npm packages (make demo-data installs them)",
             "emoji": build_emoji, "fashion-mnist": build_fashion_mnist, "python-docs": build_python_docs,
             "icons": build_icons, "stamps": build_stamps, "all": build_demo_data},
    "montage": draw_demo_montage,
}


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m diffmm_demo``; returns the exit status."""
    return run_commands(COMMANDS, list(sys.argv[1:] if argv is None else argv), PROG)


if __name__ == "__main__":
    sys.exit(main())
