"""DiffAttention / Attention layers: peers (timm), KV cache, RoPE and construction errors."""
import math

import pytest
import torch
from timm.layers.diff_attention import DiffAttention as TimmDiffAttention

from diffmm.nn import (Attention, DiffAttention, KVCache, RMSNorm, RotaryEmbedding, create_attention,
                       lambda_init_depth)
from diffmm.nn.lambdas import lambda_full


def timm_twin(m: DiffAttention) -> TimmDiffAttention:
    """timm's DiffAttention carrying m's weights (fused qkv = [q; k; v], sub_norm = diff_norm, proj = out_proj)."""
    t = TimmDiffAttention(m.dim, m.num_heads, qkv_bias=m.q_proj.bias is not None, depth=m.layer_idx,
                          proj_bias=m.out_proj.bias is not None)
    t.lambda_init = m.lambda_init
    with torch.no_grad():
        t.qkv.weight.copy_(torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]))
        if m.q_proj.bias is not None:
            t.qkv.bias.copy_(torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias]))
        t.proj.weight.copy_(m.out_proj.weight)
        if m.out_proj.bias is not None:
            t.proj.bias.copy_(m.out_proj.bias)
        for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(t, n).copy_(getattr(m, n))
        t.sub_norm.weight.copy_(m.diff_norm.weight)
    return t


@pytest.mark.parametrize("lambda_init", ["depth", "constant"])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_timm_diff_attention(lambda_init, causal):
    m = DiffAttention(64, 2, layer_idx=3, lambda_init=lambda_init, qkv_bias=True, proj_bias=True)
    with torch.no_grad():
        m.diff_norm.weight.uniform_(0.5, 1.5)
    t = timm_twin(m)
    assert m.lambda_init == pytest.approx(0.8 if lambda_init == "constant" else 0.8 - 0.6 * math.exp(-0.9))
    x = torch.randn(2, 11, 64, requires_grad=True)
    ours = m(x, causal=causal)
    theirs = t(x, is_causal=causal)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ours)
    gx_ours, gq_ours, gl_ours = torch.autograd.grad((ours * g).sum(), (x, m.q_proj.weight, m.lambda_q1))
    gx_t, gqkv_t, gl_t = torch.autograd.grad((theirs * g).sum(), (x, t.qkv.weight, t.lambda_q1))
    torch.testing.assert_close(gx_ours, gx_t, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gq_ours, gqkv_t[:64], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gl_ours, gl_t, atol=1e-5, rtol=1e-4)


def test_lambda_init_schedule():
    assert [round(lambda_init_depth(i), 3) for i in range(3)] == [0.2, 0.356, 0.471]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lambda_full_matches_eager_formula(dtype):
    """lambda: value, dtype and gradients of ``exp(lq1.lk1) - exp(lq2.lk2) + lambda_init`` (arXiv 2410.05258)."""
    torch.manual_seed(0)
    vecs = [(torch.randn(16, dtype=torch.float64) * 0.3).to(dtype).requires_grad_() for _ in range(4)]
    ours = lambda_full(*vecs, 0.35)
    ct = torch.promote_types(dtype, torch.float32)
    assert ours.dtype == ct and ours.dim() == 0
    c = [t.to(ct) for t in vecs]
    want = torch.exp((c[0] * c[1]).sum()) - torch.exp((c[2] * c[3]).sum()) + 0.35
    torch.testing.assert_close(ours, want)
    g_ours = torch.autograd.grad(ours * 1.7, vecs)
    g_want = torch.autograd.grad(want * 1.7, vecs)
    for a, b in zip(g_ours, g_want):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda *v: lambda_full(*v, 0.8), vecs)


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_kv_cache_decoding_equals_full_forward(kind):
    torch.manual_seed(0)
    layer = create_attention(kind, 64, 8, num_kv_heads=4, causal=True, use_rope=True, layer_idx=1).eval()
    rope = RotaryEmbedding(layer.head_dim)
    x = torch.randn(2, 12, 64)
    with torch.no_grad():
        full = layer(x, rope=rope(torch.arange(12)))
        cache = KVCache(16)
        steps = [layer(x[:, :5], rope=rope(torch.arange(5)), kv_cache=cache)]  # prefill
        for t in range(5, 12):
            steps.append(layer(x[:, t:t + 1], rope=rope(torch.arange(t, t + 1)), kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_create_attention_halves_heads_for_diff():
    d = create_attention("diff", 96, 6, num_kv_heads=2)
    s = create_attention("standard", 96, 6, num_kv_heads=2)
    assert (d.num_heads, d.num_kv_heads, d.head_dim) == (3, 1, 16)
    assert (s.num_heads, s.num_kv_heads, s.head_dim) == (6, 2, 16)
    with pytest.raises(ValueError, match="unknown attention type 'nope'; expected one of standard, diff"):
        create_attention("nope", 96, 6)


@pytest.mark.parametrize("make,match", [
    (lambda: DiffAttention(100, 3), r"DiffAttention: width 100 is not divisible by 2 \* num_heads = 6"),
    (lambda: DiffAttention(96, 3, num_kv_heads=2), r"num_heads=3 is not divisible by num_kv_heads=2"),
    (lambda: DiffAttention(96, 4, head_dim=16), r"width 96 != 2 \* num_heads 4 \* head_dim 16"),
    (lambda: DiffAttention(90, 5, use_rope=True), r"RoPE needs an even head_dim; got 9"),
    (lambda: Attention(96, 5), r"Attention: width 96 is not divisible by num_heads 5"),
    (lambda: DiffAttention(64, 2, lambda_init="cosine"), r"lambda_init 'cosine' is unknown"),
])
def test_impossible_shapes_rejected(make, match):
    with pytest.raises(ValueError, match=match) as e:
        make()
    assert "\n" not in str(e.value)


def test_rope_without_tables_is_an_error():
    layer = DiffAttention(64, 2, use_rope=True)
    with pytest.raises(ValueError, match="forward needs rope"):
        layer(torch.randn(1, 3, 64))


def test_rmsnorm_matches_torch():
    x = torch.randn(3, 5, 16)
    ours = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_()
    ref = torch.nn.RMSNorm(16, eps=1e-5)
    ref.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), ref(x))
    torch.testing.assert_close(ours(x.bfloat16()).float(), ref(x), atol=2e-2, rtol=2e-2)


def test_padding_mask_through_layer_matches_dropping_keys():
    """A padded key must not influence the output: same as running without those positions."""
    layer = DiffAttention(64, 2).eval()
    x = torch.randn(1, 7, 64)
    mask = torch.tensor([[True] * 5 + [False] * 2])
    with torch.no_grad():
        padded = layer(x, attn_mask=mask)[:, :5]
        trimmed = layer(x[:, :5])
    torch.testing.assert_close(padded, trimmed, atol=1e-6, rtol=1e-5)
