"""The recorder's recomputed attention maps reproduce each supported layer's own output."""
from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import diffmm
from diffmm.eval.attention_capture import AttentionRecorder
from diffmm.nn import Attention, DiffAttention, RotaryEmbedding

D = torch.float64


def _one(model, *args, **kwargs):
    with AttentionRecorder(model) as rec:
        out = model(*args, **kwargs)
    assert len(rec.records) == 1
    return out, rec.records[0]


@pytest.mark.parametrize("causal,pad", [(False, False), (True, False), (True, True)])
def test_diffmm_diff_attention_gqa_rope(causal, pad):
    B, N, E, h, hk = 2, 7, 48, 4, 2
    m = DiffAttention(E, h, num_kv_heads=hk, use_rope=True, causal=causal, layer_idx=2).to(D)
    x = torch.randn(B, N, E, dtype=D)
    rope = RotaryEmbedding(E // (2 * h))(torch.arange(N))
    mask = torch.ones(B, N, dtype=torch.bool)
    if pad:
        mask[1, :2] = False
    out, r = _one(m, x, rope=rope, attn_mask=mask if pad else None)
    assert r.kind == "diff" and r.maps().shape == (B, h, N, N)
    d = m.head_dim
    v = m.v_proj(x).view(B, N, hk, 2 * d).transpose(1, 2).repeat_interleave(h // hk, dim=1)  # (B, h, N, 2d)
    heads = r.maps() @ v  # (B, h, N, 2d)
    heads = m.diff_norm(heads) * (1 - m.lambda_init)
    rebuilt = m.out_proj(heads.transpose(1, 2).reshape(B, N, E))
    torch.testing.assert_close(rebuilt, out, rtol=1e-9, atol=1e-9)
    if causal:
        assert float(r.maps()[0, :, 0, 1:].abs().max()) == 0.0


def test_diffmm_standard_gqa_and_v2():
    from diffmm.nn import DiffV2Attention

    B, N, E = 2, 6, 32
    m = Attention(E, 4, num_kv_heads=2, causal=True).to(D)
    x = torch.randn(B, N, E, dtype=D)
    out, r = _one(m, x)
    v = m.v_proj(x).view(B, N, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    torch.testing.assert_close(m.out_proj((r.maps() @ v).transpose(1, 2).reshape(B, N, E)), out)
    m2 = DiffV2Attention(E, 2, num_kv_heads=2, causal=True).to(D)
    out, r = _one(m2, x)
    assert r.kind == "diff_v2"
    h, hk, d = m2.num_heads, m2.num_kv_heads, m2.head_dim
    v = m2.v_proj(x).view(B, N, hk, d).transpose(1, 2)  # (B, hk, N, d); head i uses kv group 2i // (2h / hk)
    v = v[:, torch.arange(h) * 2 // (2 * h // hk)]
    heads = r.maps() @ v
    torch.testing.assert_close(m2.out_proj(heads.transpose(1, 2).reshape(B, N, h * d)), out)


def test_torch_mha_matches_need_weights():
    B, N, E = 2, 5, 16
    m = nn.MultiheadAttention(E, 4, batch_first=True).to(D).eval()
    x = torch.randn(B, N, E, dtype=D)
    causal = torch.full((N, N), float("-inf"), dtype=D).triu(1)
    with AttentionRecorder(m) as rec:
        _, w = m(x, x, x, need_weights=True, average_attn_weights=False, attn_mask=causal)
    torch.testing.assert_close(rec.records[0].maps(), w)


def test_open_clip_attention_and_vit():
    from open_clip.transformer import Attention as OCAttention
    from eval_helpers import tiny_open_clip

    B, N, E = 2, 5, 16
    m = OCAttention(E, 4).to(D).eval()
    x = torch.randn(B, N, E, dtype=D)
    out, r = _one(m, x)
    q, k, v = F.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
    v = v.view(B, N, 4, 4).transpose(1, 2)
    torch.testing.assert_close(m.out_proj((r.maps() @ v).transpose(1, 2).reshape(B, N, E)), out)
    # a whole open_clip CLIP: one record per block of each tower, text records causal
    model, tok = tiny_open_clip()
    with AttentionRecorder(model) as rec:
        model.encode_image(torch.randn(1, 3, 32, 32))
        model.encode_text(tok(["a cat"]))
    assert [x.name for x in rec.records] == ["visual.transformer.resblocks.0.attn", "transformer.resblocks.0.attn"]
    valid = rec.records[1].valid()[0, 0]
    assert torch.equal(valid, torch.ones_like(valid).tril())


@pytest.mark.parametrize("diff", [False, True])
def test_timm_attention(diff):
    from timm.layers import Attention as TA
    from timm.layers import DiffAttention as TDA

    B, N, E = 2, 5, 32
    m = (TDA(E, num_heads=2, qkv_bias=True, depth=1) if diff else TA(E, num_heads=4, qkv_bias=True)).to(D).eval()
    m.fused_attn = False
    x = torch.randn(B, N, E, dtype=D)
    out, r = _one(m, x)
    if diff:
        v = m.qkv(x).chunk(3, dim=2)[2].reshape(B, N, 2, 16).transpose(1, 2)
        heads = m.sub_norm(r.maps() @ v) * (1 - m.lambda_init)
    else:
        v = m.qkv(x).reshape(B, N, 3, 4, 8).permute(2, 0, 3, 1, 4)[2]
        heads = r.maps() @ v
    torch.testing.assert_close(m.proj(m.norm(heads.transpose(1, 2).reshape(B, N, E))), out)


def test_diffclip_records_every_block():
    if "DiffCLIP-Tiny" not in diffmm.list_models():
        pytest.skip("no DiffCLIP-Tiny config yet")
    model = diffmm.create_model("DiffCLIP-Tiny").eval()
    with AttentionRecorder(model, include=lambda n: n.startswith("visual")) as rec, torch.no_grad():
        model.encode_image(torch.randn(1, 3, 64, 64))
    assert len(rec.records) == model.config.vision_cfg.layers
    assert all(r.kind == "diff" and r.maps().shape[-1] == 65 for r in rec.records)


def test_swapped_layers_are_recorded_with_their_callers_masks():
    """A swapped diffmm layer is called in another library's convention (timm ``is_causal``, Hugging Face's prepared
    padding mask); the recorder reads the call through the layer's ``native_args``, so the maps see those masks."""
    torch.manual_seed(0)
    vit = timm.models.VisionTransformer(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=4, num_classes=0)
    diffmm.swap_attention(vit, attn_type="diff")
    with AttentionRecorder(vit) as rec, torch.no_grad():
        vit.forward_features(torch.randn(1, 3, 16, 16), is_causal=True)
    (r,) = rec.records
    assert r.kind == "diff" and torch.equal(r.valid()[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())

    cfg = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64)
    bert = transformers.BertModel._from_config(cfg, attn_implementation="sdpa").eval()
    diffmm.swap_attention(bert, attn_type="diff_v2", init="upcycle")
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    with AttentionRecorder(bert) as rec, torch.no_grad():
        bert(input_ids=torch.randint(1, 60, (2, 6)), attention_mask=mask)
    (r,) = rec.records
    assert r.kind == "diff_v2" and r.maps().shape == (2, 4, 6, 6)
    assert float(r.probs()[1, :, :, 4:].abs().max()) == 0.0  # padded keys get no attention
