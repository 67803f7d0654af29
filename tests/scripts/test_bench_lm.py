"""scripts/bench_lm.py times like against like: the same weights give every DIFF model the same loss, whichever
loss path (its own training loss or F.cross_entropy of its logits) the benchmark takes."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
bench_lm = pytest.importorskip("bench_lm")
pytest.importorskip("transformers")


def test_every_diff_model_and_loss_path_gives_the_same_loss(tmp_path):
    args = argparse.Namespace(vocab=64, seq=12, layers=2, width=32, heads=2, hf_attn="eager", with_twin=False,
                              compile=False, with_logits=True)
    models = bench_lm.build_models(args, tmp_path)
    idx = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
    inputs, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()  # as the benchmark
    losses = {(name, own): bench_lm.runner(name, model, own).loss_fn(inputs, targets)
              for name, model in models.items() if name != bench_lm.HF_LLAMA for own in (True, False)}
    want = losses[(bench_lm.HF_DIFF, False)]
    for key, loss in losses.items():
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5, msg=str(key))
    assert len(losses) == 6
