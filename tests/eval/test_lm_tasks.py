"""Language metrics on cases with known answers: perplexity, multi-needle retrieval, attention on the needle,
activation outliers, in-context-learning order robustness."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from eval_helpers import (HAYSTACK_TEXT, BlockWrapLM, NeedleOracle, OneLayerLM, ReaderICL, RecencyICL, UnigramLM,
                          WordTokenizer, write_text_shard)

from diffmm.eval.common import EvalError
from diffmm.eval.icl import ICLConfig, icl_order_robustness
from diffmm.eval.needle import NeedleBuilder, NeedleConfig, answer_attention, multi_needle, split_sentences
from diffmm.eval.outliers import MagnitudeStats, activation_outliers
from diffmm.eval.perplexity import evaluate_perplexity, perplexity_on_shards
from diffmm.nn import Attention, DiffAttention


# ------------------------------------------------------------------------------------- perplexity
def test_perplexity_known_distribution():
    V = 11
    logits = torch.randn(V)
    logp = torch.log_softmax(logits.double(), 0).numpy()
    batches = [torch.randint(0, V, (3, 9)) for _ in range(4)]
    res = evaluate_perplexity(UnigramLM(V, logits), batches, show_progress=False)
    targets = np.concatenate([b[:, 1:].reshape(-1).numpy() for b in batches])
    nll = -logp[targets].mean()
    assert res["tokens"] == targets.size == 4 * 3 * 8
    assert res["nll"] == pytest.approx(nll, rel=1e-6) and res["perplexity"] == pytest.approx(math.exp(nll), rel=1e-6)


def test_perplexity_on_shards_uniform_is_vocab(tmp_path):
    tok = WordTokenizer(vocab_size=300)
    docs = [" ".join(f"w{(i * 7 + j) % 50}" for j in range(30 + i)) for i in range(12)]
    write_text_shard(str(tmp_path / "t.tar"), docs)
    res = perplexity_on_shards(UnigramLM(300), str(tmp_path / "t.tar"), tok, seq_len=16, batch_size=4,
                               num_workers=0, show_progress=False)
    total = sum(len(d.split()) + 1 for d in docs)  # words + one separator per document
    assert res["tokens"] == (total // 17) * 16
    assert res["perplexity"] == pytest.approx(300, rel=1e-5)


def test_perplexity_matches_difflm_loss():
    from diffmm.models.lm import DiffLM, LMConfig

    torch.manual_seed(0)
    model = DiffLM(LMConfig(vocab_size=64, block_size=32, n_layer=2, n_embd=32, n_head=4)).eval()
    batch = torch.randint(0, 64, (3, 17))
    res = evaluate_perplexity(model, [batch], show_progress=False)
    with torch.no_grad():
        _, loss = model(batch[:, :-1], batch[:, 1:])
    assert res["nll"] == pytest.approx(float(loss), rel=1e-5)


# ------------------------------------------------------------------------------------ multi-needle
def test_needle_placement_and_lengths():
    tok = WordTokenizer()
    cfg = NeedleConfig(context_length=300, num_needles=4, num_queried=2, depths=(0.0, 0.5, 1.0), trials=1)
    b = NeedleBuilder(tok, split_sentences(HAYSTACK_TEXT), cfg)
    rng = random.Random(0)
    for depth in cfg.depths:
        prompts = b.trial(depth, rng)
        assert len(prompts) == 2
        for p in prompts:
            assert len(p.tokens) <= 300
            words = tok.decode(p.tokens[p.span[0]:p.span[1]]).split()
            assert words[:5] == ["The", "magic", "number", "of", p.key] and words[6] == p.value
            assert abs(p.depth - depth) < 0.1
            assert tok.decode(p.tokens[-9:]).endswith(f"magic number of {p.key} is")
    # all N needles are in the prompt
    assert tok.decode(prompts[0].tokens).count("magic number of") == 4 + 2  # 4 needles + twice in the question


def test_needle_accuracy_known_by_depth():
    """An oracle that sees only the last 50% of the prompt finds needles at depth >= 75%, none at <= 25%."""
    tok = WordTokenizer()
    L = 400
    cfg = NeedleConfig(context_length=L, num_needles=3, num_queried=2, depths=(0.0, 0.25, 0.75, 1.0), trials=3)
    hay = split_sentences(HAYSTACK_TEXT)
    res = multi_needle(NeedleOracle(tok, window=L // 2), tok, hay, cfg, show_progress=False)
    assert res.accuracy_by_depth == {0.0: 0.0, 0.25: 0.0, 0.75: 1.0, 1.0: 1.0}
    assert res.prompts == 4 * 3 * 2
    full = multi_needle(NeedleOracle(tok, window=10 * L), tok, hay, cfg, show_progress=False)
    assert full.accuracy == 1.0
    assert "depth 75%" in res.to_markdown()


def test_needle_small_context_skips_long_sentences():
    """Sentences longer than the whole haystack budget are skipped, not the end of the haystack."""
    tok = WordTokenizer()
    long = " ".join(["word"] * 300) + "."
    sentences = [long, "A short one.", long, "Another short one.", "Third one here."] * 3
    cfg = NeedleConfig(context_length=80, num_needles=2, num_queried=1, depths=(0.5,), trials=1)
    for seed in range(5):
        p = NeedleBuilder(tok, sentences, cfg).trial(0.5, random.Random(seed))[0]
        assert len(p.tokens) <= 80 and "word word" not in tok.decode(p.tokens)


def test_needle_bad_config():
    with pytest.raises(EvalError, match="R .* <= N"):
        NeedleConfig(num_needles=2, num_queried=3)
    with pytest.raises(EvalError, match="no room"):
        NeedleBuilder(WordTokenizer(), ["a b c."], NeedleConfig(context_length=10, num_needles=2, num_queried=1)
                      ).trial(0.5, random.Random(0))


def _needle_prompt(tok):
    cfg = NeedleConfig(context_length=200, num_needles=2, num_queried=1, depths=(0.5,), trials=1)
    return NeedleBuilder(tok, split_sentences(HAYSTACK_TEXT), cfg).trial(0.5, random.Random(1))[0]


@pytest.mark.parametrize("diff", [False, True])
def test_answer_attention_known(diff):
    """A model whose query attends to the needle's number token: the share on the needle follows from softmax."""
    tok = WordTokenizer(vocab_size=256)
    p = _needle_prompt(tok)
    V = E = 256
    a = 6.0  # logit of the number token
    vid = tok.ids[p.value]
    if diff:
        attn = DiffAttention(E, 1, lambda_init=0.3)
        d = attn.head_dim
        with torch.no_grad():
            for w in (attn.q_proj.weight, attn.k_proj.weight):
                w.zero_()
            attn.q_proj.weight[0, :] = a * d ** 0.5  # component 1 query = a*sqrt(d) e_0 for every token
            attn.k_proj.weight[0, vid] = 1.0  # component 1 key = e_0 for the number token only; component 2: 0
            lam = float(attn.lambda_full())
    else:
        attn = Attention(E, 1)
        d = attn.head_dim
        with torch.no_grad():
            attn.q_proj.weight.zero_()
            attn.k_proj.weight.zero_()
            attn.q_proj.weight[0, :] = a * d ** 0.5
            attn.k_proj.weight[0, vid] = 1.0
    model = OneLayerLM(attn, V)
    res = answer_attention(model, p.tokens, p.span)
    T, n_span = len(p.tokens), p.span[1] - p.span[0]
    A1 = (math.exp(a) + n_span - 1) / (math.exp(a) + T - 1)
    expected = (A1 - lam * n_span / T) / (1 - lam) if diff else A1
    assert res["answer"] == pytest.approx(expected, rel=1e-5)
    assert res["answer"] > 0.3 and res["noise"] == pytest.approx(1 - expected, rel=1e-4)


