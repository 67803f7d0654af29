"""Is the data loader the bottleneck? Loader throughput next to the tiny CPU models' training step throughput.

Prints one table:
* image-text loader samples/s (decode + open_clip-style train transform + CLIP BPE tokenize, in the
  workers) at 64 px and 224 px with 1 and 2 workers;
* text loader tokens/s (tokenize + pack) with 1 and 2 workers;
* training throughput (forward + backward + AdamW step, batch as given) of the tiny CPU configs:
  DiffCLIP-Tiny / CLIP-Tiny (``diffmm.create_model``) and the ``cpu-small`` DIFF / standard LMs
  (``diffmm.models.lm``). If those modules cannot be imported, a plain ``torch.nn`` stand-in is timed
  instead and the row says so.

Uses the demo shards under ``--data`` (``diffmm shards demo-all``) when present, otherwise writes
synthetic shards to a temporary folder.

Usage: python scripts/bench_data.py [--data data] [--samples 640] [--batch 64]
"""
from __future__ import annotations

import argparse
import glob
import io
import os
import tempfile
import time

import numpy as np
import torch
from PIL import Image


def synthetic_image_shards(directory: str, n: int = 1024) -> str:
    from diffmm.data.writer import ShardWriter

    rng = np.random.default_rng(0)
    with ShardWriter(directory, "bench", maxcount=256) as w:
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (109, 109, 3), dtype=np.uint8)).save(buf, "PNG")
            w.write(f"{i:06d}", {"png": buf.getvalue(), "txt": f"an emoji of a thing number {i}, red, round"})
    return w.pattern


def synthetic_text_shards(directory: str) -> tuple[str, object]:
    from diffmm.data.tokenizers import train_byte_level_bpe
    from diffmm.data.writer import ShardWriter

    words = "the of module function returns a value list python object class data".split()
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, 2000)) for _ in range(200)]
    with ShardWriter(directory, "text", maxcount=50) as w:
        for i, d in enumerate(docs):
            w.write(f"{i:06d}", {"txt": d})
    return w.pattern, train_byte_level_bpe(docs, os.path.join(directory, "tokenizer.json"), vocab_size=512)


def image_pattern(data: str, tmp: str) -> tuple[str, str]:
    shards = sorted(glob.glob(os.path.join(data, "emoji", "*", "*.tar")))
    if shards:
        return "::".join(shards), f"demo emoji shards ({len(shards)} shards)"
    return synthetic_image_shards(tmp), "synthetic 109 px PNG shards"


def bench_image_loader(pattern: str, image_size: int, workers: int, batch: int, samples: int) -> float:
    from diffmm.data.image_text import image_text_loader

    loader = image_text_loader(pattern, batch, num_workers=workers, image_size=image_size, train=True,
                               resampled=True, samples_per_epoch=samples + batch * (workers + 1), rank=0, world_size=1)
    it = iter(loader)
    for _ in range(workers):   # warm-up: worker start + first batch of each worker
        next(it)
    t, n = time.perf_counter(), 0
    for images, tokens in it:
        n += images.shape[0]
    return n / (time.perf_counter() - t)


def bench_text_loader(pattern: str, tokenizer, workers: int, batch: int, seq_len: int, rows: int) -> float:
    from diffmm.data.text import text_loader

    loader = text_loader(pattern, batch, seq_len, num_workers=workers, tokenizer=tokenizer, resampled=True,
                         samples_per_epoch=rows + batch * (workers + 1), rank=0, world_size=1)
    it = iter(loader)
    for _ in range(workers):
        next(it)
    t, n = time.perf_counter(), 0
    for b in it:
        n += b.numel()
    return n / (time.perf_counter() - t)


def _time_steps(step, steps: int = 5) -> float:
    step()                      # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) / steps


