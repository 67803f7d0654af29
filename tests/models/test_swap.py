"""swap_attention: scratch and function-preserving upcycling on open_clip CLIPs, timm ViTs and DiffCLIP."""
from __future__ import annotations

import copy
import math
import pickle
from functools import partial

import open_clip
import pytest
import timm
import torch
import torch.nn as nn
from open_clip.model import CLIP, CustomTextCLIP

import diffmm
from diffmm.models.attn_adapters import MHAUpcycledDiffAttention
from diffmm.models.swap import replacement_layer
from diffmm.models.timm_models import set_layer_depths, timm_attn_layer
from diffmm.nn import DiffAttention, DiffV2Attention, UpcycledDiffAttention

OC_CFG = dict(embed_dim=48, vision_cfg=dict(image_size=32, patch_size=8, width=64, layers=2, head_width=16),
              text_cfg=dict(context_length=16, vocab_size=49408, width=64, heads=4, layers=2))
CAPTIONS = ["a cat", "two dogs running on the grass", "x", "a red apple on a table"]
TOL = dict(atol=1e-4, rtol=1e-4)


def tokens(n: int = 16) -> torch.Tensor:
    return open_clip.tokenizer.SimpleTokenizer(context_length=n)(CAPTIONS)


def features(model, img, txt):
    with torch.no_grad():
        return model.encode_image(img), model.encode_text(txt)


