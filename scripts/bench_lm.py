"""Training throughput of the DIFF LM against HF DiffLlama and HF Llama of equal size, in one process.

A random DIFF LM is written as an HF DiffLlama folder (``diffmm.hub.difflama.save_difflama``); then the same
weights are loaded three ways:

- ``diffmm DIFF LM``: ``diffmm.load_pretrained(folder)`` (the DiffLlama format loader);
- ``HF DiffLlama``: ``DiffLlamaForCausalLM.from_pretrained(folder)`` (``--hf-attn``, default sdpa);
- ``HF Llama``: ``LlamaForCausalLM`` of the same shape (2h heads of dim d) with the same projection, MLP,
  norm and embedding weights (the lambdas have no place in it), from a second local folder;
- ``diffmm Transformer`` (``--with-twin``): diffmm's standard-attention LM of the same shape (2h heads of dim d),
  holding the DIFF LM's tensors (a timing twin: same shapes and work, not the same function).

One training step = forward, mean next-token cross entropy, backward, AdamW step (same optimizer settings for
every model). Models are timed in interleaved rounds and the median per model is reported, so machine noise
hits all of them alike; the 1-minute load average is printed beside the table. The JSON records the CPU model,
torch version, threads and the 1-minute load average at start and end.

    PYTHONPATH=. python scripts/bench_lm.py                          # 58M LM, batch 4 x 512, 2 threads
    PYTHONPATH=. python scripts/bench_lm.py --rounds 7 --json results/bench_lm.json
    PYTHONPATH=. python scripts/bench_lm.py --compile                # also diffmm DIFF LM under torch.compile
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import diffmm
from diffmm.hub.difflama import save_difflama
from diffmm.models.lm import DiffLM, LMConfig

DIFF = "diffmm DIFF LM"
HF_DIFF = "HF DiffLlama"
HF_LLAMA = "HF Llama"
TWIN = "diffmm Transformer"
COMPILED = "diffmm DIFF LM (compile)"


def environment() -> dict:
    """CPU model (/proc/cpuinfo), torch version, threads and the 1-minute load average now."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return {"cpu": model.group(1) if model else platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_1m_start": os.getloadavg()[0]}


def build_models(args, folder: Path) -> dict[str, torch.nn.Module]:
    from transformers import DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_embd=args.width,
                   n_head=2 * args.heads, attention="diff", tie_embeddings=False)
    save_difflama(DiffLM(cfg), folder / "difflama")
    models = {DIFF: diffmm.load_pretrained(folder / "difflama")}
    hf_diff = DiffLlamaForCausalLM.from_pretrained(folder / "difflama", attn_implementation=args.hf_attn)
    models[HF_DIFF] = hf_diff
    # HF Llama of equal size with the same non-lambda weights: the DiffLlama state dict minus its lambdas.
    hf_cfg = hf_diff.config
    llama_cfg = LlamaConfig(vocab_size=hf_cfg.vocab_size, hidden_size=hf_cfg.hidden_size,
                            intermediate_size=hf_cfg.intermediate_size, num_hidden_layers=hf_cfg.num_hidden_layers,
                            num_attention_heads=hf_cfg.num_attention_heads,
                            num_key_value_heads=hf_cfg.num_key_value_heads, head_dim=hf_cfg.head_dim,
                            max_position_embeddings=hf_cfg.max_position_embeddings, rms_norm_eps=hf_cfg.rms_norm_eps,
                            rope_theta=getattr(hf_cfg, "rope_theta", 10000.0), tie_word_embeddings=False,
                            attention_bias=False, mlp_bias=False)
    llama = LlamaForCausalLM(llama_cfg)
    sd = {k: v for k, v in hf_diff.state_dict().items() if ".lambda_" not in k}
    llama.load_state_dict(sd, strict=True)
    llama.save_pretrained(folder / "llama")
    models[HF_LLAMA] = LlamaForCausalLM.from_pretrained(folder / "llama", attn_implementation=args.hf_attn)
    if args.with_twin:
        twin = DiffLM(LMConfig(**{**cfg.to_dict(), "attention": "standard"}))
        twin_sd = twin.state_dict()
        src = models[DIFF].state_dict()
        twin.load_state_dict({k: src[k] if k in src and src[k].shape == v.shape else v for k, v in twin_sd.items()})
        models[TWIN] = twin
    if args.compile:
        models[COMPILED] = diffmm.load_pretrained(folder / "difflama")
    return models


