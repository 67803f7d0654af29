"""Packaging: one version source, the typing marker and the licence travel with the package, lint configured."""
from __future__ import annotations

import importlib.metadata
import os
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
