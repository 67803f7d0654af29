"""A new attention variant is one class: :class:`ToyAttention` below is defined once, then built from configs,
swapped into DiffCLIP, open_clip, timm and Hugging Face BERT models, upcycled, captured and counted, with no other
file knowing about it."""
from __future__ import annotations

from typing import Optional

import open_clip
import pytest
import timm
import torch
import torch.nn as nn
from open_clip.model import CLIP

import diffmm
from diffmm.eval.attention_capture import AttentionRecorder
from diffmm.models.timm_models import timm_attn_layer
from diffmm.nn import ATTENTION_LAYERS, UPCYCLE_TYPES, AttentionLayer, QKMaps, StdAttnWeights, create_attention
from diffmm.nn.param_count import attention_param_report
from diffmm.ops import attention

D = torch.float64
TOL = dict(atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ the whole variant
class ToyAttention(AttentionLayer, attn_type="toy"):
    """Softmax attention with a learnable temperature per head: ``softmax(tau_i q k^T / sqrt(d)) V``.

    With tau = 1 it is standard attention, so it can reproduce a pretrained layer exactly (``load_standard``).
    """

    def __init__(self, dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, layer_idx: int = 0, qkv_bias: bool = False, proj_bias: bool = False,
                 causal: bool = False, use_rope: bool = False, backend: Optional[str] = None, **unused):
        super().__init__()
        self.dim, self.num_heads, self.num_kv_heads = dim, num_heads, num_kv_heads or num_heads
        self.head_dim = head_dim or dim // num_heads
        self.layer_idx, self.causal, self.use_rope, self.backend = layer_idx, causal, use_rope, backend
        H, Hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(dim, H * d, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, Hk * d, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, Hk * d, bias=qkv_bias)
        self.out_proj = nn.Linear(H * d, dim, bias=proj_bias)
        self.tau = nn.Parameter(torch.full((H,), 1.5))

    def forward(self, x, *, attn_mask=None, rope=None, kv_cache=None, causal=None):
        B, N, _ = x.shape
        q, k = self.capture(x, rope)[:2]  # (B, N, H, d) with tau folded in, (B, N, Hk, d)
        v = self.v_proj(x).view(B, N, self.num_kv_heads, self.head_dim)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        out = attention(q, k, v, causal=self.causal if causal is None else causal, attn_mask=attn_mask,
                        backend=self.backend)  # (B, N, H, d)
        return self.out_proj(out.reshape(B, N, -1))

    @torch.no_grad()
    def load_standard(self, w: StdAttnWeights, *, generator=None) -> None:
        self.to(torch.promote_types(w.wq.dtype, torch.float32))
        for lin, wt, b in ((self.q_proj, w.wq, w.bq), (self.k_proj, w.wk, w.bk), (self.v_proj, w.wv, w.bv),
                           (self.out_proj, w.wo, w.bo)):
            lin.weight.copy_(wt)
            if b is not None:
                lin.bias.copy_(b)
        self.tau.fill_(1.0)

    def capture(self, x, rope=None) -> QKMaps:
        q, k = self.project_qk(x, rope, self.num_heads, self.num_kv_heads)
        H = self.num_heads
        return QKMaps(q * self.tau[:, None].to(q.dtype), k,
                      torch.arange(H, device=x.device) // (H // self.num_kv_heads))
# ------------------------------------------------------------------------------------------------------------


def _reference(m: ToyAttention, x: torch.Tensor) -> torch.Tensor:
    """float64 reference of the toy layer's forward (no mask)."""
    B, N, _ = x.shape
    H, d = m.num_heads, m.head_dim
    q, k, v = (p(x).view(B, N, H, d).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    a = torch.softmax(m.tau[:, None, None] * (q @ k.transpose(-1, -2)) / d ** 0.5, dim=-1)
    return m.out_proj((a @ v).transpose(1, 2).reshape(B, N, H * d))


def test_registered_built_and_matches_reference_forward_and_backward():
    assert ATTENTION_LAYERS["toy"] is ToyAttention and UPCYCLE_TYPES["toy"] == "toy"
    m = create_attention("toy", 32, 4, qkv_bias=True).to(D)
    assert (m.num_heads, m.head_dim, m.query_maps) == (4, 8, 4)
    x = torch.randn(2, 5, 32, dtype=D, requires_grad=True)
    out, ref = m(x), _reference(m, x)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, m.tau), g)
    torch.testing.assert_close(grads, torch.autograd.grad(ref, (x, m.tau), g))


def test_parameter_count():
    rows = {r["attn_type"]: r for r in attention_param_report(64, 8, attn_types=("standard", "toy"))}
    assert rows["toy"]["params"] == rows["standard"]["params"] + 8  # one temperature per head
    assert rows["toy"]["breakdown"]["tau"] == 8 and rows["toy"]["query_maps"] == 8 and rows["toy"]["heads"] == 8


def test_capture_reproduces_the_layer():
    m = create_attention("toy", 32, 4, causal=True).to(D)
    x = torch.randn(2, 6, 32, dtype=D)
    with AttentionRecorder(m) as rec:
        out = m(x)
    (r,) = rec.records
    assert r.kind == "standard" and r.maps().shape == (2, 4, 6, 6)
    v = m.v_proj(x).view(2, 6, 4, 8).transpose(1, 2)
    torch.testing.assert_close(m.out_proj((r.maps() @ v).transpose(1, 2).reshape(2, 6, 32)), out)
    assert float(r.maps()[:, :, 0, 1:].abs().max()) == 0.0  # causal


OC_CFG = dict(embed_dim=48, vision_cfg=dict(image_size=32, patch_size=8, width=64, layers=2, head_width=16),
              text_cfg=dict(context_length=16, vocab_size=49408, width=64, heads=4, layers=2))


def _clip_features(model, img, txt):
    with torch.no_grad():
        return model.encode_image(img), model.encode_text(txt)


def test_open_clip_upcycle_capture_and_train():
    torch.manual_seed(0)
    model = CLIP(**OC_CFG).eval()
    img, txt = torch.randn(2, 3, 32, 32), open_clip.tokenizer.SimpleTokenizer(context_length=16)(["a cat", "dogs"])
    ref = _clip_features(model, img, txt)
    diffmm.swap_attention(model, attn_type="toy", init="upcycle")
    layers = [b.attn for b in model.visual.transformer.resblocks] + [b.attn for b in model.transformer.resblocks]
    assert all(type(a).__name__ == "MHAToyAttention" and isinstance(a, ToyAttention) for a in layers)
    for a, b in zip(_clip_features(model, img, txt), ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    with AttentionRecorder(model) as rec, torch.no_grad():
        model.encode_text(txt)
    assert len(rec.records) == 2 and rec.records[0].valid()[0, 0].equal(torch.ones(16, 16, dtype=torch.bool).tril())
    model.encode_image(img).square().mean().backward()
    assert all(a.tau.grad is not None and a.tau.grad.abs().sum() > 0 for a in layers[:2])


def test_timm_vit_swap_and_attn_layer():
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=0,
                            depth=2).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = vit(x)
        diffmm.swap_attention(vit, attn_type="toy", init="upcycle")
        assert all(type(b.attn).__name__ == "TimmToyAttention" for b in vit.blocks)
        torch.testing.assert_close(vit(x), ref, **TOL)
    built = timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                                          num_classes=0, attn_layer=timm_attn_layer("toy"))
    assert isinstance(built.blocks[0].attn, ToyAttention) and built.blocks[0].attn.num_heads == 4
    assert built(x).shape == (2, 64)