def new_param_slices(layer: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of the parts of an upcycled layer that the pretrained layer did not have."""
    g = {n: p.grad for n, p in layer.named_parameters()}
    if isinstance(layer, UpcycledDiffAttention):
        h, d = layer.num_heads, layer.head_dim
        q = g["q_proj.weight"].view(h, 2, d, -1)
        k = g["k_proj.weight"].view(h, 2, d, -1)
        v = g["v_proj.weight"].view(h, 2, d, -1)
        o = g["out_proj.weight"].view(-1, h, 2, d)
        return {"q component 2": q[:, 1], "k component 2": k[:, 1], "value half 2": v[:, 1],
                "out cols half 2": o[:, :, 1], **{n: g[n] for n in ("lambda_q1", "lambda_k1", "lambda_q2",
                                                                   "lambda_k2", "norm_gate")}}
    if isinstance(layer, DiffV2Attention):
        h, d = layer.num_heads, layer.head_dim
        return {"q map 2i+1": g["q_proj.weight"].view(h, 2, d, -1)[:, 1], "lambda_proj": g["lambda_proj.weight"]}
    return {}


def check_new_params_get_gradients(model: nn.Module, loss_fn, layers: list[nn.Module]):
    """Every new parameter gets a non-zero gradient at step 0, except the gated norm weight, which gets one after
    one optimiser step (once the gate has moved)."""
    model.zero_grad()
    loss_fn().backward()
    for li, layer in enumerate(layers):
        for name, grad in new_param_slices(layer).items():
            assert grad is not None and grad.abs().sum() > 0, f"layer {li}: no gradient for {name}"
        if isinstance(layer, UpcycledDiffAttention):
            assert layer.diff_norm.weight.grad.abs().sum() == 0  # gated by norm_gate = 0 at step 0
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    model.zero_grad()
    loss_fn().backward()
    for li, layer in enumerate(layers):
        if isinstance(layer, UpcycledDiffAttention):
            assert layer.diff_norm.weight.grad.abs().sum() > 0, f"layer {li}: norm weight still without gradient"


def clip_loss(model, img, txt):
    i, t = model.encode_image(img, normalize=True), model.encode_text(txt, normalize=True)
    logits = 10 * i @ t.T
    labels = torch.arange(len(i))
    return nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.T, labels)


@pytest.mark.parametrize("attn_type,lambda_init", [("diff", "constant"), ("diff", "depth"), ("diff_v2", "constant"),
                                                   ("standard", "constant")])
def test_upcycle_open_clip_keeps_features_and_trains(attn_type, lambda_init):
    torch.manual_seed(0)
    model = CLIP(**OC_CFG).eval()
    img, txt = torch.randn(4, 3, 32, 32), tokens()
    ref = features(model, img, txt)
    diffmm.swap_attention(model, init="upcycle", attn_type=attn_type, lambda_init=lambda_init)
    layers = [b.attn for b in model.visual.transformer.resblocks] + [b.attn for b in model.transformer.resblocks]
    if attn_type == "diff":
        assert all(isinstance(a, UpcycledDiffAttention) for a in layers)
    for a, b in zip(features(model, img, txt), ref):
        torch.testing.assert_close(a, b, **TOL)
    check_new_params_get_gradients(model, lambda: clip_loss(model, img, txt), layers)


def test_scratch_swap_changes_features_and_uses_paper_layer():
    torch.manual_seed(0)
    model = CLIP(**OC_CFG).eval()
    img, txt = torch.randn(4, 3, 32, 32), tokens()
    ref = features(model, img, txt)
    diffmm.swap_attention(model, init="scratch", towers="visual", layers=[-1])
    blocks = model.visual.transformer.resblocks
    assert isinstance(blocks[1].attn, DiffAttention) and not isinstance(blocks[1].attn, UpcycledDiffAttention)
    assert blocks[1].attn.num_heads == 2 and isinstance(blocks[0].attn, nn.MultiheadAttention)
    assert isinstance(model.transformer.resblocks[0].attn, nn.MultiheadAttention)
    img_f, txt_f = features(model, img, txt)
    torch.testing.assert_close(txt_f, ref[1])
    assert (img_f - ref[0]).abs().max() > 1e-3
    assert model.diffmm_swaps == [{"tower": "visual", "layers": [1], "init": "scratch", "attn_type": "diff",
                                   "lambda_init": "constant"}]


def test_upcycle_custom_text_clip_with_open_clip_attention():
    torch.manual_seed(0)
    cfg = copy.deepcopy(OC_CFG)
    cfg["vision_cfg"]["block_type"] = "custom"
    cfg["text_cfg"]["block_type"] = "custom"
    model = CustomTextCLIP(**cfg).eval()
    img, txt = torch.randn(4, 3, 32, 32), tokens()
    ref = features(model, img, txt)
    diffmm.swap_attention(model, init="upcycle")
    assert isinstance(model.text.transformer.resblocks[0].attn, UpcycledDiffAttention)
    for a, b in zip(features(model, img, txt), ref):
        torch.testing.assert_close(a, b, **TOL)


def test_upcycle_open_clip_with_timm_tower():
    torch.manual_seed(0)
    cfg = dict(embed_dim=32, vision_cfg=dict(timm_model_name="test_vit", image_size=160, timm_pool="token",
                                             timm_proj="linear"),
               text_cfg=dict(context_length=16, vocab_size=49408, width=64, heads=4, layers=1))
    model = CLIP(**cfg).eval()
    img, txt = torch.randn(2, 3, 160, 160), tokens()[:2]
    ref = features(model, img, txt)
    diffmm.swap_attention(model, init="upcycle", towers="visual")
    layers = [b.attn for b in model.visual.trunk.blocks]
    assert all(isinstance(a, UpcycledDiffAttention) for a in layers)
    for a, b in zip(features(model, img, txt), ref):
        torch.testing.assert_close(a, b, **TOL)
    check_new_params_get_gradients(model, lambda: clip_loss(model, img, txt), layers)


@pytest.mark.parametrize("attn_type", ["diff", "diff_v2"])
def test_upcycle_timm_vit(attn_type):
    torch.manual_seed(0)
    vit = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=3,
                                                          num_heads=4, num_classes=10).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ref = vit(x)
    diffmm.swap_attention(vit, init="upcycle", attn_type=attn_type)
    with torch.no_grad():
        torch.testing.assert_close(vit(x), ref, **TOL)
    layers = [b.attn for b in vit.blocks]
    check_new_params_get_gradients(vit, lambda: vit(x).square().mean(), layers)
    # a timm mask / causal call reaches the swapped layer
    with torch.no_grad():
        keep = torch.ones(3, 1, 17, 17, dtype=torch.bool)
        torch.testing.assert_close(vit.forward_features(x, attn_mask=keep), vit.forward_features(x))
        assert (vit.forward_features(x, is_causal=True) - vit.forward_features(x)).abs().max() > 1e-4


def test_mha_masks_match_original():
    """Key padding and bool / additive / per-head masks through the nn.MultiheadAttention adapter."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    layer = replacement_layer(mha, attn_type="diff", init="upcycle")
    assert type(layer) is MHAUpcycledDiffAttention and not layer.training
    x = torch.randn(2, 5, 32)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    per_head = torch.zeros(2 * 4, 5, 5).masked_fill(causal, float("-inf"))
    with torch.no_grad():
        additive = torch.zeros(5, 5).masked_fill(causal, float("-inf"))
        kpm_additive = torch.zeros(2, 5).masked_fill(kpm, float("-inf"))
        for kw in ({}, {"key_padding_mask": kpm}, {"attn_mask": causal}, {"attn_mask": per_head},
                   {"attn_mask": additive, "key_padding_mask": kpm_additive}):
            torch.testing.assert_close(layer(x, x, x, need_weights=False, **kw)[0],
                                       mha(x, x, x, need_weights=False, **kw)[0], **TOL)
    with pytest.raises(ValueError, match="only self-attention"):
        layer(x, torch.randn(2, 5, 32), x)


def test_swap_on_diffclip_then_export_reloads(tmp_path):
    torch.manual_seed(0)
    model = diffmm.create_model("CLIP-Tiny", vision_cfg={"image_size": 32}).eval()
    img, txt = torch.randn(2, 3, 32, 32), tokens(32)[:2]
    ref = features(model, img, txt)
    diffmm.swap_attention(model, init="upcycle", towers=("visual", "text"), layers={"visual": [0, 1], "text": None})
    assert model.config.vision_cfg.attn_type == ["diff_upcycled", "diff_upcycled", "standard", "standard"]
    assert model.config.text_cfg.attn_type == "diff_upcycled"
    for a, b in zip(features(model, img, txt), ref):
        torch.testing.assert_close(a, b, **TOL)

    model.save_pretrained(tmp_path / "exp")
    back = diffmm.load_pretrained(tmp_path / "exp")
    for a, b in zip(features(back, img, txt), features(model, img, txt)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_swap_errors_are_clear():
    vit = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2,
                                                          num_heads=4, num_classes=0)
    with pytest.raises(ValueError, match="has no text tower; it has: visual"):
        diffmm.swap_attention(vit, towers=["visual", "text"])
    with pytest.raises(IndexError, match="layer 5 is out of range for the visual tower"):
        diffmm.swap_attention(vit, layers=[5])
    with pytest.raises(ValueError, match="init 'warm'"):
        diffmm.swap_attention(vit, init="warm")
    diffmm.swap_attention(vit, init="scratch")
    with pytest.raises(TypeError, match="not a standard self-attention layer"):
        diffmm.swap_attention(vit, init="upcycle")  # already differential
    qk = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=1,
                                                         num_heads=4, qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm cannot be swapped"):
        diffmm.swap_attention(qk)


def test_resnet_clip_swaps_its_text_tower_only():
    torch.manual_seed(0)
    rn = CLIP(embed_dim=32, vision_cfg=dict(image_size=32, layers=(1, 1, 1, 1), width=16, head_width=16),
              text_cfg=OC_CFG["text_cfg"]).eval()
    img, txt = torch.randn(2, 3, 32, 32), tokens()
    ref = features(rn, img, txt)
    visual, fresh = copy.deepcopy(rn.visual.state_dict()), copy.deepcopy(rn)
    with pytest.raises(TypeError, match="visual tower ModifiedResNet has no Transformer blocks to swap"):
        diffmm.swap_attention(rn, towers="visual")
    diffmm.swap_attention(rn, towers="text", init="upcycle")
    assert all(isinstance(b.attn, UpcycledDiffAttention) for b in rn.transformer.resblocks)
    assert all(torch.equal(v, rn.visual.state_dict()[k]) for k, v in visual.items())  # the image tower untouched
    for a, b in zip(features(rn, img, txt), ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    diffmm.swap_attention(fresh, attn_type="diff_v2")  # default towers: those with blocks, the text tower
    assert all(isinstance(b.attn, DiffV2Attention) for b in fresh.transformer.resblocks)
    assert [r["tower"] for r in fresh.diffmm_swaps] == ["text"]


def test_timm_attn_layer_standard_matches_timm_attention():
    from diffmm.hub.clip_convert import timm_vit_to_diffmm

    torch.manual_seed(0)
    kw = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=0,
              norm_layer=partial(nn.LayerNorm, eps=1e-6))
    ref = timm.models.vision_transformer.VisionTransformer(**kw).eval()
    ours = timm.models.vision_transformer.VisionTransformer(**kw, attn_layer=timm_attn_layer("standard")).eval()
    ours.load_state_dict(timm_vit_to_diffmm(ref.state_dict(), prefix="", drop_head=False), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.forward_features(x, is_causal=True), ref.forward_features(x, is_causal=True),
                                   atol=1e-5, rtol=1e-5)


def test_timm_attn_layer_depth_lambda_init_and_backend_set_after_building():
    """timm builds attn_layer with its own arguments; set_layer_depths gives depth, lambda_init and backend."""
    vit = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=3,
                                                          num_heads=4, num_classes=0, attn_layer=timm_attn_layer())
    assert all(b.attn.layer_idx == 0 for b in vit.blocks)  # timm passes no depth to a non-timm DiffAttention
    set_layer_depths(vit)
    assert [b.attn.lambda_init for b in vit.blocks] == pytest.approx([0.8 - 0.6 * math.exp(-0.3 * i) for i in range(3)])
    set_layer_depths(vit, lambda_init=0.5, backend="reference")
    assert all(b.attn.lambda_init == 0.5 and b.attn.backend == "reference" for b in vit.blocks)
    with pytest.raises(ValueError, match="does not support qk_norm"):
        timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=1,
                                                         num_heads=4, qk_norm=True, attn_layer=timm_attn_layer())


