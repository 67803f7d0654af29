"""Packaging: one version source, the typing marker and the licence travel with the package, lint configured."""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib

import diffmm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_version_is_written_once_and_installed_metadata_agrees():
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "diffmm.__version__"}
    assert importlib.metadata.version("diffmm") == diffmm.__version__


def test_typing_marker_licence_and_changelog_ship():
    assert os.path.isfile(os.path.join(os.path.dirname(diffmm.__file__), "py.typed"))
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["diffmm"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License" in f.read(200)
    assert _pyproject()["project"]["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        assert f"[{diffmm.__version__}]" in f.read()


def test_ruff_passes_on_the_repository():
    """The same check `make test` runs first (a failure here names the file and line)."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_the_wheel_ships_the_library_and_not_the_demo_application():
    """``diffmm_demo/`` is an application beside the package (run from the repository, as timm's ``train.py``):
    package discovery leaves it out, and the library never imports it."""
    from setuptools import find_packages

    found = find_packages(ROOT, include=_pyproject()["tool"]["setuptools"]["packages"]["find"]["include"])
    assert {"diffmm", "diffmm.eval", "diffmm.data"} <= set(found), found
    assert not [p for p in found if not (p == "diffmm" or p.startswith("diffmm."))], found
    importers = [os.path.relpath(os.path.join(d, n), ROOT) for d, _, names in os.walk(os.path.dirname(diffmm.__file__))
                 for n in names if n.endswith(".py")
                 and re.search(r"^\s*(from|import) diffmm_demo\b", open(os.path.join(d, n)).read(), re.M)]
    assert not importers, f"the library imports the demo application: {importers}"