# ----------------------------------------------------------------------------------------- outliers
def test_outliers_known_values():
    torch.manual_seed(0)
    V, E, H = 20, 8, 2
    emb = torch.randn(V, E) * torch.linspace(0.5, 3, V)[:, None]
    attn = Attention(E, H)
    with torch.no_grad():
        attn.out_proj.weight.zero_()  # block output = its input: the hidden states are the embeddings
    model = BlockWrapLM(attn, emb)
    batches = [torch.randint(0, V, (2, 12)) for _ in range(3)]
    res = activation_outliers(model, batches, show_progress=False)
    X = np.concatenate([emb[b].double().numpy().reshape(-1, 12, E) for b in batches])  # (6, 12, E)
    Wq, Wk = attn.q_proj.weight.detach().double().numpy(), attn.k_proj.weight.detach().double().numpy()
    d = E // H
    vals = []
    for x in X:
        q, k = x @ Wq.T, x @ Wk.T
        for h in range(H):
            s = q[:, h * d:(h + 1) * d] @ k[:, h * d:(h + 1) * d].T / math.sqrt(d)
            vals.append(np.abs(s[np.tril_indices(12)]))
    vals = np.sort(np.concatenate(vals))[::-1]
    hid = np.sort(np.abs(X).ravel())[::-1]
    got_l, got_h = res["attention_logits"], res["hidden_states"]
    for r in (1, 2, 3, 10, 100):
        assert got_l[f"top{r}"] == pytest.approx(vals[r - 1], rel=1e-5)
        assert got_h[f"top{r}"] == pytest.approx(hid[r - 1], rel=1e-6)
    assert got_l["median"] == pytest.approx(np.median(vals), rel=1e-5) and got_l["median_exact"]
    assert got_h["median"] == pytest.approx(np.median(hid), rel=1e-6)
    assert got_l["count"] == vals.size and got_h["count"] == hid.size


