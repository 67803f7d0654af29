"""The Triton kernels' autotune keys name real kernel arguments and bucket the sequence lengths.

Triton's autotuner silently ignores a key that is not an argument name, so a typo would make every launch
share one tuned tile; keying on raw N and S would re-benchmark every tile for each new prompt length and
at every decode step. The autotuners exist only outside the interpreter, so this runs in a subprocess
with ``TRITON_INTERPRET=0`` (building an autotuner needs no GPU)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
from diffmm.ops import triton_diff_bwd as B, triton_diff_fwd as F
for kern in (F._fwd_kernel, B._dkdv_kernel, B._dq_kernel):
    names = kern.fn.arg_names if hasattr(kern, "fn") else kern.arg_names
    assert all(k in names for k in kern.keys), (kern.keys, names)
    assert "N" not in kern.keys and "S" not in kern.keys and "N_BKT" in kern.keys and "S_BKT" in kern.keys
assert [F.length_bucket(n) for n in (1, 16, 17, 1000, 1024, 1025)] == [16, 16, 32, 1024, 1024, 2048]
print("ok")
"""


def test_autotune_keys_are_kernel_arguments_with_bucketed_lengths():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