class Runner:
    """One model with its optimizer and a step closure."""

    def __init__(self, name: str, model: torch.nn.Module, compile_model: bool):
        self.name, self.model = name, model.train()
        self.is_hf = not isinstance(model, DiffLM)
        self.fwd = torch.compile(model) if compile_model else model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), weight_decay=0.05)

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        logits = self.fwd(input_ids=idx).logits if self.is_hf else self.fwd(idx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def warmed_up(args) -> tuple[list[Runner], dict, tuple]:
    """The runners (``--only``) after ``--warmup`` steps each (and compiles), the seconds those took, and the
    one training batch every model sees: inputs and next-token targets, (batch, seq) each."""
    with tempfile.TemporaryDirectory(prefix="bench_lm_") as tmp:
        models = build_models(args, Path(tmp))
    keep = [s.strip() for s in args.only.split(",") if s.strip()]
    runners = [Runner(n, m, n == COMPILED) for n, m in models.items() if not keep or n in keep]
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    data = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    warm = {}
    for r in runners:
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            r.step(*data)
        warm[r.name] = time.perf_counter() - t0
        print(f"  warm-up {r.name}: {warm[r.name]:.1f} s "
              f"({sum(p.numel() for p in r.model.parameters()) / 1e6:.1f}M params)", flush=True)
    return runners, warm, data


def run(args) -> dict:
    env = environment()
    runners, warm, data = warmed_up(args)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    loads = []
    for rnd in range(args.rounds):
        order = runners if rnd % 2 == 0 else runners[::-1]  # alternate the order: no model always runs first
        for r in order:
            t0 = clock()
            for _ in range(args.iters):
                r.step(*data)
            times[r.name].append((clock() - t0) / args.iters)
        loads.append(os.getloadavg()[0])
        print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()) +
              f" (load {loads[-1]:.1f})", flush=True)
    tokens = args.batch * args.seq
    med = {n: statistics.median(t) for n, t in times.items()}
    rows = []
    for r in runners:
        n = r.name
        rows.append(dict(model=n, params_m=sum(p.numel() for p in r.model.parameters()) / 1e6, sec_per_step=med[n],
                         tokens_per_s=tokens / med[n], warmup_s=warm[n],
                         speed_vs_difflama=med[HF_DIFF] / med[n] if HF_DIFF in med else None,
                         speed_vs_llama=med[HF_LLAMA] / med[n] if HF_LLAMA in med else None, all_s=times[n]))
    return {**env, "load_1m_end": os.getloadavg()[0], "batch": args.batch, "seq": args.seq, "layers": args.layers,
            "width": args.width, "diff_heads": args.heads, "vocab": args.vocab, "hf_attn": args.hf_attn,
            "clock": "thread_cpu" if args.cpu_time else "wall", "loadavg_1m": [min(loads), max(loads)], "rows": rows}


def profile_steps(args) -> int:
    """torch.profiler table (top ``args.profile`` ops by self CPU time) of one training step per model."""
    args.warmup = max(1, args.warmup)
    runners, _, data = warmed_up(args)
    for r in runners:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            r.step(*data)
        print(f"\n### {r.name}: one training step (load {os.getloadavg()[0]:.1f})\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile, max_name_column_width=40))
    return 0


def table(res: dict) -> str:
    lines = [f"CPU ({res['cpu']}), fp32, {res['threads']} threads, torch {res['torch']}, LM {res['layers']} layers x "
             f"width {res['width']}, {res['diff_heads']} differential heads (standard: {2 * res['diff_heads']}), vocab "
             f"{res['vocab']}, batch {res['batch']} x {res['seq']}, fwd+bwd+AdamW; HF attention {res['hf_attn']}; "
             f"{res['clock']} clock, median of interleaved rounds; 1-min load {res['loadavg_1m'][0]:.1f}-"
             f"{res['loadavg_1m'][1]:.1f}", "",
             "| model | params (M) | s/step | tokens/s | speed vs HF DiffLlama | speed vs HF Llama | warm-up s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        ratios = [f"{r[k]:.2f}x" if r[k] is not None else "-" for k in ("speed_vs_difflama", "speed_vs_llama")]
        lines.append(f"| {r['model']} | {r['params_m']:.1f} | {r['sec_per_step']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{ratios[0]} | {ratios[1]} | {r['warmup_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8, help="differential heads (HF: 2x this many component heads)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=2, help="training steps per model per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads (0 = torch's default)")
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--cpu-time", action="store_true",
                   help="time with the main thread's CPU time (robust on a busy machine; meaningful with --threads 1)")
    p.add_argument("--with-twin", action="store_true", help="also time diffmm's standard-attention LM")
    p.add_argument("--compile", action="store_true", help="also time the DIFF LM under torch.compile")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="instead of timing, print torch.profiler's top K ops by self CPU time for one step of each")
    p.add_argument("--only", default="", help="comma-separated model names to keep (e.g. 'diffmm DIFF LM')")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        return profile_steps(args)
    res = run(args)
    print()
    print(table(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
