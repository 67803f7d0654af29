"""``scripts/gpu_check.py``: the prepared GPU check must keep working although CI has no GPU.

The dry run executes every part at toy sizes on CPU with the Triton kernels interpreted, in a subprocess whose
import system refuses open_clip, webdataset, jsonargparse and Lightning (the GPU machine has none of them).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)
from gpucheck import kernels, record  # noqa: E402  (its parts; loading gpu_check.py put scripts/ on sys.path)

BLOCKED = ("open_clip", "webdataset", "jsonargparse", "lightning", "pytorch_lightning", "lightning_fabric")
BOOT = """
import importlib.abc, runpy, sys
BLOCKED = set(%r)
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(name + " is blocked: the GPU machine does not have it")
sys.meta_path.insert(0, Block())
%s
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""
# Replaces the fused kernel by the reference scaled by 1.001: fp32 cases must then fail (tolerance 2e-5).
SABOTAGE = """
import diffmm.ops as ops
from diffmm.ops import AttentionBackend, get_backend, register_backend
real = get_backend("triton")
def broken(q, k, v, lam, **kw):
    kw.pop("shapes", None)
    return ops.diff_attention(q, k, v, lam, backend="reference", **kw) * 1.001
register_backend(AttentionBackend("triton", broken, None, real.unsupported, "broken"), replace=True)
"""


def run_script(args: list[str], tmp_path: Path, prelude: str = "", timeout: int = 900) -> tuple[int, str, dict, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    env.pop("DIFFMM_ATTN_BACKEND", None)
    cmd = [sys.executable, "-c", BOOT % (BLOCKED, prelude), str(SCRIPT), "--out", str(tmp_path), *args]
    res = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=timeout)
    log = res.stdout + res.stderr
    files = sorted(tmp_path.glob("*-cpu-dryrun.json"))
    result = json.loads(files[0].read_text()) if files else {}
    md = files[0].with_suffix(".md").read_text() if files else ""
    return res.returncode, log, result, md


