"""Train a tiny DIFF LM and its standard-attention twin with a plain PyTorch loop (no Lightning).

Data: the Python 3.11 documentation reST sources (Debian ``python3.11-doc``; ``apt-get install
python3.11-doc``), split into train/val pages by ``diffmm.data.demo_text.is_val`` (a hash of the
path, ~1 page in 20 to val), tokenised with a byte-level BPE trained locally on the train pages
(``diffmm.data.tokenizers.train_byte_level_bpe``). The pages are read and packed into one token
stream per split here (pages joined by the end-of-text token); batches are random windows of
``seq_len + 1`` tokens, the same windows for both models.

Both models see the same batches in the same order, one step each in turn, so the loss curves are
printed side by side. Recipe (SPEC section 2, scaled down): AdamW betas (0.9, 0.98), weight decay
0.05 on matrices only, linear warmup then cosine decay to 10%, gradient clipping at 1.0.

    python scripts/train_lm_plain.py                  # ~4 layers, width 128, seq 128, 300 steps
    python scripts/train_lm_plain.py --steps 50 --eval-every 25   # quick smoke run
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from diffmm.models.lm import DiffLM, LMConfig

PYDOC_SOURCES = "/usr/share/doc/python3.11/html/_sources"


# ------------------------------------------------------------------------------------------ data
def read_pages(source: str) -> dict[str, list[str]]:
    """Train/val lists of page texts under ``source`` (``*.txt`` reST sources)."""
    from diffmm.data.demo_text import is_val

    files = sorted(Path(source).rglob("*.txt"))
    if not files:
        raise SystemExit(f"{source}: no reST sources; install them with `apt-get install python3.11-doc`")
    pages: dict[str, list[str]] = {"train": [], "val": []}
    for f in files:
        pages["val" if is_val(str(f.relative_to(source))) else "train"].append(f.read_text("utf-8", errors="replace"))
    return pages


def build_corpus(source: str, out: Path, vocab_size: int) -> tuple[dict[str, torch.Tensor], object]:
    """Token streams per split (int32) and the tokenizer; both cached in ``out``."""
    from diffmm.data.tokenizers import TokenizerFile, train_byte_level_bpe

    tok_path, cache = out / f"bpe{vocab_size}.json", out / f"pydocs-bpe{vocab_size}.pt"
    if tok_path.is_file() and cache.is_file():
        return torch.load(cache, weights_only=True), TokenizerFile(str(tok_path))
    pages = read_pages(source)
    t0 = time.perf_counter()
    tok = train_byte_level_bpe(pages["train"], str(tok_path), vocab_size=vocab_size)
    streams = {}
    for split, texts in pages.items():
        ids: list[int] = []
        for text in texts:
            ids.extend(tok.encode(text))
            ids.append(tok.eos_id)
        streams[split] = torch.tensor(ids, dtype=torch.int32)
    torch.save(streams, cache)
    print(f"# corpus {source}: {len(pages['train'])} train / {len(pages['val'])} val pages, "
          f"{len(streams['train']):,} / {len(streams['val']):,} tokens, BPE {tok.vocab_size} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    return streams, tok


def get_batch(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()]).long()  # (B, T+1)
    return rows[:, :-1], rows[:, 1:]


# -------------------------------------------------------------------------------------- training
def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine from lr to 0.1 * lr."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, args) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms, lambdas
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98), eps=1e-8)


@torch.no_grad()
def evaluate(model: DiffLM, stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> float:
    """Mean loss over fixed windows ``starts`` (n_batches, B)."""
    model.eval()
    losses = [model(*get_batch(stream, s, seq_len))[1].item() for s in starts]
    model.train()
    return sum(losses) / len(losses)


def _number_or_name(value: str):
    try:
        return float(value)
    except ValueError:
        return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", default=PYDOC_SOURCES, help="folder of reST/text sources")
    p.add_argument("--out", default="runs/lm_plain", help="tokenizer/corpus cache and results.json")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4, help="standard heads; the DIFF model gets half")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--models", default="diff,standard", help="comma-separated attention types")
    p.add_argument("--untie", action="store_true", help="separate LM head (default: tied to the token embedding)")
    p.add_argument("--lambda-init", default="depth", help="'depth' (paper), 'constant' (0.8) or a number")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    streams, tok = build_corpus(args.source, out, args.vocab_size)

    names = args.models.split(",")
    models, opts = {}, {}
    for name in names:
        torch.manual_seed(args.seed)
        cfg = LMConfig(vocab_size=tok.vocab_size, block_size=args.seq_len, n_layer=args.n_layer, n_embd=args.n_embd,
                       n_head=args.n_head, attention=name, tie_embeddings=not args.untie,
                       lambda_init=_number_or_name(args.lambda_init))
        models[name] = DiffLM(cfg).train()
        opts[name] = make_optimizer(models[name], args)
        rep = models[name].param_report()
        print(f"# {name:<9} params {rep['total']:,} (non-embedding {rep['non_embedding']:,}), "
              f"{cfg.n_head // (2 if name == 'diff' else 1)} heads of dim {cfg.head_dim}"
              f"{' x 2 components' if name == 'diff' else ''}", flush=True)

    g = torch.Generator().manual_seed(args.seed)
    hi = {s: len(streams[s]) - args.seq_len - 1 for s in streams}
    eval_g = torch.Generator().manual_seed(12345)
    eval_starts = {s: torch.randint(0, hi[s], (args.eval_batches, args.batch_size), generator=eval_g) for s in streams}
    header = f"{'step':>5} {'lr':>8} " + " ".join(f"{n + ' train':>14} {n + ' val':>12}" for n in names)
    print(header, flush=True)
    curve, run_loss, seconds = [], {n: 0.0 for n in names}, {n: 0.0 for n in names}
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            row = {"step": step, "lr": lr_at(min(step, args.steps - 1), args)}
            for n in names:
                k = args.eval_every if step else 1
                row[n] = {"train_avg": run_loss[n] / k if step else float("nan"),
                          "val": evaluate(models[n], streams["val"], eval_starts["val"], args.seq_len)}
                run_loss[n] = 0.0
            curve.append(row)
            print(f"{step:>5} {row['lr']:>8.2e} " + " ".join(f"{row[n]['train_avg']:>14.4f} {row[n]['val']:>12.4f}"
                                                            for n in names), flush=True)
        if step == args.steps:
            break
        x, y = get_batch(streams["train"], torch.randint(0, hi["train"], (args.batch_size,), generator=g), args.seq_len)
        for n in names:
            t0 = time.perf_counter()
            for group in opts[n].param_groups:
                group["lr"] = lr_at(step, args)
            _, loss = models[n](x, y)
            opts[n].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[n].parameters(), args.clip)
            opts[n].step()
            seconds[n] += time.perf_counter() - t0
            run_loss[n] += loss.item()

    tokens = args.steps * args.batch_size * args.seq_len
    final = {}
    print("\nfinal (mean loss over the same fixed windows; nats/token)")
    print(f"{'model':<10} {'train':>8} {'val':>8} {'tok/s':>8} {'s/step':>8}")
    for n in names:
        final[n] = {"train": evaluate(models[n], streams["train"], eval_starts["train"], args.seq_len),
                    "val": curve[-1][n]["val"], "tokens_per_s": tokens / seconds[n],
                    "s_per_step": seconds[n] / args.steps, "params": models[n].param_report()}
        print(f"{n:<10} {final[n]['train']:>8.4f} {final[n]['val']:>8.4f} {final[n]['tokens_per_s']:>8.0f} "
              f"{final[n]['s_per_step']:>8.3f}")
    prompt = torch.tensor([tok.encode("The Python")], dtype=torch.long)
    for n in names:
        ids = models[n].eval().generate(prompt, 40, top_k=20, generator=torch.Generator().manual_seed(0))
        print(f"\nsample ({n}, top_k=20): {tok.decode(ids[0].tolist())!r}")
    result = {"args": vars(args), "tokens_seen": tokens, "curve": curve, "final": final}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
