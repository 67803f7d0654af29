"""Recall metrics on hand-built cases (an oracle LM, uniform attention), the plot, and ``diffmm eval recall``."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn

from diffmm.data.recall import RecallTask, eval_batches, make_recall_batch
from diffmm.eval.common import EvalError
from diffmm.eval.recall import (PARTS, attention_mass, evaluate_recall, part_masks, plot_recall, recall_hits,
                                tasks_from_grid)
from diffmm.models.lm import DiffLM, LMConfig


class OracleLM(nn.Module):
    """Predicts, at every position, the value stored after the current token in the key-value block.

    ``wrong_pair``: the answer for that pair's key is shifted by one (wrong on purpose).
    """

    def __init__(self, vocab: int, num_pairs: int, wrong_pair: int | None = None) -> None:
        super().__init__()
        self.vocab, self.n, self.wrong = vocab, num_pairs, wrong_pair
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, idx):
        keys, vals = idx[:, 0:2 * self.n:2], idx[:, 1:2 * self.n:2].clone()  # (B, N)
        if self.wrong is not None:
            vals[:, self.wrong] = (vals[:, self.wrong] + 1) % self.vocab
        match = (idx[:, :, None] == keys[:, None, :]).float()  # (B, T, N)
        return match @ nn.functional.one_hot(vals, self.vocab).float() + 0 * self.dummy  # (B, T, V)


def test_accuracy_of_an_oracle_and_of_a_broken_one():
    task = RecallTask(vocab_size=64, seq_len=64, num_pairs=8, num_queries=4)
    assert evaluate_recall(OracleLM(64, 8), [task], examples=40, batch_size=16, show_progress=False).accuracy == 1.0
    res = evaluate_recall(OracleLM(64, 8, wrong_pair=0), [task], examples=40, batch_size=16, seed=3,
                          show_progress=False)
    pairs = torch.cat([b.query_pair for b in eval_batches(task, 40, 16, seed=3)])  # (40, 4)
    t = res.tasks[0]
    assert t.accuracy == pytest.approx(float((pairs != 0).float().mean()))
    assert t.sequence_accuracy == pytest.approx(float((pairs != 0).all(1).float().mean()))
    assert t.queries == 160 and t.sequences == 40
    hits = recall_hits(OracleLM(64, 8, wrong_pair=2), make_recall_batch(task, 5, seed=0))
    b = make_recall_batch(task, 5, seed=0)
    assert torch.equal(hits, b.query_pair != 2)  # per query, in query order


def test_part_masks_split_each_row():
    task = RecallTask(vocab_size=32, seq_len=24, num_pairs=3, num_queries=2)
    b = make_recall_batch(task, 2, seed=1)
    m = part_masks(b)
    total = m["answer"].int() + m["distractor_pairs"].int() + m["rest"].int()
    assert (total == 1).all()
    for i in range(2):
        for q, j in enumerate(b.query_pair[i].tolist()):
            assert m["answer"][i, q].nonzero().flatten().tolist() == [2 * j, 2 * j + 1]
            assert int(m["distractor_pairs"][i, q].sum()) == 4


@pytest.mark.parametrize("attention", ["standard", "diff", "diff_v2"])
def test_attention_shares_of_uniform_attention(attention):
    """Zero query projections give uniform causal rows (DIFF: (1 - lambda) * uniform), whose shares are known."""
    torch.manual_seed(0)
    model = DiffLM(LMConfig(vocab_size=64, block_size=64, n_layer=2, n_embd=32, n_head=4, attention=attention)).eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.q_proj.weight.zero_()
            if hasattr(blk.attn, "lambda_proj"):
                blk.attn.lambda_proj.weight.zero_()  # a constant lambda for V2 too
    task = RecallTask(vocab_size=64, seq_len=48, num_pairs=4)
    b = make_recall_batch(task, 6, seed=2)
    mass = attention_mass(model, b, chunk=4)
    t = b.query_pos.double() + 1  # keys each query sees
    n2 = task.context_len
    expect = {"answer": (2 / t).mean(), "distractor_pairs": ((n2 - 2) / t).mean(), "rest": ((t - n2) / t).mean()}
    for p in PARTS:
        assert mass[p].shape == (2, 2 if attention == "diff" else 4)
        np.testing.assert_allclose(mass[p] / mass["abs_total"], float(expect[p]), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(mass["total"], mass["abs_total"], rtol=1e-6)  # rows are positive here


def test_attention_shares_of_a_negative_diff_row():
    """lambda > 1 turns a uniform DIFF row negative: every share flips sign and the net share is -1
    (the shares are normalised by sum(|a|), which stays well defined where sum(a) = 1 - lambda nears 0)."""
    torch.manual_seed(0)
    model = DiffLM(LMConfig(vocab_size=64, block_size=64, n_layer=1, n_embd=32, n_head=4, attention="diff")).eval()
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.q_proj.weight.zero_()
        attn.lambda_q1.fill_(0.5), attn.lambda_k1.fill_(0.5), attn.lambda_q2.zero_(), attn.lambda_k2.zero_()
    assert float(attn.lambda_full()) > 1.5
    task = RecallTask(vocab_size=64, seq_len=32, num_pairs=2)
    b = make_recall_batch(task, 3, seed=0)
    mass = attention_mass(model, b)
    t = b.query_pos.double() + 1
    np.testing.assert_allclose(mass["answer"] / mass["abs_total"], -float((2 / t).mean()), rtol=1e-6)
    np.testing.assert_allclose(mass["total"] / mass["abs_total"], -1.0, rtol=1e-6)
    res = evaluate_recall(model, [task], examples=3, measure_attention=True, show_progress=False)
    assert res.tasks[0].attention["net"][0] == pytest.approx(-1.0)


def test_evaluate_recall_result_and_errors(tmp_path):
    torch.manual_seed(0)
    model = DiffLM(LMConfig(vocab_size=64, block_size=64, n_layer=2, n_embd=32, n_head=4, attention="diff"))
    tasks = tasks_from_grid(64, [32, 64], [2, 4])
    res = evaluate_recall(model, tasks, examples=8, batch_size=4, measure_attention=True, attention_examples=4,
                          show_progress=False)
    d = res.to_dict()
    assert [t["name"] for t in d["tasks"]] == ["L32-N2", "L32-N4", "L64-N2", "L64-N4"]
    assert set(d["accuracy_by_seq_len"]) == {"32", "64"} and set(d["accuracy_by_pairs"]) == {"2", "4"}
    att = d["attention"]
    assert att["retrieval_layer"] in (0, 1)
    assert att["answer"] + att["distractor_pairs"] + att["rest"] == pytest.approx(att["net"])
    assert 0 < att["net"] <= 1.0 + 1e-9
    assert "L64-N4" in res.to_markdown("m")
    json.dumps(d)
    out = plot_recall({"a": d, "b": d}, str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").stat().st_size > 10_000 and out.endswith("r.png")
    with pytest.raises(EvalError, match="vocabulary 128 exceeds"):
        evaluate_recall(model, [RecallTask(vocab_size=128, seq_len=32, num_pairs=2)], show_progress=False)
    with pytest.raises(EvalError, match="seq_len 128 exceeds"):
        evaluate_recall(model, [RecallTask(vocab_size=64, seq_len=128, num_pairs=2)], show_progress=False)
    with pytest.raises(EvalError, match="no setting"):
        tasks_from_grid(64, [16], [8])


def test_cli_recall_on_a_random_model(tmp_path, capsys):
    from diffmm.cli import main

    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["eval", "recall", "--lm", "config:transformer-tiny", "--vocab", "64", "--seq_len", "[32, 64]",
               "--pairs", "[2, 4]", "--examples", "8", "--attention_examples", "4", "--device", "cpu", "--progress",
               "false", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["task"] == "recall" and len(d["tasks"]) == 4 and png.exists()
    assert "L64-N4" in capsys.readouterr().out
    rc = main(["eval", "recall", "--lm", str(tmp_path / "missing.ckpt"), "--device", "cpu"])
    assert rc == 2 and "missing.ckpt: no such file or folder" in capsys.readouterr().err


def test_cli_recall_zoology_sampler_and_its_chance_levels(tmp_path, capsys):
    from diffmm.cli import main

    out = tmp_path / "z.json"
    args = ["eval", "recall", "--lm", "config:transformer-tiny", "--vocab", "64", "--seq_len", "[16]", "--pairs", "[4]",
            "--examples", "8", "--attention", "false", "--device", "cpu", "--progress", "false"]
    assert main(args + ["--sampler", "zoology", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["tasks"][0]["task"]["sampler"] == "zoology" and d["tasks"][0]["queries"] == 8 * 4
    assert d["chance"] == 0.25 and d["rank_chance"] > 0.33  # Zoology's order answers a third of the queries
    assert "zoology sampling" in capsys.readouterr().out
    assert main(args + ["--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["tasks"][0]["task"]["sampler"] == "diffmm" and abs(d["rank_chance"] - 0.25) < 0.04
    assert main(args + ["--sampler", "uniform"]) == 2
    assert "sampler" in capsys.readouterr().err
    assert main(args + ["--sampler", "zoology", "--queries", "2"]) == 2
    assert "queries every pair" in capsys.readouterr().err


def test_oracle_is_perfect_on_zoology_data():
    task = RecallTask(vocab_size=64, seq_len=64, num_pairs=8, sampler="zoology")
    res = evaluate_recall(OracleLM(64, 8, wrong_pair=0), [task], examples=200, batch_size=50, show_progress=False)
    # pair 0 is wrong: exactly its queries are missed, whatever their position
    b = list(eval_batches(task, 200, 50, seed=0))
    assert res.accuracy == pytest.approx(1 - 1 / 8) and res.tasks[0].queries == 200 * 8
    assert all((x.query_pair == 0).sum(1).eq(1).all() for x in b)
