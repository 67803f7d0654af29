"""Training throughput of the DIFF LM against HF DiffLlama and HF Llama of equal size, in one process.

A random DIFF LM is written as an HF DiffLlama folder (``diffmm.hub.difflama.save_difflama``); then the same
weights are loaded three ways:

- ``diffmm DIFF LM``: ``diffmm.load_pretrained(folder)`` (the DiffLlama format loader);
- ``HF DiffLlama``: ``DiffLlamaForCausalLM.from_pretrained(folder)`` (``--hf-attn``, default sdpa);
- ``HF Llama``: ``LlamaForCausalLM.from_pretrained(folder)``: the same shape (2h heads of dim d) with the same
  projection, MLP, norm and embedding weights (the lambdas have no place in it: reported as unused);
- ``diffmm DIFF LM (logits + F.cross_entropy)`` (``--with-logits``): the DIFF LM without its fused head loss;
- ``diffmm Transformer`` (``--with-twin``): diffmm's standard-attention LM of the same shape (2h heads of dim d),
  holding the DIFF LM's tensors (a timing twin: same shapes and work, not the same function).

One training step = forward, mean next-token cross entropy, backward, AdamW step (same optimizer settings for
every model). ``--loss model`` (default) takes each model's own training loss: HF's ``labels=`` path (logits, then
``ForCausalLMLoss``), diffmm's ``model(idx, targets, return_logits=False)`` (head and loss fused by chunks,
``diffmm.ops.linear_cross_entropy``); ``--loss outside`` has every model return logits and the script computes the
same ``F.cross_entropy`` for all. Models are timed in interleaved rounds (peers and ours back to back; the order
alternates); the speeds are the median and range of the per-round ratios peer / ours, so machine noise hits all of
them alike; the 1-minute load average is printed beside the table. The JSON records the CPU model, torch version,
threads and the 1-minute load average at start and end.

    PYTHONPATH=. python scripts/bench_lm.py                          # 58M LM, batch 4 x 512, 2 threads
    PYTHONPATH=. python scripts/bench_lm.py --rounds 9 --json results/bench_lm.json
    PYTHONPATH=. python scripts/bench_lm.py --compile                # also diffmm DIFF LM under torch.compile
    PYTHONPATH=. python scripts/bench_lm.py --loss outside           # one loss formula for all (logits out)
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

import diffmm
from bench_common import (Runner, add_timing_args, environment, interleaved_rounds, paired, print_profile, warm_up,
                          write_json)
from diffmm.hub.difflama import save_difflama
from diffmm.models.lm import DiffLM, LMConfig

DIFF = "diffmm DIFF LM"
HF_DIFF = "HF DiffLlama"
HF_LLAMA = "HF Llama"
TWIN = "diffmm Transformer"
COMPILED = "diffmm DIFF LM (compile)"
LOGITS = "diffmm DIFF LM (logits + F.cross_entropy)"
LOSS_NOTE = {"model": "each model's own (HF labels=, diffmm fused head)", "outside": "F.cross_entropy of the logits"}


def build_models(args, folder: Path) -> dict[str, torch.nn.Module]:
    from transformers import DiffLlamaForCausalLM, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=args.vocab, context_length=args.seq, layers=args.layers, width=args.width,
                   heads=2 * args.heads, attn_type="diff", tie_embeddings=False)
    save_difflama(DiffLM(cfg), folder / "difflama")
    models = {DIFF: diffmm.load_pretrained(folder / "difflama"),
              HF_DIFF: DiffLlamaForCausalLM.from_pretrained(folder / "difflama", attn_implementation=args.hf_attn),
              HF_LLAMA: LlamaForCausalLM.from_pretrained(folder / "difflama", attn_implementation=args.hf_attn)}
    if args.with_twin:
        twin = DiffLM(LMConfig(**{**cfg.to_dict(), "attn_type": "standard"}))
        twin_sd = twin.state_dict()
        src = models[DIFF].state_dict()
        twin.load_state_dict({k: src[k] if k in src and src[k].shape == v.shape else v for k, v in twin_sd.items()})
        models[TWIN] = twin
    if args.compile:
        models[COMPILED] = diffmm.load_pretrained(folder / "difflama")
    if args.with_logits:
        models[LOGITS] = diffmm.load_pretrained(folder / "difflama")
    return models


def next_token_loss(forward, is_hf: bool, own_loss: bool, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``forward`` (an HF causal LM or a diffmm ``DiffLM``, maybe compiled): the
    model's own training loss (``own_loss``) or ``F.cross_entropy`` of its logits."""
    if own_loss:  # targets are shifted already: HF takes them as shift_labels
        return forward(input_ids=idx, labels=targets, shift_labels=targets).loss if is_hf else \
            forward(idx, targets, return_logits=False)[1]
    logits = forward(input_ids=idx).logits if is_hf else forward(idx)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def runner(name: str, model: torch.nn.Module, own_loss: bool) -> Runner:
    """One model with its AdamW (the same settings for every model); ``COMPILED`` runs under torch.compile."""
    forward = torch.compile(model) if name == COMPILED else model
    loss = partial(next_token_loss, forward, not isinstance(model, DiffLM), own_loss)
    return Runner(name, model, loss, weight_decay=0.05)


