"""``scripts/kill_soak.py`` at a small size: a ``diffmm fit`` SIGKILLed at random moments (a checkpoint every step,
so some kills land inside a save) and resumed with ``--ckpt_path last`` ends bit-identical with the uninterrupted
run: weights, optimizer state and every logged loss (subprocesses; slow)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.slow
@pytest.mark.parametrize("devices,workers", [(1, 0), (1, 2), (2, 0)])
def test_kill_soak_ends_bit_identical(tmp_path, devices, workers):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "scripts/kill_soak.py", "--kills", "3", "--steps", "12", "--devices",
                          str(devices), "--workers", str(workers), "--out", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "3 SIGKILLs" in out.stdout and "tensors differing 0/" in out.stdout and "BIT-IDENTICAL" in out.stdout
