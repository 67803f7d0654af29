"""TEST-ONLY helpers of the training tests: a tiny stand-in CLIP with open_clip's interface and tiny shards.

``TinyCLIP`` is not a diffmm model: it exists so the training code can be tested independently of
``diffmm.models.clip`` (it has the same interface: ``encode_image``, ``encode_text``, ``logit_scale``,
``forward(image, text) -> (image_features, text_features, logit_scale.exp())``, ``visual.image_size``,
``context_length``), and one differential attention layer per tower so lambdas can be logged.
"""
from __future__ import annotations

import io
import json
import math
import os
import random

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from diffmm.data.writer import ShardWriter
from diffmm.nn import DiffAttention


class _Tower(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = DiffAttention(width, heads, lambda_init="constant", qkv_bias=True, proj_bias=True)

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        return x + self.attn(self.norm(x), causal=causal)


class _Visual(nn.Module):
    def __init__(self, image_size: int, patch: int, width: int, heads: int, embed_dim: int) -> None:
        super().__init__()
        self.image_size = (image_size, image_size)
        self.patch = nn.Conv2d(3, width, patch, patch)
        self.blocks = nn.ModuleList([_Tower(width, heads)])
        self.proj = nn.Parameter(torch.randn(width, embed_dim) * width ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, N, W)
        for b in self.blocks:
            x = b(x)
        return x.mean(1) @ self.proj


class TinyCLIP(nn.Module):
    """Stand-in CLIP (test-only). ``vocab_size`` defaults to the CLIP BPE's 49408."""

    def __init__(self, image_size: int = 16, patch: int = 8, width: int = 16, heads: int = 2, embed_dim: int = 16,
                 vocab_size: int = 49408, context_length: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)  # uses the global RNG in training: resume must restore it
        self.visual = _Visual(image_size, patch, width, heads, embed_dim)
        self.context_length = context_length
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.transformer = nn.ModuleList([_Tower(width, heads)])
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.randn(width, embed_dim) * width ** -0.5)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        f = self.dropout(self.visual(image))
        return F.normalize(f, dim=-1) if normalize else f

    def encode_text(self, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        x = self.token_embedding(text)
        for b in self.transformer:
            x = b(x, causal=True)
        x = self.ln_final(x)
        f = x[torch.arange(x.shape[0]), text.argmax(-1)] @ self.text_projection  # EOT pooling
        return F.normalize(f, dim=-1) if normalize else f

    def forward(self, image: torch.Tensor, text: torch.Tensor):
        return (self.encode_image(image, normalize=True), self.encode_text(text, normalize=True),
                self.logit_scale.exp())


# ----- tiny shards -------------------------------------------------------------------------------
WORDS = ("red", "green", "blue", "circle", "square", "stripe", "dot", "big", "small", "bright", "dark", "left", "right")


def write_image_text_shards(directory: str, n: int = 96, per_shard: int = 32, size: int = 16, seed: int = 0) -> str:
    """Shards of coloured-pattern PNGs with captions that describe them (learnable); returns the brace spec."""
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    with ShardWriter(directory, "it", maxcount=per_shard) as w:
        for i in range(n):
            colour = rng.randrange(3)
            shape = rng.randrange(2)
            img = Image.new("RGB", (size, size), (30, 30, 30))
            rgb = [(220, 40, 40), (40, 200, 40), (40, 60, 230)][colour]
            px = img.load()
            for y in range(size):
                for x in range(size):
                    inside = (x - size / 2) ** 2 + (y - size / 2) ** 2 < (size / 3) ** 2 if shape == 0 else \
                        (abs(x - size / 2) < size / 3 and abs(y - size / 2) < size / 3)
                    if inside:
                        px[x, y] = rgb
            buf = io.BytesIO()
            img.save(buf, "PNG")
            caption = f"a {WORDS[colour]} {WORDS[3 + shape]}"
            w.write(f"{i:05d}", {"png": buf.getvalue(), "txt": caption, "json": json.dumps({"label": colour})})
    n_shards = math.ceil(n / per_shard)
    return os.path.join(directory, f"it-{{000000..{n_shards - 1:06d}}}.tar")


def write_text_shards(directory: str, n_docs: int = 40, per_shard: int = 10, seed: int = 0,
                      vocab_size: int = 300, tokenizer: str | None = None) -> tuple[str, str]:
    """Text shards of simple repetitive documents and ``tokens.json``, with a byte-level BPE trained on them
    (or the given ``tokenizer.json``).

    Returns (shard spec, tokenizer.json path).
    """
    from diffmm.data.text import count_tokens
    from diffmm.data.tokenizers import TokenizerFile, train_byte_level_bpe
    from diffmm.data.urls import expand_sources

    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        k = rng.randrange(len(WORDS))
        docs.append(" ".join(WORDS[(k + j) % len(WORDS)] for j in range(rng.randrange(30, 60))) + ".")
    os.makedirs(directory, exist_ok=True)
    with ShardWriter(directory, "tx", maxcount=per_shard) as w:
        for i, d in enumerate(docs):
            w.write(f"{i:05d}", {"txt": d})
    if tokenizer is None:
        tokenizer = os.path.join(directory, "tokenizer.json")
        tok = train_byte_level_bpe(docs, tokenizer, vocab_size=vocab_size)
    else:
        tok = TokenizerFile(tokenizer)
    spec = os.path.join(directory, f"tx-{{000000..{math.ceil(n_docs / per_shard) - 1:06d}}}.tar")
    urls = list(expand_sources(spec)[0].urls)
    count_tokens(urls, tok)
    return spec, tokenizer




class CrashAt(pl.Callback):
    """Test-only: raise ``RuntimeError`` at the end of optimizer step ``step`` (a simulated crash)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise RuntimeError(f"simulated crash at step {trainer.global_step}")


class SleepEachStep(pl.Callback):
    """Test-only: sleep after every training step (gives a SIGKILL test time to strike mid-run)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import time

        time.sleep(self.seconds)


class NaNLossAt(pl.Callback):
    """Test-only: the training loss is NaN (and so are its gradients) at the optimizer steps in ``steps``
    (on every rank, or only on ``rank``)."""

    def __init__(self, steps: list[int], rank: int | None = None) -> None:
        self.steps, self.rank = set(steps), rank

    def setup(self, trainer, pl_module, stage):
        orig = pl_module.training_step

        def training_step(batch, batch_idx):
            loss = orig(batch, batch_idx)
            here = self.rank is None or trainer.global_rank == self.rank
            return loss * float("nan") if here and trainer.global_step in self.steps else loss

        pl_module.training_step = training_step


class NaNWeightsAt(pl.Callback):
    """Test-only: after optimizer step ``step`` one weight becomes NaN (a divergence the loss has not shown yet)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("nan")


class ParamTrace(pl.Callback):
    """Test-only: global step -> a copy of every parameter after that step's update."""

    def __init__(self) -> None:
        self.after: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]


class BatchTrace(pl.Callback):
    """Test-only: global step -> a copy of the batch trained at that step (``out``: also saved per rank,
    ``out.rank<R>.pt``, at the end of training)."""

    def __init__(self, out: str | None = None) -> None:
        self.out, self.batches = out, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches[trainer.global_step] = [t.detach().clone() for t in batch]

    def on_train_end(self, trainer, pl_module):
        if self.out:
            torch.save(self.batches, f"{self.out}.rank{trainer.global_rank}.pt")
