"""DiffLM: config validation, KV-cache decoding vs full forward, generate, parameter report."""
import math

import pytest
import torch

from diffmm.models.lm import DiffLM, LMConfig, sample_next, swiglu_hidden
from diffmm.models.lm_configs import list_lm_configs
from diffmm.nn import ATTENTION_LAYERS


def make(attention="diff", n_kv_head=None, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = LMConfig(vocab_size=61, context_length=48, layers=3, width=64, heads=8, kv_heads=n_kv_head,
                   attn_type=attention, init_std=0.1, **kw)
    return DiffLM(cfg).eval()


# --------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw, match", [
    (dict(width=100, heads=8), "width 100 is not divisible by heads 8"),
    (dict(heads=8, kv_heads=3), "heads 8 is not divisible by kv_heads 3"),
    (dict(width=24, heads=8), "even head dim"),
    (dict(width=60, heads=6, kv_heads=3), "divisible by 2"),
    (dict(width=64, heads=2, kv_heads=1), "kv_heads 1 must be divisible by 2"),
    (dict(vocab_size=0), "LMConfig.vocab_size must be a positive int"),
    (dict(layers=2.5), "LMConfig.layers must be a positive int"),
    (dict(intermediate_size=-4), "intermediate_size"),
    (dict(lambda_init="deep"), "lambda_init 'deep' is unknown"),
    (dict(norm_eps=0.0), "norm_eps"),
])
def test_config_rejects_impossible_shapes(kw, match):
    base = dict(vocab_size=32, context_length=16, layers=1, width=64, heads=4)
    with pytest.raises(ValueError, match=match) as info:
        LMConfig(**{**base, **kw})
    assert "\n" not in str(info.value)


def test_config_names_and_dicts():
    assert {"diff-tiny", "transformer-tiny", "diff-cpu-small", "transformer-cpu-small", "diff-1.4b"} <= set(
        list_lm_configs())
    for name in list_lm_configs():  # every preset is valid and the twins differ only in attention
        cfg = LMConfig.from_name(name)
        twin = name.replace("diff-", "transformer-") if name.startswith("diff-") else name.replace(
            "transformer-", "diff-")
        other = LMConfig.from_name(twin).to_dict()
        diff = {k for k, v in cfg.to_dict().items() if other[k] != v}
        assert diff == {"attn_type"}, (name, diff)
    cfg = LMConfig.from_name("diff-tiny", layers=3)
    assert cfg.layers == 3 and LMConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown LM config 'nope'"):
        LMConfig.from_name("nope")
    with pytest.raises(ValueError, match="unknown LMConfig field.*n_heads"):
        LMConfig.from_dict({**cfg.to_dict(), "n_heads": 4})
    with pytest.raises(ValueError, match="unknown attention type 'fancy'"):
        DiffLM(LMConfig.from_name("diff-tiny", attn_type="fancy"))


def test_old_config_keys_still_read_with_a_deprecation_notice():
    old = dict(vocab_size=32, block_size=16, n_layer=1, n_embd=64, n_head=4, n_kv_head=2, attention="standard")
    with pytest.warns(FutureWarning) as rec:
        cfg = LMConfig(**old)
    assert [str(w.message) for w in rec] == [f"LMConfig: config key {o!r} is deprecated; use {n!r}" for o, n in (
        ("block_size", "context_length"), ("n_layer", "layers"), ("n_embd", "width"), ("n_head", "heads"),
        ("n_kv_head", "kv_heads"), ("attention", "attn_type"))]
    new = LMConfig(vocab_size=32, context_length=16, layers=1, width=64, heads=4, kv_heads=2, attn_type="standard")
    assert cfg == new and "n_embd" not in cfg.to_dict()
    with pytest.warns(FutureWarning) as rec:
        assert LMConfig.from_dict(old, source="ckpt.json") == new
    assert len(rec) == 6 and str(rec[-1].message) == "ckpt.json: config key 'attention' is deprecated; use 'attn_type'"
    with pytest.warns(FutureWarning, match="'n_layer' is deprecated; use 'layers'"):
        assert LMConfig.from_name("transformer-tiny", n_layer=3).layers == 3  # preset (new keys) + old override
    assert (cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.n_layer, cfg.block_size, cfg.attention) == (
        64, 4, 2, 1, 16, "standard")  # read-only aliases for code written before
    with pytest.raises(ValueError, match="give 'width' or its old name 'n_embd', not both"):
        LMConfig.from_dict({**new.to_dict(), "n_embd": 32})


def test_swiglu_hidden_rounding():
    assert swiglu_hidden(128, 64) == 384 and swiglu_hidden(1536, 64) == 4096 and swiglu_hidden(2048, 64) == 5504
    assert LMConfig.from_name("diff-tiny", intermediate_size=100).mlp_hidden == 100