def test_hf_bert_swap():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=16)
    bert = transformers.BertModel._from_config(cfg, attn_implementation="sdpa").eval()
    ids, mask = torch.randint(1, 60, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    with torch.no_grad():
        ref = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        diffmm.swap_attention(bert, attn_type="toy", init="upcycle")
        assert all(type(layer.attention.self).__name__ == "HFBertToyAttention" for layer in bert.encoder.layer)
        torch.testing.assert_close(bert(input_ids=ids, attention_mask=mask).last_hidden_state, ref, **TOL)


def test_diffclip_from_config_and_swapped():
    torch.manual_seed(0)
    model = diffmm.create_model("DiffCLIP-Tiny", vision_cfg=dict(attn_type="toy"), text_cfg=dict(attn_type="toy"))
    assert all(type(b.attn) is ToyAttention for b in model.visual.blocks)
    img = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert model.encode_image(img).isfinite().all()
    clip = diffmm.create_model("CLIP-Tiny").eval()
    with torch.no_grad():
        ref = clip.encode_image(img)
        diffmm.swap_attention(clip, attn_type="toy", init="upcycle", towers="visual")
        torch.testing.assert_close(clip.encode_image(img), ref, **TOL)
    assert clip.config.vision_cfg.attn_type == "toy" and clip.config.text_cfg.attn_type == "standard"
