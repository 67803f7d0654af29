"""Parallel pre-compilation for ``scripts/gpu_check.py --jobs N``.

Each Triton compile of the fused kernel costs seconds, and a full check needs over a hundred (three dtypes and
several masks in part 1; every autotune candidate tile of every head count and head dim in parts 2-4). Run one
after the other they would eat most of the 8-minute budget, so before the measured parts ``N`` worker processes
launch every kernel variant the run will need once, at a tiny size, each worker a share of the list. Triton keeps
what they compile in its on-disk cache; the main process then loads instead of compiling, and its own autotuning
benchmarks run alone on the GPU (the workers force one tile per launch and never benchmark).

A kernel binary depends on the dtype, the constexprs (head dim, causal, padding, norm, tile) and on how the
integer arguments specialise (``== 1``, divisible by 16): here the head count ``H`` and the GQA ratio ``REP``.
Sequence lengths are not specialised (``do_not_specialize``), so a short sequence compiles the same binary as the
measured one. The tasks are derived from the same tables the parts use, so they stay in step with them.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time

import torch

import gpu_check_correctness as C
import gpu_check_models as M
import gpu_check_speed as S

WARM_N = 64  # sequence length of a warm-up launch


def tuned_variants(dry: bool, parts: list[str]) -> list[tuple]:
    """(d, h, h_kv, causal) of every autotuned bf16 call parts 2-4 make (no padding, norm with weight)."""
    from diffmm.models.clip.config import get_model_config
    from diffmm.models.lm import LMConfig
    from diffmm.ops.triton_diff import HEAD_DIMS

    out = []
    if "speed" in parts:
        cfg = S.DRY if dry else S.GPU
        out += [(d, cfg["width"] // (2 * d), cfg["width"] // (2 * d), causal) for d in cfg["dims"]
                for causal in (False, True)]
    if "diff_v2" in parts:
        for c in (M.LAYER_DRY if dry else M.LAYER_GPU):
            out.append((c["dim"] // c["heads"], c["heads"] // 2, (c["kv_heads"] or c["heads"]) // 2, True))
    if "train" in parts:
        clip, lm = (M.CLIP_DRY, M.LM_DRY) if dry else (M.CLIP_GPU, M.LM_GPU)
        cfg = get_model_config(clip["diff"]).replace(**clip["overrides"])
        v, t = cfg.vision_cfg, cfg.text_cfg
        out += [(v.head_width, v.heads // 2, v.heads // 2, False), (t.width // t.heads, t.heads // 2, t.heads // 2, True)]
        for shape, over in lm["shapes"].items():
            c = LMConfig.from_name(f"diff-{shape}", **over)
            out.append((c.head_dim, c.n_head // 2, c.n_kv_head // 2, True))
    seen, uniq = set(), []
    for v in out:
        if v[0] in HEAD_DIMS and v not in seen:
            seen.add(v)
            uniq.append(v)
    return uniq


def _autotuners():
    from diffmm.ops import triton_diff_bwd as B
    from diffmm.ops import triton_diff_fwd as F

    kerns = [getattr(F, "_fwd_kernel", None), getattr(B, "_dkdv_kernel", None), getattr(B, "_dq_kernel", None)]
    return [k for k in kerns if k is not None and hasattr(k, "configs")]  # none under the interpreter


def candidate_tiles(kern, d: int) -> list:
    """The tiles the autotuner would try for head dim ``d`` (its own pruning rule)."""
    prune = getattr(kern, "early_config_prune", None)
    return list(prune(kern.configs, {}, D=d)) if prune else list(kern.configs)


def n_rounds(d: int) -> int:
    return max([len(candidate_tiles(k, d)) for k in _autotuners()] or [1])


@contextlib.contextmanager
def forced_tile(d: int, r: int):
    """Every autotuned kernel uses its ``r``-th candidate tile (or its first), without benchmarking."""
    saved = []
    for k in _autotuners():
        tiles = candidate_tiles(k, d)
        saved.append((k, k.configs))
        k.configs = [tiles[r] if r < len(tiles) else tiles[0]]  # one config: the autotuner just launches it
    try:
        yield
    finally:
        for k, cfgs in saved:
            k.configs = cfgs


def warm_tasks(dry: bool, parts: list[str]) -> list[tuple]:
    """Every launch that needs a compile: part 1's cases per dtype, and each candidate tile of each variant."""
    tasks = []
    if "correctness" in parts:
        dtypes = ["fp16", "fp32"] if dry else ["bf16", "fp16", "fp32"]
        tasks += [("case", dt, c.name) for dt in dtypes for c in (C.DRY_CASES if dry else C.GPU_CASES)]
    with C.autotuning(True):
        tasks += [("tuned", v, r) for v in tuned_variants(dry, parts) for r in range(n_rounds(v[0]))]
    return tasks


