"""The grid and the timing loop of ``scripts/bench_attention.py --tune`` (the CPU layout table of the sdpa backend).

Every layout of :mod:`diffmm.ops.sdpa` is timed on the whole op (fused head norm included), forward alone (no
grad) and forward+backward, per mask kind, on the shapes of diffmm's models and a sweep of N and d, at each thread
count; layouts are interleaved in rounds in one process and the median wins. The result is the table format of
:mod:`diffmm.ops.tune`.
"""
from __future__ import annotations

import os
import platform
import statistics
import time

import torch

# (name, B, N, h, d, mask kinds): the attention calls of diffmm's models (training batches), then a sweep.
TUNE_MODEL_SHAPES = [
    ("DiffCLIP-Tiny vision", 64, 65, 2, 32, ("none",)),
    ("DiffCLIP-Tiny text", 64, 32, 2, 32, ("causal",)),
    ("DiffCLIP-ViT-B-16 vision", 8, 197, 6, 64, ("none",)),
    ("DiffCLIP-ViT-B-16 text", 8, 77, 4, 64, ("causal",)),
    ("DIFF LM 58M", 4, 512, 8, 32, ("causal", "padding")),
]
TUNE_SWEEP_N = (64, 256, 1024, 4096)
PAIR_MAX_TUNE_N = 256


def tune_shapes(quick: bool) -> list[tuple]:
    shapes = list(TUNE_MODEL_SHAPES)
    for d, h in ((32, 8), (64, 4)):
        for N in (TUNE_SWEEP_N[:3] if quick else TUNE_SWEEP_N):
            shapes.append((f"sweep d={d}", max(1, 2048 // N), N, h, d, ("none", "causal")))
    return shapes


def _tune_case(B, N, h, d, mask, grad, layouts, rounds, clock):
    """Median ms of each layout for one call (interleaved rounds; order alternates)."""
    from diffmm.ops.sdpa import diff_attention_sdpa
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, 2 * h, d, generator=g, requires_grad=grad)
    k = torch.randn(B, N, 2 * h, d, generator=g, requires_grad=grad)
    v = torch.randn(B, N, h, 2 * d, generator=g, requires_grad=grad)
    lam = torch.tensor(0.3, requires_grad=grad)
    w = torch.ones(2 * d, requires_grad=grad)
    dy = torch.randn(B, N, h, 2 * d, generator=g)
    attn_mask = None
    if mask == "padding":
        attn_mask = torch.rand(B, N, generator=g) > 0.1
        attn_mask[:, -1] = True
    causal = mask in ("causal", "padding")

    def make(layout):
        def run():
            with torch.set_grad_enabled(grad):
                y = diff_attention_sdpa(q, k, v, lam, causal=causal, attn_mask=attn_mask, norm_weight=w,
                                        lambda_init=0.2, layout=layout)
                if grad:
                    y.backward(dy)
                    for t in (q, k, v, lam, w):
                        t.grad = None
        return run
    fns = {lay: make(lay) for lay in layouts}
    for fn in fns.values():
        fn()  # warm-up
    times = {lay: [] for lay in layouts}
    for r in range(rounds):
        for lay in (layouts if r % 2 == 0 else layouts[::-1]):
            t0 = clock()
            fns[lay]()
            times[lay].append((clock() - t0) * 1e3)
    return {lay: statistics.median(t) for lay, t in times.items()}


def run_tune(args) -> dict:
    from diffmm.ops.sdpa import LAYOUTS
    from diffmm.ops.tune import VERSION
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    threads_list = args.threads or [torch.get_num_threads()]
    if args.clock == "cpu" and any(t != 1 for t in threads_list):
        print("note: --clock cpu measures the main thread only; it is meaningful with --threads 1", flush=True)
    layouts = list(LAYOUTS)
    entries = []
    t_start = time.time()
    for threads in threads_list:
        torch.set_num_threads(threads)
        for name, B, N, h, d, masks in tune_shapes(args.quick):
            for mask in masks:
                for grad in (True, False):
                    rounds = args.reps or (3 if B * h * N * N * d > 2 ** 31 else 5)
                    # pair runs the math kernel on CPU (an N x S matrix per head): quadratic memory, never competitive
                    # beyond short sequences, so it only competes there
                    cands = [lay for lay in layouts if lay != "pair" or N <= PAIR_MAX_TUNE_N]
                    ms = _tune_case(B, N, h, d, mask, grad, cands, rounds, clock)
                    best = min(ms, key=ms.get)
                    e = {"shape": name, "dtype": "float32", "mask": mask, "grad": grad, "threads": threads, "B": B,
                         "N": N, "S": N, "h": h, "h_kv": h, "d": d, "ms": ms, "best": best,
                         "loadavg_1m": os.getloadavg()[0]}
                    entries.append(e)
                    print(f"  {threads}t {name:26s} B={B:<3d} N={N:<5d} h={h} d={d} {mask:8s} "
                          f"{'fwd+bwd' if grad else 'fwd    '}: " +
                          " ".join(f"{lay} {t:.2f}" for lay, t in ms.items()) + f" -> {best} "
                          f"(load {e['loadavg_1m']:.1f}, {time.time() - t_start:.0f} s)", flush=True)
    return {"version": VERSION, "device": "cpu", "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "clock": "thread_cpu" if args.clock == "cpu" else "wall", "layouts": layouts, "entries": entries}


def tune_table(res: dict) -> str:
    layouts = res["layouts"]
    loads = [e["loadavg_1m"] for e in res["entries"]]
    lines = [f"CPU layout table ({res['clock']} clock, torch {res['torch']}, fp32, median ms; each layout's time "
             f"relative to the best; 1-min load {min(loads):.1f}-{max(loads):.1f})", "",
             "| threads | shape | B | N | h | d | mask | pass | " + " | ".join(layouts) + " | best |",
             "|---:|---|---:|---:|---:|---:|---|---|" + "---:|" * len(layouts) + "---|"]
    for e in res["entries"]:
        best = e["ms"][e["best"]]
        cells = " | ".join(f"{e['ms'][lay] / best:.2f}x" if lay in e["ms"] else "-" for lay in layouts)
        lines.append(f"| {e['threads']} | {e['shape']} | {e['B']} | {e['N']} | {e['h']} | {e['d']} | {e['mask']} | "
                     f"{'fwd+bwd' if e['grad'] else 'fwd'} | {cells} | **{e['best']}** ({best:.1f} ms) |")
    return "\n".join(lines)