# -------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("attention", ["diff", "standard"])
def test_forward_loss_and_gradients(attention):
    model = make(attention).train()
    idx = torch.randint(0, 61, (2, 16))
    targets = torch.randint(0, 61, (2, 16))
    targets[0, :3] = -100
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, 61)
    ref = torch.nn.functional.cross_entropy(logits[targets != -100], targets[targets != -100])
    torch.testing.assert_close(loss, ref)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if "lambda" in name:
            assert p.grad.abs().sum() > 0, name
    assert isinstance(model(idx), torch.Tensor)


@pytest.mark.parametrize("tie", [True, False])
def test_fused_head_loss_equals_the_logits_path(tie):
    """``return_logits=False`` (head and loss fused by chunks): same loss and gradients, tied head or not."""
    model = make("diff", tie_embeddings=tie).train()
    idx, targets = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))
    targets[1, 4:9] = -100
    _, want = model(idx, targets)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    logits, loss = model(idx, targets, return_logits=False)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert logits is None
    torch.testing.assert_close(loss, want)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_structure_and_tying():
    model = make("diff", n_kv_head=4)
    assert model.lm_head.weight is model.wte.weight
    attn = model.blocks[2].attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 8)  # heads 8 -> 4 differential heads
    assert attn.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.6))
    assert model.blocks[0].attn.causal and model.blocks[0].attn.use_rope
    untied = make("diff", tie_embeddings=False)
    assert untied.lm_head.weight is not untied.wte.weight


def test_init_std():
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=512, context_length=16, layers=8, width=128, heads=4, init_std=0.05)
    model = DiffLM(cfg)
    assert model.wte.weight.std().item() == pytest.approx(0.05, rel=0.05)
    assert model.blocks[0].mlp.up_proj.weight.std().item() == pytest.approx(0.05, rel=0.05)
    assert model.blocks[0].mlp.down_proj.weight.std().item() == pytest.approx(0.05 / 4, rel=0.05)
    assert model.blocks[0].attn.lambda_q1.std().item() == pytest.approx(0.1, rel=0.5)
    assert torch.all(model.blocks[0].attn.diff_norm.weight == 1)


def test_errors_are_one_line():
    model = make()
    with pytest.raises(ValueError, match="exceed context_length 48"):
        model(torch.zeros(1, 49, dtype=torch.long))
    with pytest.raises(ValueError, match="attn_mask has shape"):
        model(torch.zeros(2, 5, dtype=torch.long), attn_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="start_pos=3 needs kv_caches"):
        model(torch.zeros(1, 2, dtype=torch.long), start_pos=3)
    with pytest.raises(ValueError, match="start_pos 2 != 0 positions already in the KV cache"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_caches=model.new_kv_caches(8), start_pos=2)
    with pytest.raises(ValueError, match="exceeds context_length"):
        model.generate(torch.zeros(1, 40, dtype=torch.long), 9)


def test_padding_mask_all_true_is_no_mask():
    model = make("diff", n_kv_head=4)
    idx = torch.randint(0, 61, (2, 12))
    torch.testing.assert_close(model(idx, attn_mask=torch.ones(2, 12, dtype=torch.bool)), model(idx))
    # Masking out key 0 for row 0 changes that row only.
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, 0] = False
    out = model(idx, attn_mask=mask)
    torch.testing.assert_close(out[1], model(idx)[1])
    assert not torch.allclose(out[0, 1:], model(idx)[0, 1:])


# --------------------------------------------------------------------------------- KV cache
@pytest.mark.parametrize("attention, n_kv_head", [("diff", None), ("diff", 4), ("diff", 2), ("standard", None),
                                                  ("standard", 2)])
def test_kv_cache_decoding_matches_full_forward(attention, n_kv_head):
    model = make(attention, n_kv_head)
    idx = torch.randint(0, 61, (2, 20))
    with torch.no_grad():
        full = model(idx)
        caches = model.new_kv_caches(20)
        chunks, pos = [], 0
        for n in (7, 1, 1, 3, 1, 1, 1, 5):  # prefill, single steps and a multi-token chunk
            chunks.append(model(idx[:, pos:pos + n], kv_caches=caches, start_pos=pos))
            pos += n
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=0)
    assert full.abs().max() > 1.0  # logits large enough for the tolerance to mean something