def bench_clip_step(name: str, batch: int) -> tuple[str, float, int]:
    """(label, seconds per step, image size) for forward+backward+AdamW of a tiny CLIP."""
    import torch.nn.functional as F

    try:
        import diffmm

        model = diffmm.create_model(name)
        size = model.visual.image_size if hasattr(model.visual, "image_size") else 64
        size = size[0] if isinstance(size, (tuple, list)) else int(size)
        ctx = getattr(model, "context_length", 32)
        label = f"train step {name} ({size} px)"

        def forward(images, text):
            return model.encode_image(images, normalize=True), model.encode_text(text, normalize=True)
    except Exception as e:  # the model package is not there (yet): a labelled stand-in
        size, ctx = 64, 32
        label = f"train step STAND-IN torch.nn conv+embedding model, not {name} ({type(e).__name__})"
        vis = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 8, 8), torch.nn.Flatten(), torch.nn.Linear(64 * 64, 128))
        txt = torch.nn.EmbeddingBag(49408, 128)
        model = torch.nn.ModuleList([vis, txt])

        def forward(images, text):
            return F.normalize(vis(images), dim=-1), F.normalize(txt(text), dim=-1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images = torch.randn(batch, 3, size, size)
    text = torch.randint(1, 49407, (batch, ctx))

    def step():
        a, b = forward(images, text)
        logits = 100 * a @ b.t()
        labels = torch.arange(batch)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()

    return label, _time_steps(step), size


def bench_lm_step(attention: str, batch: int, seq_len: int) -> tuple[str, float]:
    try:
        from diffmm.models.lm import DiffLM, LMConfig

        preset = {"diff": "diff-cpu-small", "standard": "transformer-cpu-small"}[attention]
        cfg = LMConfig.from_name(preset)
        model, vocab, seq_len = DiffLM(cfg), cfg.vocab_size, min(seq_len, cfg.block_size)
        label = f"train step LM {preset} (seq {seq_len})"

        def loss_fn(x, y):
            out = model(x, y)
            return out[1] if isinstance(out, tuple) else out.loss
    except Exception as e:
        vocab = 4096
        label = f"train step STAND-IN torch.nn embedding+linear LM, not cpu-small {attention} ({type(e).__name__})"
        model = torch.nn.Sequential(torch.nn.Embedding(vocab, 192), torch.nn.Linear(192, vocab))

        def loss_fn(x, y):
            return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, vocab, (batch, seq_len))
    y = torch.randint(0, vocab, (batch, seq_len))

    def step():
        loss = loss_fn(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return label, _time_steps(step), seq_len


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data", help="folder with the demo shards (default: data)")
    p.add_argument("--batch", type=int, default=64, help="image-text batch size")
    p.add_argument("--samples", type=int, default=640, help="samples timed per image loader row")
    p.add_argument("--text-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--text-rows", type=int, default=320, help="rows timed per text loader row")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        pattern, source = image_pattern(args.data, tmp)
        for size in (64, 224):
            for workers in (1, 2):
                sps = bench_image_loader(pattern, size, workers, args.batch, args.samples)
                rows.append((f"image-text loader {size} px, {workers} worker(s)", f"{sps:,.0f} samples/s", source))
        text_shards = sorted(glob.glob(os.path.join(args.data, "python-docs", "train", "*.tar")))
        tok_path = os.path.join(args.data, "python-docs", "tokenizer.json")
        if text_shards and os.path.exists(tok_path):
            from diffmm.data.tokenizers import TokenizerFile

            tpattern, tok, tsource = "::".join(text_shards), TokenizerFile(tok_path), "demo python-docs + its BPE"
        else:
            (tpattern, tok), tsource = synthetic_text_shards(os.path.join(tmp, "text")), "synthetic text + BPE"
        for workers in (1, 2):
            tps = bench_text_loader(tpattern, tok, workers, args.text_batch, args.seq_len, args.text_rows)
            rows.append((f"text loader seq {args.seq_len}, {workers} worker(s)", f"{tps:,.0f} tokens/s", tsource))
    for name in ("DiffCLIP-Tiny", "CLIP-Tiny"):
        label, sec, size = bench_clip_step(name, args.batch)
        rows.append((label, f"{args.batch / sec:,.0f} samples/s", f"batch {args.batch}, {sec * 1000:.0f} ms/step"))
    for attention in ("diff", "standard"):
        label, sec, seq = bench_lm_step(attention, args.text_batch, args.seq_len)
        rows.append((label, f"{args.text_batch * seq / sec:,.0f} tokens/s",
                     f"batch {args.text_batch}, {sec * 1000:.0f} ms/step"))
    w = max(len(r[0]) for r in rows)
    print(f"torch threads: {torch.get_num_threads()}, cpus: {os.cpu_count()}")
    print(f"| {'what':<{w}} | {'throughput':>18} | notes")
    print(f"|{'-' * (w + 2)}|{'-' * 20}|------")
    for what, rate, note in rows:
        print(f"| {what:<{w}} | {rate:>18} | {note}")


if __name__ == "__main__":
    main()
