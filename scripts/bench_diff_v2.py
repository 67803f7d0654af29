"""Time and peak memory of one attention layer: standard vs DIFF V1 vs DIFF V2 at equal width.

Each layer is built by ``create_attention(type, dim, heads)`` (same width, same standard head count) and
run on x (B, N, E) with a causal mask and RoPE off. Modes:

- ``fwd``: forward under ``torch.no_grad`` (inference prefill),
- ``fwdbwd``: forward + backward of ``out.sum()`` (training step of the layer),
- ``decode``: one new token attending to a KV cache of N positions (autoregressive decoding); time per
  token, averaged over a burst of decode steps.

The table adds the forward matmul-FLOP ratio to standard (``forward_flops``), the arithmetic floor the
measured ratio should be compared with: V2 runs twice the query maps, so its attention core costs 2x.

Peak memory: on CUDA ``max_memory_allocated`` above the inputs; on CPU the rise of the process's peak
RSS (VmHWM, reset through /proc/self/clear_refs) during one call, measured in a fresh subprocess per cell.

    PYTHONPATH=. python scripts/bench_diff_v2.py                     # CPU fp32, N in {1024, 4096}
    PYTHONPATH=. python scripts/bench_diff_v2.py --device cuda --dtype bf16   # GPU rows
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from diffmm.nn import KVCache, create_attention

TYPES = ("standard", "diff", "diff_v2")
DECODE_INNER = 20  # decode steps per timed call (one step is ~1 ms)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(attn_type: str, a, device, dtype):
    torch.manual_seed(0)
    m = create_attention(attn_type, a.dim, a.heads, num_kv_heads=a.kv_heads, causal=True, backend=a.backend)
    return m.to(device=device, dtype=dtype)


def make_step(m, mode: str, N: int, a, device, dtype):
    """A zero-argument callable running one measured call."""
    x = torch.randn(a.batch, N, a.dim, device=device, dtype=dtype)
    if mode == "fwd":
        def step():
            with torch.no_grad():
                return m(x)
    elif mode == "fwdbwd":
        x.requires_grad_(True)

        def step():
            m.zero_grad(set_to_none=True)
            x.grad = None
            m(x).float().sum().backward()
    elif mode == "decode":
        cache = KVCache(N)
        with torch.no_grad():
            m(x[:, :N - 1], kv_cache=cache)  # prefill N-1 positions
        x1 = x[:, N - 1:]

        def step():
            with torch.no_grad():
                for _ in range(DECODE_INNER):
                    cache.length = N - 1  # rewind, then attend 1 token over N keys
                    m(x1, kv_cache=cache)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return step


def forward_flops(attn_type: str, mode: str, N: int, a) -> float:
    """Matmul FLOPs of one forward (causal); ``diff`` counted as the fused kernel runs it (docs/kernels.md, section 3).

    fwd+bwd costs about 3x the forward for every type, so the ratios of the forward apply to it too.
    """
    E, H = a.dim, a.heads
    d, kv = E // H, a.kv_heads or H
    n_q, S = (1, N) if mode == "decode" else (N, N)
    pairs = n_q * S if mode == "decode" else N * (N + 1) / 2  # causal (query, key) pairs
    q_out = 2 * E if attn_type == "diff_v2" else E
    proj = 2 * n_q * E * (q_out + 2 * kv * d + E + (H if attn_type == "diff_v2" else 0))
    core = {"standard": 4 * pairs * d * H, "diff": 6 * pairs * d * H, "diff_v2": 8 * pairs * d * H}[attn_type]
    return proj + core


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(steps: dict, device, reps: int, warmup: int = 2) -> dict:
    """Median ms per step; the steps take turns in every repetition so machine noise hits all alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync(device)
    times = {k: [] for k in steps}
    for _ in range(reps):
        for k, step in steps.items():
            t0 = time.perf_counter()
            step()
            sync(device)
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def cpu_peak_mib_inproc(attn_type, mode, N, a) -> float:
    """Run in a fresh process: rise of peak RSS during one call."""
    dev, dt = torch.device("cpu"), DTYPES[a.dtype]
    m = build(attn_type, a, dev, dt)
    make_step(m, mode, 64, a, dev, dt)()  # initialise thread pools / kernels on a tiny input
    step = make_step(m, mode, N, a, dev, dt)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status_kb("VmRSS")
    step()
    return max(_status_kb("VmHWM") - base, 0) / 1024


def cpu_peak_mib(attn_type, mode, N, a) -> float | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--_mem", attn_type, mode, str(N), "--dim", str(a.dim),
           "--heads", str(a.heads), "--batch", str(a.batch), "--dtype", a.dtype, "--threads", str(a.threads)]
    if a.kv_heads:
        cmd += ["--kv-heads", str(a.kv_heads)]
    if a.backend:
        cmd += ["--backend", a.backend]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        print(f"memory subprocess failed: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["peak_mib"]


def cuda_peak_mib(step, device) -> float:
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8, help="standard heads at this width")
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd", "decode"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier on a shared machine)")
    p.add_argument("--backend", default=None, help="diffmm.ops backend (default automatic)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--_mem", nargs=3, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    a.dtype = a.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.set_num_threads(a.threads)
    if a._mem:
        attn_type, mode, N = a._mem
        print(json.dumps({"peak_mib": cpu_peak_mib_inproc(attn_type, mode, int(N), a)}))
        return 0
    dt = DTYPES[a.dtype]
    print(f"# device {device}, {a.dtype}, threads {a.threads}, width {a.dim}, {a.heads} standard heads "
          f"(d={a.dim // a.heads}), kv heads {a.kv_heads or a.heads}, batch {a.batch}, causal, backend "
          f"{a.backend or 'auto'}, median of {a.reps}")
    rows = []
    for N in a.seq:
        for mode in a.modes:
            row = {"N": N, "mode": mode}
            steps = {t: make_step(build(t, a, device, dt), mode, N, a, device, dt) for t in TYPES}
            for t, ms in time_ms(steps, device, a.reps).items():
                row[f"{t}_ms"] = ms / (DECODE_INNER if mode == "decode" else 1)  # decode: per token
            if not a.no_memory:
                for t in TYPES:
                    row[f"{t}_mib"] = (cuda_peak_mib(steps[t], device) if device.type == "cuda"
                                       else cpu_peak_mib(t, mode, N, a))
            del steps
            rows.append(row)
            print(f"  N={N} {mode}: " + ", ".join(f"{t} {row[f'{t}_ms']:.2f} ms" for t in TYPES), flush=True)
    hdr = "| N | mode | standard ms | V1 ms | V2 ms | V1/std | V2/std | FLOPs V1/std | FLOPs V2/std |"
    sep = "|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    if not a.no_memory:
        hdr += " standard MiB | V1 MiB | V2 MiB |"
        sep += "---:|---:|---:|"
    print("\n" + hdr + "\n" + sep)
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        s, d1, d2 = r["standard_ms"], r["diff_ms"], r["diff_v2_ms"]
        f0, f1, f2 = (forward_flops(t, r["mode"], r["N"], a) for t in TYPES)
        line = (f"| {r['N']} | {r['mode']} | {s:.2f} | {d1:.2f} | {d2:.2f} | {d1 / s:.2f}x | {d2 / s:.2f}x | "
                f"{f1 / f0:.2f}x | {f2 / f0:.2f}x |")
        if not a.no_memory:
            line += f" {fmt(r['standard_mib'])} | {fmt(r['diff_mib'])} | {fmt(r['diff_v2_mib'])} |"
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "_mem"}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
