"""Build all demo datasets (emoji, Fashion-MNIST, Python docs) and the docs montage with one command.

Same as ``diffmm shards demo-all`` followed by ``diffmm shards montage``; options go to demo-all
(e.g. ``--out data --styles noto,openmoji --skin-tones --no-install``).

Usage: python scripts/build_demo_data.py [--out data] [...]
"""
from __future__ import annotations

import sys

from diffmm.data.shards_cli import main


def run(argv: list[str]) -> int:
    rc = main(["demo-all", *argv])
    if rc != 0 or "-h" in argv or "--help" in argv:
        return rc
    out = argv[argv.index("--out") + 1] if "--out" in argv else "data"
    return main(["montage", "--data", out, "--out", "docs/img/demo_montage.png"])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