def run_task(task: tuple, device: torch.device) -> None:
    import diffmm.ops as ops

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if task[0] == "case":
        case = {c.name: c for c in C.GPU_CASES + C.DRY_CASES}[task[2]]
        with C.autotuning(False):
            C.run_backend("triton", case, *C.make_inputs(case, dtypes[task[1]], device))
        return
    (d, h, h_kv, causal), r = task[1], task[2]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    mk = lambda *s: torch.randn(*s, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v = mk(1, WARM_N, 2 * h, d), mk(1, WARM_N, 2 * h_kv, d), mk(1, WARM_N, h_kv, 2 * d)
    lam = torch.tensor(0.3, device=device, requires_grad=True)
    w = torch.ones(2 * d, device=device, requires_grad=True)
    with C.autotuning(True), forced_tile(d, r):
        y = ops.diff_attention(q, k, v, lam, causal=causal, norm_weight=w, lambda_init=0.2, backend="triton")
        y.backward(torch.randn_like(y))


def worker(shard: str, dry: bool, parts: list[str]) -> int:
    """Run tasks ``i::n`` of :func:`warm_tasks` (``shard = 'i/n'``); one line per task; exit 1 if any failed."""
    i, n = (int(x) for x in shard.split("/"))
    device = torch.device("cpu" if dry else "cuda")
    failed = 0
    for task in warm_tasks(dry, parts)[i::n]:
        t = time.time()
        try:
            run_task(task, device)
            print(f"warm {task}: {time.time() - t:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001  (the measured run will report it properly)
            failed += 1
            print(f"warm {task}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  flush=True)
    return 1 if failed else 0


def prewarm(ctx, script: str, jobs: int, parts: list[str], timeout_s: float) -> dict:
    """Start ``jobs`` workers, wait at most ``timeout_s``; returns what happened (for the JSON)."""
    tasks = warm_tasks(ctx.dry, parts)
    jobs = max(1, min(jobs, len(tasks)))
    t0 = time.time()
    ctx.progress("0/prewarm", f"{len(tasks)} kernel launches in {jobs} worker processes (at most {timeout_s:.0f} s)")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    argv = [sys.executable, script, "--_warm", "", "--parts", ",".join(parts)] + (["--dry-run"] if ctx.dry else [])
    procs = []
    for i in range(jobs):
        argv[3] = f"{i}/{jobs}"
        procs.append(subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env))
    logs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, t0 + timeout_s - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(killed: prewarm time limit)"
        codes.append(p.returncode)
        logs += out.strip().splitlines()
    failed = [line for line in logs if "FAILED" in line or "killed" in line or "Traceback" in line]
    times = [float(m.group(1)) for m in (re.search(r": ([0-9.]+) s$", line) for line in logs) if m]
    res = {"jobs": jobs, "tasks": len(tasks), "done": len(times), "wall_s": round(time.time() - t0, 1),
           "task_s_sum": round(sum(times), 1), "task_s_max": max(times, default=None), "exit_codes": codes,
           "failed_lines": failed[:20]}
    ctx.progress("0/prewarm", f"{res['done']}/{len(tasks)} launches done in {res['wall_s']} s (compile + run "
                              f"{res['task_s_sum']} s summed over workers); worker exit codes {codes}" +
                 (f"; {len(failed)} problem line(s), first: {failed[0]}" if failed else ""))
    return res