def test_model_pieces_import_without_optional_packages():
    """What gpu_check.py imports (diffmm.ops / nn / models.lm / the DiffCLIP classes) runs with the training stack
    missing."""
    code = BOOT.split("%s")[0] % (BLOCKED,) + """
import torch
import diffmm.ops, diffmm.nn
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.models.clip.config import load_config_file
from diffmm.models.clip.model import DiffCLIP
cfg = load_config_file("diffmm/model_configs/DiffCLIP-Tiny.json")
m = DiffCLIP(cfg.replace(vision_cfg=dict(layers=1), text_cfg=dict(layers=1)))
img, txt, scale = m(torch.randn(1, 3, 64, 64), torch.randint(0, 100, (1, 32)))
lm = DiffLM(LMConfig.from_name("diff-tiny"))
assert lm(torch.randint(0, 256, (1, 8))).shape == (1, 8, 256)
bad = [n for n in sys.modules if n.split(".")[0] in BLOCKED]
assert not bad, bad
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True, timeout=300, cwd=str(ROOT))
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_dry_run_runs_every_part(tmp_path):
    """The whole script at toy sizes: every part ok, every correctness case passes, results written."""
    code, log, result, md = run_script(["--dry-run", "--budget-s", "5000"], tmp_path)
    assert code == 0, log[-5000:]
    assert result["failures"] == [] and result["exit_code"] == 0
    assert result["meta"]["optional_modules_imported"] == []
    parts = result["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    assert all(p["status"] == "ok" for p in parts.values()), {k: (p["status"], p.get("reason"))
                                                              for k, p in parts.items()}

    corr = parts["correctness"]
    assert len(corr["rows"]) == 2 * 5 and all(r["status"] == "pass" for r in corr["rows"])
    assert {r["dtype"] for r in corr["rows"]} == {"fp16", "fp32"}
    assert any(s["what"] == "bf16" and "interpreter" in s["reason"] for s in corr["skipped"])
    errs = corr["rows"][0]["errs"]
    assert set(errs) == {"y", "dq", "dk", "dv", "dlam", "dnorm_weight"} and 0 < errs["dq"] < 1e-2

    speed = parts["speed"]
    fused = [r for r in speed["rows"] if r["impl"] == "fused-triton"]
    assert len(fused) == 2 and all(r["status"] == "ok" and r["check"]["status"] == "pass" for r in fused)
    measured = {r["impl"] for r in speed["rows"] if r["status"] == "ok"}
    assert {"sdpa-pair", "sdpa-split", "official-4call", "standard-sdpa"} <= measured
    assert all(r["fwd_ms"] > 0 and r["fwdbwd_tflops"] > 0 for r in speed["rows"] if r["status"] == "ok")
    assert speed["summary"] and "fwdbwd_speedup_vs_best_unfused" in speed["summary"][0]

    layers = parts["diff_v2"]["rows"]
    assert {r["mode"] for r in layers} == {"fwd", "fwdbwd", "decode"}
    assert all(r[f"{t}_ms"] > 0 for r in layers for t in ("standard", "diff", "diff_v2")), layers
    assert all(r["backends"]["diff"] == "triton" for r in layers)

    train = parts["train"]
    by = {(r["group"], r["attention"], r["backend"], r["head"]): r for r in train["rows"]}
    assert by[("830m", "diff", "triton", "fused")]["status"] == "unsupported"  # d = 96: the kernel takes 32, 64, 128
    assert "head dim" in by[("830m", "diff", "triton", "fused")]["reason"]
    assert {k[3] for k in by if k[0] == "1.4b"} == {"fused", "logits"}
    ok = [r for r in train["rows"] if r["status"] == "ok"]
    assert len(ok) == len(train["rows"]) - 1 and all(r["throughput"] > 0 and r["loss0"] > 0 for r in ok)
    compared = sorted((c["model"].split(" ")[0], c["compared"]) for c in train["checks"])
    assert compared == [("DiffCLIP-Tiny", "triton vs sdpa"), ("diff-1.4b", "fused head vs logits (sdpa)"),
                        ("diff-1.4b", "triton vs sdpa"), ("diff-830m", "fused head vs logits (sdpa)")], compared
    assert all(c["ok"] for c in train["checks"])

    for title in record.TITLES.values():
        assert title in md
    assert "Correctness failures: 0" in md and "| triton | fp32 |" in md
    assert result["kernels"] == {"autotune": {}, "binaries": []}  # interpreted: nothing compiled


def test_compiled_kernels_render_with_registers_and_spills(tmp_path):
    """The ``kernels`` record (tile, warps, stages, shared memory, device n_regs / n_spills) becomes a table."""
    meta = {"device_name": "H200", "date": "d", "torch": "t", "triton": "3.6", "flash_attn": None, "dry_run": False,
            "budget_s": 1, "command": "c", "t0": 0}
    rec = record.Recorder(tmp_path / "r.json", tmp_path / "r.md", meta)
    rec.result["kernels"] = {"autotune": {"fwd": {"(1024,)": "BLOCK_M: 32"}}, "binaries": [
        {"kernel": "bwd_dq", "D": 128, "CAUSAL": True, "PREC": "tf32", "BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8,
         "num_stages": 2, "shared": 102400, "n_regs": 162, "n_spills": 0}]}
    md = "\n".join(rec.markdown())
    assert "| bwd_dq | 128 | True | tf32 | 32 | 64 | 8 | 2 | 102400 | 162 | 0 |" in md


def test_wrong_kernel_fails_with_exit_code_1(tmp_path):
    """A kernel off by 0.1 % fails every fp32 case (tolerance 2e-5) and the run exits 1, naming the cases."""
    code, log, result, md = run_script(["--dry-run", "--parts", "1"], tmp_path, prelude=SABOTAGE)
    assert code == 1, log[-3000:]
    rows = result["parts"]["correctness"]["rows"]
    assert all(r["status"] == "FAIL" for r in rows if r["dtype"] == "fp32")
    assert all(r["status"] == "pass" for r in rows if r["dtype"] == "fp16")  # 1e-3 < fp16 tolerance 1e-2
    assert len(result["failures"]) == 5 and all("fp32" in f for f in result["failures"])
    assert "FAILED" in log and "check(s) FAILED" in result["parts"]["correctness"]["status"]
    assert "FAIL" in md


def test_exhausted_budget_skips_parts_with_reason(tmp_path):
    code, log, result, md = run_script(["--dry-run", "--budget-s", "0"], tmp_path)
    assert code == 0, log[-3000:]
    for part in result["parts"].values():
        assert part["status"] == "skipped" and "budget" in part["reason"]
    assert "skipped" in md


@pytest.mark.slow
def test_dry_run_with_precompile_workers(tmp_path):
    """``--jobs``: worker processes run every kernel variant the selected parts need before the parts."""
    code, log, result, md = run_script(["--dry-run", "--parts", "diff_v2,train", "--jobs", "2", "--budget-s", "5000"],
                                       tmp_path)
    assert code == 0, log[-5000:]
    pre = result["meta"]["prewarm"]
    assert pre["exit_codes"] == [0, 0] and pre["failed_lines"] == [] and pre["tasks"] >= 3, pre
    assert all(p["status"] == "ok" for p in result["parts"].values())


def test_cli_errors_are_one_line():
    assert gpu_check.parse_parts("1,train") == ["correctness", "train"]
    assert gpu_check.parse_parts("speed,2") == ["speed"]
    assert gpu_check.parse_parts(None) == list(gpu_check.PARTS)
    with pytest.raises(ValueError, match="unknown part '7'"):
        gpu_check.parse_parts("7")
    assert gpu_check.command_line(["--out", "/some/where", "--parts", "1"]) == \
        "python scripts/gpu_check.py --out DIR --parts 1"
    if not torch.cuda.is_available():
        res = subprocess.run([sys.executable, str(SCRIPT), "--parts", "1"], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
        assert res.returncode == 2 and "--dry-run" in res.stderr.strip().splitlines()[-1]


def test_tolerances_match_the_kernel_tests():
    """Part 1 uses the CPU tests' tolerances (fp32, fp16); compare() flags errors and non-finite values."""
    C = kernels
    src = (ROOT / "tests" / "ops" / "test_triton_diff.py").read_text()
    m = re.search(r"TOL = \{torch\.float32: ([0-9.e-]+), torch\.float16: ([0-9.e-]+)\}", src)
    assert m, "TOL not found in tests/ops/test_triton_diff.py"
    assert C.TOL[torch.float32] == float(m.group(1)) and C.TOL[torch.float16] == float(m.group(2))

    want = [torch.ones(3, 4) for _ in record.GRAD_NAMES]
    assert C.compare([w.clone() for w in want], want, 1e-5)[0]
    got = [w.clone() for w in want]
    got[2][0, 0] += 2e-3
    ok, errs = C.compare(got, want, 1e-3)
    assert not ok and errs["dk"] == pytest.approx(2e-3, rel=1e-4) and errs["dq"] == 0
    got[1][0, 0] = float("nan")
    assert C.compare(got, want, 1.0)[1]["dq"] == float("inf")


def test_empty_rows_are_found():
    c = kernels.Case("x", 2, 5, 3, 1, 1, 32, True, True)
    km = torch.tensor([[True, True, True], [False, False, False]])
    rows = kernels.empty_row_mask(c, km, "cpu")
    # causal, S < N: query i sees keys j <= i - 2, so rows 0, 1 see nothing; sequence 1 is fully padded
    assert rows.tolist() == [[True, True, False, False, False], [True] * 5]


def test_out_of_time_records_what_is_left_and_stops_the_loop():
    import time

    now = time.time()
    part = {"skipped": []}
    ctx = record.Ctx(device=torch.device("cpu"), dry=True, t0=now, deadline=now + 60, rec=None)
    assert not ctx.out_of_time(part, "case A", 3, "cases") and part["skipped"] == []
    ctx.part_deadline = now - 1  # the part's budget is spent: the loop stops, the rest is recorded once
    assert ctx.out_of_time(part, "case B", 2, "cases")
    assert part["skipped"] == [{"what": "2 cases from case B on", "reason": part["skipped"][0]["reason"]}]
    assert "part budget used up" in part["skipped"][0]["reason"] and "case B not run" in part["skipped"][0]["reason"]
