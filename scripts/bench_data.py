"""Is the data loader the bottleneck? Loader throughput next to the tiny CPU models' training step throughput.

Prints one table:
* image-text loader samples/s (decode + open_clip-style train transform + CLIP BPE tokenize, in the
  workers) at 64 px and 224 px with 1 and 2 workers;
* text loader tokens/s (tokenize + pack) with 1 and 2 workers;
* training throughput (forward + backward + AdamW step, batch as given) of the tiny CPU configs:
  DiffCLIP-Tiny / CLIP-Tiny (``diffmm.create_model``) and the ``cpu-small`` DIFF / standard LMs
  (``diffmm.models.lm``).

Uses the demo shards under ``--data`` (``python -m diffmm_demo data all``) when present, otherwise writes
synthetic shards to a temporary folder. The header names the CPU model, torch version, threads and the
1-minute load average at start and end.

Usage: PYTHONPATH=. python scripts/bench_data.py [--data data] [--samples 640] [--batch 64]
"""
from __future__ import annotations

import argparse
import glob
import io
import os
import tempfile
import time
from functools import partial
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

import diffmm
from bench_common import Runner, contrastive_loss, environment, warm_up
from diffmm.data.image_text import image_text_loader
from diffmm.data.text import text_loader
from diffmm.data.tokenizers import TokenizerFile, train_byte_level_bpe
from diffmm.data.writer import ShardWriter
from diffmm.models.lm import DiffLM, LMConfig


def synthetic_image_shards(directory: str, n: int = 1024) -> str:
    rng = np.random.default_rng(0)
    with ShardWriter(directory, "bench", maxcount=256) as w:
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (109, 109, 3), dtype=np.uint8)).save(buf, "PNG")
            w.write(f"{i:06d}", {"png": buf.getvalue(), "txt": f"an emoji of a thing number {i}, red, round"})
    return w.pattern


def synthetic_text_shards(directory: str) -> tuple[str, object]:
    words = "the of module function returns a value list python object class data".split()
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, 2000)) for _ in range(200)]
    with ShardWriter(directory, "text", maxcount=50) as w:
        for i, d in enumerate(docs):
            w.write(f"{i:06d}", {"txt": d})
    return w.pattern, train_byte_level_bpe(docs, os.path.join(directory, "tokenizer.json"), vocab_size=512)


def loader_rate(loader, workers: int, count: Callable[[Any], int]) -> float:
    """Items per second of ``loader`` (``count(batch)`` items per batch), after the first batch of each worker."""
    it = iter(loader)
    for _ in range(workers):  # warm-up: worker start + first batch of each worker
        next(it)
    t, n = time.perf_counter(), 0
    for batch in it:
        n += count(batch)
    return n / (time.perf_counter() - t)


def bench_image_loader(pattern: str, image_size: int, workers: int, batch: int, samples: int) -> float:
    loader = image_text_loader(pattern, batch, num_workers=workers, image_size=image_size, train=True,
                               resampled=True, samples_per_epoch=samples + batch * (workers + 1), rank=0, world_size=1)
    return loader_rate(loader, workers, lambda b: b[0].shape[0])


def bench_text_loader(pattern: str, tokenizer, workers: int, batch: int, seq_len: int, rows: int) -> float:
    loader = text_loader(pattern, batch, seq_len, num_workers=workers, tokenizer=tokenizer, resampled=True,
                         samples_per_epoch=rows + batch * (workers + 1), rank=0, world_size=1)
    return loader_rate(loader, workers, torch.Tensor.numel)


def step_seconds(runner: Runner, batch: tuple, steps: int = 5) -> float:
    """Seconds per training step (forward + backward + AdamW) of ``runner`` on ``batch``, after one warm-up step."""
    step = {runner.name: partial(runner.step, *batch)}
    warm_up(step, 1)
    return warm_up(step, steps)[runner.name] / steps


def bench_clip_step(name: str, batch: int) -> tuple[str, float]:
    """(label, seconds per step) of a tiny CLIP on random images and captions (symmetric InfoNCE)."""
    model = diffmm.create_model(name)
    v, t = model.config.vision_cfg, model.config.text_cfg
    images = torch.randn(batch, 3, v.image_size, v.image_size)
    text = torch.randint(1, t.vocab_size - 1, (batch, t.context_length))
    runner = Runner(name, model, partial(contrastive_loss, model.encode_image, model.encode_text), weight_decay=0.01)
    return f"train step {name} ({v.image_size} px)", step_seconds(runner, (images, text))


def bench_lm_step(attention: str, batch: int, seq_len: int) -> tuple[str, float, int]:
    """(label, seconds per step, sequence length) of a ``cpu-small`` LM on random tokens."""
    preset = {"diff": "diff-cpu-small", "standard": "transformer-cpu-small"}[attention]
    cfg = LMConfig.from_name(preset)
    model, seq_len = DiffLM(cfg), min(seq_len, cfg.block_size)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    y = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    runner = Runner(preset, model, lambda inputs, targets: model(inputs, targets)[1], weight_decay=0.01)
    return f"train step LM {preset} (seq {seq_len})", step_seconds(runner, (x, y)), seq_len


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
    env = environment()
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = sorted(glob.glob(os.path.join(args.data, "emoji", "*", "*.tar")))
        if shards:
            pattern, source = "::".join(shards), f"demo emoji shards ({len(shards)} shards)"
        else:
            pattern, source = synthetic_image_shards(tmp), "synthetic 109 px PNG shards"
        for size in (64, 224):
            for workers in (1, 2):
                sps = bench_image_loader(pattern, size, workers, args.batch, args.samples)
                rows.append((f"image-text loader {size} px, {workers} worker(s)", f"{sps:,.0f} samples/s", source))
        text_shards = sorted(glob.glob(os.path.join(args.data, "python-docs", "train", "*.tar")))
        tok_path = os.path.join(args.data, "python-docs", "tokenizer.json")
        if text_shards and os.path.exists(tok_path):
            tpattern, tok, tsource = "::".join(text_shards), TokenizerFile(tok_path), "demo python-docs + its BPE"
        else:
            (tpattern, tok), tsource = synthetic_text_shards(os.path.join(tmp, "text")), "synthetic text + BPE"
        for workers in (1, 2):
            tps = bench_text_loader(tpattern, tok, workers, args.text_batch, args.seq_len, args.text_rows)
            rows.append((f"text loader seq {args.seq_len}, {workers} worker(s)", f"{tps:,.0f} tokens/s", tsource))
    for name in ("DiffCLIP-Tiny", "CLIP-Tiny"):
        label, sec = bench_clip_step(name, args.batch)
        rows.append((label, f"{args.batch / sec:,.0f} samples/s", f"batch {args.batch}, {sec * 1000:.0f} ms/step"))
    for attention in ("diff", "standard"):
        label, sec, seq = bench_lm_step(attention, args.text_batch, args.seq_len)
        rows.append((label, f"{args.text_batch * seq / sec:,.0f} tokens/s",
                     f"batch {args.text_batch}, {sec * 1000:.0f} ms/step"))
    w = max(len(r[0]) for r in rows)
    print(f"CPU {env['cpu']} ({os.cpu_count()} cpus), torch {env['torch']}, torch threads: {env['threads']}; 1-min "
          f"load {env['load_1m_start']:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print(f"| {'what':<{w}} | {'throughput':>18} | notes")
    print(f"|{'-' * (w + 2)}|{'-' * 20}|------")
    for what, rate, note in rows:
        print(f"| {what:<{w}} | {rate:>18} | {note}")


if __name__ == "__main__":
    main()