@pytest.mark.parametrize("attention, n_kv_head", [("diff", 4), ("standard", 2)])
def test_generate_greedy_equals_repeated_full_forward(attention, n_kv_head):
    model = make(attention, n_kv_head, seed=1)
    prompt = torch.randint(0, 61, (3, 5))
    out = model.generate(prompt, 12, greedy=True)
    ref = prompt
    with torch.no_grad():
        for _ in range(12):
            ref = torch.cat([ref, model(ref)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    assert torch.equal(model.generate(prompt, 12, temperature=0.0), ref)


def test_generate_sampling_is_seeded():
    model = make("diff")
    prompt = torch.randint(0, 61, (2, 4))
    a = model.generate(prompt, 10, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 10, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(7))
    c = model.generate(prompt, 10, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(8))
    assert a.shape == (2, 14) and torch.equal(a, b) and not torch.equal(a, c)
    greedy = model.generate(prompt, 10, greedy=True)
    assert torch.equal(model.generate(prompt, 10, top_k=1, generator=torch.Generator().manual_seed(3)), greedy)
    assert torch.equal(model.generate(prompt, 10, top_p=1e-6, generator=torch.Generator().manual_seed(3)), greedy)


def test_generate_stops_at_eos():
    model = make("diff")
    prompt = torch.randint(0, 61, (1, 4))
    greedy = model.generate(prompt, 10, greedy=True)
    eos = int(greedy[0, 6])
    out = model.generate(prompt, 10, greedy=True, eos_id=eos)
    first = int((greedy[0, 4:] == eos).nonzero()[0]) + 4
    assert torch.equal(out, greedy[:, :first + 1])


def test_sample_next_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, top_k=2, generator=g).unique().tolist()) == {0, 1}
    p = logits[0].softmax(-1)  # p0 = 0.636, p0 + p1 = 0.87: top_p 0.8 keeps tokens 0 and 1, top_p 0.5 only 0
    assert set(sample_next(logits, top_p=0.8, generator=g).unique().tolist()) == {0, 1}
    assert set(sample_next(logits, top_p=0.5, generator=g).unique().tolist()) == {0}
    freq = torch.bincount(sample_next(logits, generator=g)[:, 0], minlength=5).float() / 4000
    torch.testing.assert_close(freq, p, atol=0.03, rtol=0)
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, temperature=-1.0)


# ------------------------------------------------------------------------------- param report
@pytest.mark.parametrize("attention, tie", [("diff", True), ("standard", False)])
def test_param_report_closed_form(attention, tie):
    model = make(attention, n_kv_head=4, tie_embeddings=tie)
    E, L, V, F, d = 64, 3, 61, swiglu_hidden(64, 64), 8
    rep = model.param_report()
    kv = 4 * d  # 4 standard kv heads of dim 8 -> k, v are (32, E)
    attn = L * (2 * E * E + 2 * kv * E) + (L * 6 * d if attention == "diff" else 0)  # lambdas 4d + norm 2d
    assert rep["attention"] == attn
    assert rep["mlp"] == L * 3 * E * F
    assert rep["norm"] == (2 * L + 1) * E
    assert rep["embedding"] == V * E * (1 if tie else 2)
    assert rep["total"] == sum(p.numel() for p in model.parameters()) == rep["non_embedding"] + rep["embedding"]
    assert "non_embedding" in model.format_param_report()


#: parameter counts the DIFF paper advertises (name -> count)
PAPER_SIZES = {"830m": 830e6, "1.4b": 1.4e9, "2.8b": 2.8e9, "6.8b": 6.8e9, "13.1b": 13.1e9}


@pytest.mark.parametrize("size", sorted(PAPER_SIZES))
def test_paper_sizes_match_advertised_counts(size):
    with torch.device("meta"):
        model = DiffLM(LMConfig.from_name(f"diff-{size}"))
        twin = DiffLM(LMConfig.from_name(f"transformer-{size}"))
    total = model.param_report()["total"]
    assert abs(total / PAPER_SIZES[size] - 1) < 0.02, (size, total)
    assert 0 < total - twin.param_report()["total"] < 1e-4 * total  # only the lambdas and per-head norms differ


@pytest.mark.skipif("diff_v2" not in ATTENTION_LAYERS, reason="DIFF V2 layer not registered")
def test_other_registered_attention_builds_and_decodes():
    model = make("diff_v2", n_kv_head=4)
    idx = torch.randint(0, 61, (1, 10))
    with torch.no_grad():
        caches = model.new_kv_caches(10)
        inc = torch.cat([model(idx[:, :6], kv_caches=caches), model(idx[:, 6:], kv_caches=caches, start_pos=6)], 1)
    torch.testing.assert_close(inc, model(idx), atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["diff", "standard"])
def test_torch_compile_matches_eager(attention):
    """The whole model compiles in one graph (``fullgraph=True``; the attention ops are custom ops or plain torch);
    loss and gradients equal eager. ``aot_eager`` checks the tracing without building C++ kernels."""
    torch.manual_seed(0)
    model = DiffLM(LMConfig.from_name(f"{'diff' if attention == 'diff' else 'transformer'}-tiny"))
    idx = torch.randint(0, 256, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, :5] = False  # left padding: exercises the padding path too
    _, ref = model(idx, idx, attn_mask=mask)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for return_logits in (True, False):  # the fused head loss compiles as the plain formula
        _, loss = compiled(idx, idx, attn_mask=mask, return_logits=return_logits)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