def test_magnitude_stats_sampled_median():
    g = torch.Generator().manual_seed(123)  # not the stats' own sampling seed (0): keys and values must be independent
    st = MagnitudeStats(k=5, sample_size=5000)
    chunks = [torch.rand(20_000, generator=g) * 10 for _ in range(10)]
    for c in chunks:
        st.update(c)
    allv = torch.cat(chunks)
    r = st.result(ranks=(1, 5))
    assert r["top1"] == float(allv.max()) and r["top5"] == float(allv.topk(5).values[-1])
    assert not r["median_exact"] and r["count"] == 200_000
    assert r["median"] == pytest.approx(float(allv.median()), abs=0.2)  # sample of 5000: ~0.07 std


def test_outliers_on_difflm_runs_every_layer():
    from diffmm.models.lm import DiffLM, LMConfig

    model = DiffLM(LMConfig(vocab_size=64, block_size=32, n_layer=3, n_embd=32, n_head=4)).eval()
    res = activation_outliers(model, [torch.randint(0, 64, (2, 16))], show_progress=False)
    assert res["layers"] == 3
    assert res["attention_logits"]["count"] == 3 * 4 * 2 * (16 * 17 // 2)  # layers * query maps * B * causal pairs
    assert res["hidden_states"]["count"] == 3 * 2 * 16 * 32


# -------------------------------------------------------------------------------------------- ICL
def _icl_data():
    words = {"pos": ["sun", "joy", "gift", "smile"], "neg": ["rain", "pain", "loss", "frown"]}
    train = [(f"{w} {w}", lab) for lab, ws in words.items() for w in ws]
    # 3/4 of the test set is positive, so the label of the last demonstration decides the recency model's accuracy
    test = [(f"a {w}", "pos") for w in words["pos"][:3]] + [(f"a {words['neg'][0]}", "neg")]
    return words, train, test


def test_icl_recency_model_known_accuracies():
    words, train, test = _icl_data()
    tok = WordTokenizer()
    res = icl_order_robustness(RecencyICL(tok), tok, train, test, ICLConfig(shots=4, orders=8), show_progress=False)
    assert len(res.accuracies) == len(res.orders) == 8
    expected = [0.75 if order[-1] == "pos" else 0.25 for order in res.orders]
    assert res.accuracies == expected
    assert {"pos", "neg"} == {o[-1] for o in res.orders}  # both endings occur with 8 orders of 2+2 demos
    assert res.summary["spread"] == 0.5


def test_icl_reader_model_is_order_robust():
    words, train, test = _icl_data()
    tok = WordTokenizer()
    label_of = {w: lab for lab, ws in words.items() for w in ws}
    for arrangement in ("random", "grouped"):
        res = icl_order_robustness(ReaderICL(tok, label_of), tok, train, test,
                                   ICLConfig(shots=4, orders=2, arrangement=arrangement), show_progress=False)
        assert res.accuracies == [1.0, 1.0] and res.summary["spread"] == 0.0


def test_icl_bad_input(tmp_path):
    from diffmm.eval.icl import load_jsonl_examples

    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(EvalError, match=r"bad.jsonl:1: expected a JSON object with 'text' and 'label'"):
        load_jsonl_examples(str(tmp_path / "bad.jsonl"))
    words, train, test = _icl_data()
    with pytest.raises(EvalError, match="never occur"):
        icl_order_robustness(RecencyICL(WordTokenizer()), WordTokenizer(), train, [("x", "other")], ICLConfig(),
                             show_progress=False)
