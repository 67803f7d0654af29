"""Perplexity of an LM on packed token rows (``diffmm.data.TextDataset`` batches of (B, T+1) tokens).

Every row predicts its last T tokens from the ones before; the reported loss is the token-weighted
mean negative log-likelihood over all rows, ``ppl = exp(nll)``, ``bits_per_token = nll / ln 2``.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from diffmm.data.stream import ShardLoader
from diffmm.data.text import TextDataset
from diffmm.eval.common import autocast, markdown_table, model_device
from diffmm.eval.lm_utils import lm_logits


@torch.no_grad()
def evaluate_perplexity(model, batches: Iterable[torch.Tensor], *, precision: str = "auto",
                        max_batches: Optional[int] = None, show_progress: bool = True,
                        total: Optional[int] = None) -> dict:
    """Token-weighted NLL / perplexity over ``(B, T+1)`` long batches (a tuple's first item is used)."""
    device = model_device(model)
    nll, tokens, rows = 0.0, 0, 0
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc="perplexity", disable=not show_progress, unit="row")
    for batch in itertools.islice(batches, max_batches):
        batch = (batch[0] if isinstance(batch, (tuple, list)) else batch).to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with autocast(device, precision):
            logits = lm_logits(model, inputs)
        nll += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
        tokens += targets.numel()
        rows += batch.shape[0]
        bar.update(batch.shape[0])
    bar.close()
    mean = nll / tokens if tokens else math.nan
    return {"nll": mean, "perplexity": math.exp(mean) if tokens else math.nan,
            "bits_per_token": mean / math.log(2) if tokens else math.nan, "tokens": tokens, "rows": rows,
            "seconds": time.perf_counter() - t0}


def perplexity_on_shards(model, urls, tokenizer, seq_len: int, *, batch_size: int = 8, num_workers: int = 1,
                         **kwargs) -> dict:
    """:func:`evaluate_perplexity` over text shards (``KEY.txt`` documents), each document read once."""
    ds = TextDataset(urls, batch_size, seq_len, tokenizer=tokenizer, train=False, shuffle=False, equalize=False,
                     name="perplexity")
    result = evaluate_perplexity(model, ShardLoader(ds, num_workers=num_workers), **kwargs)
    result["data"] = ds.stats.summary()
    result["seq_len"] = seq_len
    return result


def perplexity_markdown(results: dict[str, dict]) -> str:
    """One row per model: perplexity, NLL, bits/token, tokens."""
    return markdown_table(["model", "perplexity", "nll", "bits/token", "tokens"],
                          [[name, r["perplexity"], r["nll"], r["bits_per_token"], r["tokens"]]
                           for name, r in results.items()], floatfmt=".4f")
