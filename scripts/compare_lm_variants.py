"""Tiny decoder LMs with standard, DIFF V1 and DIFF V2 attention on real text, equal steps, several seeds.

Corpus: the Python 3.11 documentation reST sources (Debian ``python3.11-doc``), split into train/val
pages by the data pipeline's hash rule, tokenized by a byte-level BPE trained on the train pages
(cached under ``--cache``). All variants of one seed see the same initialisation seed and the same
batches. Reported per variant (mean +- std over seeds):

- validation loss (fixed val windows) at the end,
- gradient-norm spikes: steps after warmup whose pre-clip grad norm exceeds ``k`` x the median of
  the previous ``window`` steps,
- top-1 attention logit: max |q . k| / sqrt(d) over layers, heads/maps and causal (query, key)
  pairs on val windows (DIFF paper Table 5),
- top-1 hidden state: max |h| over the residual stream after every block on the same windows.

    python scripts/compare_lm_variants.py                       # ~10 min of one core
    python scripts/compare_lm_variants.py --steps 50 --seeds 0  # smoke run

Ablation knobs for DIFF V1 (defaults = the library's defaults, i.e. no change): ``--lambda-init``,
``--lambda-std``, ``--lambda-lr-mult`` (lr multiplier of the lambda vectors), ``--v1-out-init-scale`` and
``--v1-v-init-scale`` (multiply V1's attention ``out_proj`` / ``v_proj`` init weights after the usual init,
so the random draws stay the same). V1 runs also record lambda per layer (``lambda_trace``).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import statistics
import sys
import time

import torch

from diffmm.models.lm import DiffLM, LMConfig

VARIANTS = ("standard", "diff", "diff_v2")
PYDOC_SOURCES = "/usr/share/doc/python3.11/html/_sources"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "diffmm", "compare_lm")


# ------------------------------------------------------------------------------------------ data
def _is_val(rel_path: str) -> bool:
    try:  # the data pipeline's split rule, when present
        from diffmm.data.demo_text import is_val
        return is_val(rel_path)
    except ImportError:
        return int(hashlib.sha1(rel_path.encode("utf-8")).hexdigest(), 16) % 20 == 0


def load_corpus(source: str, cache: str, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int, str]:
    """Train and val token streams (int32), vocab size and tokenizer description; cached in ``cache``."""
    os.makedirs(cache, exist_ok=True)
    name = f"pydocs-bpe{vocab_size}"
    tag = os.path.join(cache, name)
    if os.path.exists(tag + ".pt"):
        d = torch.load(tag + ".pt", weights_only=True)
        return d["train"], d["val"], int(d["vocab_size"]), f"byte-level BPE {vocab_size} (cached <cache>/{name}.pt)"
    files = sorted(glob.glob(os.path.join(source, "**", "*.txt"), recursive=True))
    if not files:
        raise SystemExit(f"{source}: no .txt reST sources found; install Debian python3.11-doc "
                         f"(apt-get install python3.11-doc) or pass --source")
    docs = {"train": [], "val": []}
    for p in files:
        with open(p, encoding="utf-8", errors="replace") as f:
            docs["val" if _is_val(os.path.relpath(p, source)) else "train"].append(f.read())
    from diffmm.data.tokenizers import train_byte_level_bpe
    tok = train_byte_level_bpe(iter(docs["train"]), tag + ".tokenizer.json", vocab_size=vocab_size)
    raw = tok._load()
    streams = {}
    for split, texts in docs.items():
        ids = []
        for enc in raw.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(tok.eos_id)
        streams[split] = torch.tensor(ids, dtype=torch.int32)
    torch.save({"train": streams["train"], "val": streams["val"], "vocab_size": tok.vocab_size}, tag + ".pt")
    print(f"# corpus: {len(docs['train'])} train / {len(docs['val'])} val pages, "
          f"{len(streams['train']):,} / {len(streams['val']):,} tokens", flush=True)
    return streams["train"], streams["val"], tok.vocab_size, f"byte-level BPE {vocab_size} (<cache>/{name}.tokenizer.json)"


def windows(stream: torch.Tensor, starts: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([stream[s:s + T + 1] for s in starts.tolist()]).long()  # (B, T+1)
    return rows[:, :-1], rows[:, 1:]


# ------------------------------------------------------------------------------------- outliers
def _kv_index(attn, n_q: int, n_k: int) -> list[int]:
    """Key/value head read by each query map of ``attn`` (layout of its class)."""
    if hasattr(attn, "lambda_q1"):  # DIFF V1: head i, component c -> key 2 * (i // (h / h_kv)) + c
        r = attn.num_heads // attn.num_kv_heads
        return [2 * ((j // 2) // r) + j % 2 for j in range(n_q)]
    return [j // (n_q // n_k) for j in range(n_q)]  # standard and V2: plain GQA groups


@torch.no_grad()
def outliers(model: DiffLM, idx: torch.Tensor) -> tuple[float, float]:
    """(top-1 |attention logit|, top-1 |hidden state|) of ``model`` on ``idx`` (B, T)."""
    top_logit, top_hidden, inputs = 0.0, 0.0, {}
    hooks = [b.attn.register_forward_hook(lambda m, args, kw, out, i=i: inputs.__setitem__(i, (args[0], kw["rope"])),
                                          with_kwargs=True) for i, b in enumerate(model.blocks)]
    hooks += [b.register_forward_hook(lambda m, args, out: hidden.append(out.abs().max().item()))
              for b in model.blocks]
    hidden: list[float] = []
    try:
        model.forward_hidden(idx)
    finally:
        for hk in hooks:
            hk.remove()
    from diffmm.nn import apply_rope
    T = idx.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i, b in enumerate(model.blocks):
        x, rope = inputs[i]
        a, d = b.attn, b.attn.head_dim
        q = apply_rope(a.q_proj(x).view(*x.shape[:2], -1, d), *rope)  # (B, T, n_q, d)
        k = apply_rope(a.k_proj(x).view(*x.shape[:2], -1, d), *rope)  # (B, T, n_k, d)
        kk = k[:, :, _kv_index(a, q.shape[2], k.shape[2])]  # (B, T, n_q, d)
        logits = torch.einsum("bnhd,bshd->bhns", q, kk) * d ** -0.5  # (B, n_q, T, T)
        top_logit = max(top_logit, logits.abs().masked_fill(~causal, 0).max().item())
    return top_logit, max(hidden)


# ---------------------------------------------------------------------------------------- train
def lr_at(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def run(variant: str, seed: int, train: torch.Tensor, val: torch.Tensor, vocab: int, a) -> dict:
    torch.manual_seed(seed)
    cfg = LMConfig(vocab_size=vocab, block_size=a.seq, n_layer=a.layers, n_embd=a.dim, n_head=a.heads,
                   n_kv_head=a.kv_heads, attention=variant, lambda_init=a.lambda_init, lambda_std=a.lambda_std)
    model = DiffLM(cfg)
    if variant == "diff":  # V1-only init ablations: rescale after the usual init (same random draws)
        with torch.no_grad():
            for b in model.blocks:
                b.attn.out_proj.weight.mul_(a.v1_out_init_scale)
                b.attn.v_proj.weight.mul_(a.v1_v_init_scale)
    named = list(model.named_parameters())
    lambdas = [p for n, p in named if n.rsplit(".", 1)[-1].startswith("lambda_")]
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2 and not n.rsplit(".", 1)[-1].startswith("lambda_")]
    groups = [{"params": decay, "weight_decay": a.wd, "lr_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0}]
    if lambdas:  # 1-D like the norms: no weight decay
        groups.append({"params": lambdas, "weight_decay": 0.0, "lr_mult": a.lambda_lr_mult})
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.98), eps=1e-8)
    lam_layers = [b.attn for b in model.blocks if hasattr(b.attn, "lambda_full")]
    lambda_trace = []  # (step, [lambda per layer]) every 25 steps and at the end
    g = torch.Generator().manual_seed(1000 + seed)  # same batches for every variant of this seed
    vg = torch.Generator().manual_seed(12345)  # same val windows for every run
    val_starts = torch.randint(0, len(val) - a.seq - 1, (a.val_batches, a.batch), generator=vg)
    norms, losses, t0 = [], [], time.perf_counter()
    spikes, spike_steps = 0, []
    for step in range(a.steps):
        x, y = windows(train, torch.randint(0, len(train) - a.seq - 1, (a.batch,), generator=g), a.seq)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a) * group["lr_mult"]
        if lam_layers and step % 25 == 0:
            with torch.no_grad():
                lambda_trace.append((step, [round(m.lambda_full().item(), 4) for m in lam_layers]))
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip if a.clip > 0 else float("inf")).item()
        if step >= a.warmup and len(norms) >= a.window and gn > a.spike_k * statistics.median(norms[-a.window:]):
            spikes += 1
            spike_steps.append(step)
        norms.append(gn)
        losses.append(loss.item())
        opt.step()
        if not math.isfinite(loss.item()):
            break
    model.eval()
    if lam_layers:
        with torch.no_grad():
            lambda_trace.append((a.steps, [round(m.lambda_full().item(), 4) for m in lam_layers]))
    with torch.no_grad():
        vl = [model(*windows(val, s, a.seq))[1].item() for s in val_starts]
    top_logit, top_hidden = outliers(model, windows(val, val_starts[0], a.seq)[0])
    return dict(variant=variant, seed=seed, params=model.param_report()["non_embedding"],
                val_loss=statistics.mean(vl), train_loss_last=statistics.mean(losses[-20:]), spikes=int(spikes),
                max_grad_norm=max(norms), top_attn_logit=top_logit, top_hidden=top_hidden,
                seconds=time.perf_counter() - t0, spike_steps=spike_steps, lambda_trace=lambda_trace)


def summarize(results: list[dict]) -> str:
    keys = [("val_loss", "{:.4f}"), ("spikes", "{:.1f}"), ("max_grad_norm", "{:.2f}"), ("top_attn_logit", "{:.2f}"),
            ("top_hidden", "{:.2f}"), ("seconds", "{:.0f}")]
    lines = ["| attention | non-emb params | " + " | ".join(k for k, _ in keys) + " |",
             "|---|---:|" + "---:|" * len(keys)]
    for v in VARIANTS:
        rs = [r for r in results if r["variant"] == v]
        if not rs:
            continue
        cells = []
        for k, f in keys:
            vals = [float(r[k]) for r in rs]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f.format(statistics.mean(vals)) + " +- " + f.format(sd))
        lines.append(f"| {v} | {rs[0]['params']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _lambda_init(s: str):
    return s if s in ("depth", "constant") else float(s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", default=PYDOC_SOURCES)
    p.add_argument("--cache", default=DEFAULT_CACHE,
                   help="where the trained tokenizer and token streams are kept (recorded as <cache> in the JSON)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="standard heads (V1 gets half, V2 the same with 2x queries)")
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--clip", type=float, default=1.0, help="grad-norm clip (0 = none); spikes use the pre-clip norm")
    p.add_argument("--spike-k", type=float, default=2.0)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lambda-init", type=_lambda_init, default="depth",
                   help="V1 lambda_init: 'depth' (paper), 'constant' (0.8) or a number")
    p.add_argument("--lambda-std", type=float, default=0.1, help="V1: std of the normal init of the lambda vectors")
    p.add_argument("--lambda-lr-mult", type=float, default=1.0, help="V1: lr multiplier of the lambda vectors")
    p.add_argument("--v1-out-init-scale", type=float, default=1.0,
                   help="ablation, V1 only: multiply the attention out_proj init weights by this")
    p.add_argument("--v1-v-init-scale", type=float, default=1.0,
                   help="ablation, V1 only: multiply the attention v_proj init weights by this")
    p.add_argument("--json", default=None, help="write every run's numbers here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    train, val, vocab, tok_desc = load_corpus(a.source, a.cache, a.vocab)
    print(f"# {tok_desc}; train {len(train):,} / val {len(val):,} tokens; E={a.dim} L={a.layers} "
          f"heads={a.heads} T={a.seq} B={a.batch} steps={a.steps} lr={a.lr} warmup={a.warmup} clip={a.clip} "
          f"spike: > {a.spike_k} x median of previous {a.window}; threads={a.threads}; V1: lambda_init="
          f"{a.lambda_init} lambda_std={a.lambda_std} lambda_lr_mult={a.lambda_lr_mult} out_init_scale="
          f"{a.v1_out_init_scale} v_init_scale={a.v1_v_init_scale}", flush=True)
    results = []
    for seed in a.seeds:
        for v in a.variants:
            r = run(v, seed, train, val, vocab, a)
            results.append(r)
            print(f"  seed {seed} {v:<8}: val {r['val_loss']:.4f}  spikes {r['spikes']}  max|g| "
                  f"{r['max_grad_norm']:.2f}  top logit {r['top_attn_logit']:.2f}  top hidden "
                  f"{r['top_hidden']:.2f}  ({r['seconds']:.0f} s)"
                  + (f"  lambda {r['lambda_trace'][-1][1]}" if r["lambda_trace"] else ""), flush=True)
    print("\n" + summarize(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {**vars(a), "cache": "<cache>"}, "results": results,
                       "corpus": {"tokenizer": tok_desc, "train_tokens": len(train), "val_tokens": len(val)}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