def _oc_custom_clip():
    cfg = copy.deepcopy(OC_CFG)
    cfg["vision_cfg"]["block_type"] = "custom"
    return CustomTextCLIP(**cfg)


@pytest.mark.parametrize("build, attn_type", [(lambda: CLIP(**OC_CFG), "diff"), (_oc_custom_clip, "diff_v2"),
                                              (lambda: diffmm.create_model("CLIP-Tiny"), "diff"),
                                              (lambda: timm.models.vision_transformer.VisionTransformer(
                                                  img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4),
                                               "standard")])
def test_swapped_model_pickles_whole(build, attn_type):
    """The swapped-in layers are module-level classes built as such (no class surgery): the whole model pickles."""
    torch.manual_seed(0)
    model = build().eval()
    diffmm.swap_attention(model, init="upcycle", attn_type=attn_type, generator=torch.Generator().manual_seed(0))
    back = pickle.loads(pickle.dumps(model))
    assert [type(m) for m in back.modules()] == [type(m) for m in model.modules()]
    size = 32 if not isinstance(model, diffmm.models.clip.DiffCLIP) else 64
    img = torch.randn(2, 3, size, size)
    with torch.no_grad():
        if hasattr(model, "encode_text"):
            txt = tokens(model.context_length if hasattr(model, "context_length") else 16)[:2]
            for a, b in zip(features(back, img, txt), features(model, img, txt)):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
        else:
            torch.testing.assert_close(back(img), model(img), atol=0, rtol=0)