def warmed_up(args) -> tuple[list[Runner], dict, dict]:
    """The runners (``--only``), their training steps on the one batch every model sees (inputs and next-token
    targets, (batch, seq) each) after ``--warmup`` calls each (and compiles), and the seconds those took."""
    with tempfile.TemporaryDirectory(prefix="bench_lm_") as tmp:
        models = build_models(args, Path(tmp))
    keep = [s.strip() for s in args.only.split(",") if s.strip()]
    runners = [runner(n, m, args.loss == "model" and n != LOGITS) for n, m in models.items() if not keep or n in keep]
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    data = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    steps = {r.name: partial(r.step, *data) for r in runners}
    warm = warm_up(steps, args.warmup)
    for r in runners:
        print(f"  warm-up {r.name}: {warm[r.name]:.1f} s ({r.params_m():.1f}M params)", flush=True)
    return runners, steps, warm


def run(args) -> dict:
    env = environment()
    runners, steps, warm = warmed_up(args)
    times, loads = interleaved_rounds(steps, args.rounds, args.iters, args.cpu_time)
    tokens = args.batch * args.seq
    med = {n: statistics.median(t) for n, t in times.items()}
    rows = []
    for r in runners:
        n = r.name
        rows.append(dict(model=n, params_m=r.params_m(), sec_per_step=med[n], tokens_per_s=tokens / med[n],
                         warmup_s=warm[n],
                         speed_vs_difflama=paired(times[HF_DIFF], times[n]) if HF_DIFF in med else None,
                         speed_vs_llama=paired(times[HF_LLAMA], times[n]) if HF_LLAMA in med else None, all_s=times[n]))
    return {**env, "load_1m_end": os.getloadavg()[0], "batch": args.batch, "seq": args.seq, "layers": args.layers,
            "width": args.width, "diff_heads": args.heads, "vocab": args.vocab, "hf_attn": args.hf_attn,
            "loss": args.loss, "clock": "thread_cpu" if args.cpu_time else "wall",
            "loadavg_1m": [min(loads), max(loads)], "rows": rows}


def profile_steps(args) -> int:
    """torch.profiler table (top ``args.profile`` ops by self CPU time) of one training step per model."""
    args.warmup = max(1, args.warmup)
    for name, step in warmed_up(args)[1].items():
        print_profile(f"{name}: one training step", step, args.profile)
    return 0


def table(res: dict) -> str:
    lines = [f"CPU ({res['cpu']}), fp32, {res['threads']} threads, torch {res['torch']}, LM {res['layers']} layers x "
             f"width {res['width']}, {res['diff_heads']} differential heads (standard: {2 * res['diff_heads']}), vocab "
             f"{res['vocab']}, batch {res['batch']} x {res['seq']}, fwd+bwd+AdamW; loss: {LOSS_NOTE[res['loss']]}; "
             f"HF attention {res['hf_attn']}; "
             f"{res['clock']} clock, {len(res['rows'][0]['all_s'])} interleaved rounds; speed = median [range] of the "
             f"per-round ratios peer / model; 1-min load {res['loadavg_1m'][0]:.1f}-{res['loadavg_1m'][1]:.1f}", "",
             "| model | params (M) | s/step | tokens/s | speed vs HF DiffLlama | speed vs HF Llama | warm-up s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        ratios = [f"{r[k]['median']:.2f}x [{r[k]['min']:.2f}-{r[k]['max']:.2f}]" if r[k] else "-"
                  for k in ("speed_vs_difflama", "speed_vs_llama")]
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
    add_timing_args(p, rounds=7, iters=1, iters_help="training steps per model per round")
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--loss", default="model", choices=["model", "outside"],
                   help="each model's own training loss, or F.cross_entropy of every model's logits")
    p.add_argument("--with-twin", action="store_true", help="also time diffmm's standard-attention LM")
    p.add_argument("--compile", action="store_true", help="also time the DIFF LM under torch.compile")
    p.add_argument("--with-logits", action="store_true",
                   help="also time the DIFF LM returning logits, with F.cross_entropy outside (no fused head loss)")
    p.add_argument("--only", default="", help="comma-separated model names to keep (e.g. 'diffmm DIFF LM')")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        return profile_steps(args)
    res = run(args)
    print()
    print(table(res))
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
