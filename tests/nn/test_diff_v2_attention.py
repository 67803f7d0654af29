"""DiffV2Attention against an eager float64 layer written from the DIFF V2 formula (unilm's Diff-Transformer-V2);
KV-cache decoding; factory and parameter accounting."""
import math

import pytest
import torch

from diffmm.nn import DiffV2Attention, KVCache, RotaryEmbedding, create_attention
from diffmm.nn.param_count import attention_param_report


def rope_eager(x, pos, theta=10000.0):
    """NeoX (rotate-half) RoPE on x (B, N, H, d) at integer positions (N,)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]  # (N, d/2)
    c, s = ang.cos()[None, :, None].to(x.dtype), ang.sin()[None, :, None].to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def layer_eager(m, x, *, causal, pad=None, rope_pos=None):
    """DIFF V2 from the layer's weights, head by head."""
    B, N, _ = x.shape
    h, hk, d = m.num_heads, m.num_kv_heads, m.head_dim
    lin = lambda p, t: t @ p.weight.T + (p.bias if p.bias is not None else 0)  # noqa: E731
    q = lin(m.q_proj, x).view(B, N, 2 * h, d)
    k = lin(m.k_proj, x).view(B, N, hk, d)
    v = lin(m.v_proj, x).view(B, N, hk, d)
    if rope_pos is not None:
        q, k = rope_eager(q, rope_pos), rope_eager(k, rope_pos)
    lam = torch.sigmoid(x @ m.lambda_proj.weight.T)  # (B, N, h)
    group = 2 * h // hk
    heads = []
    for i in range(h):
        o = []
        for j in (2 * i, 2 * i + 1):
            s = torch.einsum("bnd,bsd->bns", q[:, :, j], k[:, :, j // group]) / math.sqrt(d)
            if causal:
                s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
            if pad is not None:
                s = s.masked_fill(~pad[:, None, :], float("-inf"))
            o.append(torch.softmax(s, -1) @ v[:, :, j // group])
        heads.append(o[0] - lam[..., i:i + 1] * o[1])
    return lin(m.out_proj, torch.cat(heads, dim=-1))


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("h,hkv", [(2, 2), (4, 2)])  # 2h/h_kv in {2, 4}
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_layer_matches_eager_fp64(backend, h, hkv, causal, padding):
    torch.manual_seed(0)
    B, N, d = 2, 6, 8
    m = DiffV2Attention(h * d, h, num_kv_heads=hkv, qkv_bias=True, proj_bias=True, use_rope=True,
                        causal=causal, backend=backend).double()
    x = torch.randn(B, N, h * d, dtype=torch.float64, requires_grad=True)
    pad = None
    if padding:
        pad = torch.ones(B, N, dtype=torch.bool)
        pad[0, -2:] = False
    pos = torch.arange(N)
    rope = RotaryEmbedding(d)(pos, dtype=torch.float64)
    out = m(x, rope=rope, attn_mask=pad)
    ref = layer_eager(m, x, causal=causal, pad=pad, rope_pos=pos)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)  # RoPE tables are fp32 by design
    w = torch.randn_like(out)
    params = [x, *m.parameters()]
    got = torch.autograd.grad((out * w).sum(), params)
    want = torch.autograd.grad((ref * w).sum(), params)
    names = ["x", *(n for n, _ in m.named_parameters())]
    for a, b, n in zip(got, want, names):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"grad of {n}")


def test_layer_matches_eager_fp64_no_rope_exact():
    torch.manual_seed(1)
    m = DiffV2Attention(32, 4, num_kv_heads=1, causal=True).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(m(x), layer_eager(m, x, causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hkv", [4, 2])
def test_kv_cache_decoding_equals_full_forward(hkv):
    torch.manual_seed(2)
    B, N, h, d = 2, 11, 4, 16
    m = DiffV2Attention(h * d, h, num_kv_heads=hkv, use_rope=True, causal=True)
    x = torch.randn(B, N, h * d)
    rot = RotaryEmbedding(d)
    full = m(x, rope=rot(torch.arange(N)))
    cache = KVCache(max_len=N)
    steps = [m(x[:, :5], rope=rot(torch.arange(5)), kv_cache=cache)]  # prefill 5, then one token at a time
    for t in range(5, N):
        steps.append(m(x[:, t:t + 1], rope=rot(torch.arange(t, t + 1)), kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_factory_width_conventions():
    m = create_attention("diff_v2", 512, 8, num_kv_heads=2, causal=True)
    assert isinstance(m, DiffV2Attention)
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (8, 2, 64)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"q_proj.weight": (1024, 512), "k_proj.weight": (128, 512), "v_proj.weight": (128, 512),
                      "lambda_proj.weight": (8, 512), "out_proj.weight": (512, 512)}
    std = create_attention("standard", 512, 8, num_kv_heads=2)
    assert (std.num_heads, std.head_dim) == (m.num_heads, m.head_dim)  # same heads, same out_proj as baseline


def test_ignored_v1_kwargs_and_bad_heads():
    m = DiffV2Attention(64, 4, layer_idx=3, lambda_init="depth", norm_eps=1e-6, lambda_std=0.1)
    assert m.head_dim == 16
    with pytest.raises(ValueError, match="even group size") as e:
        DiffV2Attention(96, 3, num_kv_heads=2)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="needs rope"):
        DiffV2Attention(64, 4, use_rope=True)(torch.randn(1, 3, 64))


@pytest.mark.parametrize("dim,heads,kv", [(512, 8, 8), (768, 12, 4), (64, 4, 2)])
def test_param_report_matches_closed_form(dim, heads, kv):
    rows = {r["attn_type"]: r for r in attention_param_report(dim, heads, kv)}
    d = dim // heads
    std = 2 * dim * dim + 2 * dim * kv * d
    assert rows["standard"]["params"] == std
    assert rows["diff"]["params"] == std + 6 * d
    assert rows["diff_v2"]["params"] == 3 * dim * dim + 2 * dim * kv * d + dim * heads
    assert rows["diff_v2"]["vs_standard"] == pytest.approx(rows["diff_v2"]["params"] / std)


def test_param_report_marks_unbuildable_types():
    rows = {r["attn_type"]: r for r in attention_param_report(64, 4, 1)}  # V1 cannot halve 1 kv head
    assert rows["diff"]["params"] is None and "divisible by 2" in rows["diff"]["note"]
    assert rows["diff_v2"]["params"] == 3 * 64 * 64 + 2 * 64 * 16 + 64 * 4
