"""Activation outliers (DIFF Transformer paper, Table 5): the largest attention logits and hidden states.

For every attention call the raw scores ``q.k / sqrt(d)`` of all query maps are taken at the
positions the softmax sees (masked ones excluded); hidden states are the outputs of every block
holding an attention layer (the residual stream). Both are reported as magnitudes: the 1st, 2nd,
3rd, 10th and 100th largest value and the median.

Top values are exact. The median is exact while at most ``sample_size`` values were seen, and
beyond that is the median of a uniform random sample of that size (reported as ``median_exact``).
"""
from __future__ import annotations

import itertools
import time
from typing import Iterable, Optional

import torch
from tqdm.auto import tqdm

from diffmm.eval.attention_capture import AttentionRecord, AttentionRecorder
from diffmm.eval.common import markdown_table, model_device
from diffmm.eval.lm_utils import lm_logits

RANKS = (1, 2, 3, 10, 100)


class MagnitudeStats:
    """Running top-k (exact) and median (exact or from a uniform sample) of |values|.

    Args:
        k: how many of the largest values to keep.
        sample_size: values kept for the median (a uniform sample once more were seen).
        seed: for the sample.
    """

    def __init__(self, k: int = max(RANKS), sample_size: int = 1 << 22, seed: int = 0) -> None:
        self.k, self.cap = k, sample_size
        self.top = torch.empty(0)
        self.keys = torch.empty(0)
        self.sample = torch.empty(0)
        self.count = 0
        self.gen = torch.Generator().manual_seed(seed)

    def update(self, values: torch.Tensor) -> None:
        v = values.detach().reshape(-1).abs().float().cpu()
        if v.numel() == 0:
            return
        self.count += v.numel()
        merged = torch.cat([self.top, v.topk(min(self.k, v.numel())).values])
        self.top = merged.topk(min(self.k, merged.numel())).values
        # uniform sample without replacement: keep the cap values with the smallest random keys
        keys = torch.rand(v.numel(), generator=self.gen)
        if self.sample.numel() >= self.cap:
            keep = keys < self.keys.max()
            keys, v = keys[keep], v[keep]
        keys, vals = torch.cat([self.keys, keys]), torch.cat([self.sample, v])
        if vals.numel() > self.cap:
            sel = keys.topk(self.cap, largest=False).indices
            keys, vals = keys[sel], vals[sel]
        self.keys, self.sample = keys, vals

    def result(self, ranks: Iterable[int] = RANKS) -> dict:
        out = {f"top{r}": float(self.top[r - 1]) if self.top.numel() >= r else float("nan") for r in ranks}
        if self.sample.numel():
            s = self.sample.sort().values
            n = s.numel()  # median: mean of the two middle values for an even count
            out["median"] = float(s[n // 2]) if n % 2 else float((s[n // 2 - 1] + s[n // 2]) / 2)
        else:
            out["median"] = float("nan")
        out["count"] = self.count
        out["median_exact"] = self.count <= self.cap
        return out


@torch.no_grad()
def activation_outliers(model, batches: Iterable[torch.Tensor], *, max_batches: Optional[int] = None,
                        sample_size: int = 1 << 22, show_progress: bool = True) -> dict:
    """Top and median magnitudes of attention logits and hidden states over token batches.

    Args:
        batches: ``(B, T)`` (or ``(B, T+1)`` packed rows, the last token is dropped) long tensors.
        max_batches: stop after this many batches.
    """
    device = model_device(model)
    logits_stats = MagnitudeStats(sample_size=sample_size, seed=0)
    hidden_stats = MagnitudeStats(sample_size=sample_size, seed=1)

    def on_attention(rec: AttentionRecord) -> None:
        logits_stats.update(rec.logits()[rec.valid()])

    def on_block(mod, args, out):
        hidden_stats.update(out[0] if isinstance(out, (tuple, list)) else out)

    t0 = time.perf_counter()
    tokens = 0
    with AttentionRecorder(model, on_record=on_attention) as rec:
        blocks = dict(model.named_modules())  # the parent module (the block) of each attention layer
        handles = [blocks[n.rsplit(".", 1)[0]].register_forward_hook(on_block) for n, _, _ in rec.layers if "." in n]
        try:
            for batch in tqdm(itertools.islice(batches, max_batches), total=max_batches, desc="outliers",
                              disable=not show_progress, unit="batch"):
                idx = (batch[0] if isinstance(batch, (tuple, list)) else batch).to(device)
                lm_logits(model, idx)
                tokens += idx.numel()
        finally:
            for h in handles:
                h.remove()
    return {"attention_logits": logits_stats.result(), "hidden_states": hidden_stats.result(), "tokens": tokens,
            "layers": len(rec.layers), "seconds": time.perf_counter() - t0}


def outliers_markdown(results: dict[str, dict]) -> str:
    """Table 5 layout: one row per (model, activation type)."""
    rows = []
    for name, r in results.items():
        for kind, label in (("attention_logits", "attention logits"), ("hidden_states", "hidden states")):
            s = r[kind]
            rows.append([name, label, *[s[f"top{k}"] for k in RANKS], s["median"]])
    return markdown_table(["model", "activation", *[f"top-{k}" for k in RANKS], "median"], rows)
