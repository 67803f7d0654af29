"""diffmm's differential ViT against timm's differential ViT, and diffmm ViTs inside timm."""
from __future__ import annotations

from functools import partial

import pytest
import timm
import torch
import torch.nn as nn
from timm.models.vision_transformer import VisionTransformer

from diffmm.hub.clip_convert import diffmm_vit_to_timm, timm_vit_to_diffmm
from diffmm.hub.factory import create_model
from diffmm.models.clip import VisionCfg, VisionTransformer as DiffmmViT


@pytest.mark.parametrize("lambda_init", ["depth", "constant"])
def test_diff_vit_matches_timm_diff_attention(lambda_init):
    torch.manual_seed(0)
    # timm's DiffAttention counts differential heads: 2 heads of 16 = diffmm's 4 standard heads at width 64
    ref = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=2, attn_layer="diff",
                            qkv_bias=True, num_classes=0, norm_layer=partial(nn.LayerNorm, eps=1e-5))
    for blk in ref.blocks:
        nn.init.normal_(blk.attn.sub_norm.weight, 1.0, 0.2)
        if lambda_init == "constant":
            blk.attn.lambda_init = 0.8
    ours = DiffmmViT(VisionCfg(image_size=32, patch_size=8, width=64, layers=3, head_width=16,
                               attn_type="diff", lambda_init=lambda_init))
    ours.load_state_dict(timm_vit_to_diffmm(ref.state_dict(), prefix=""), strict=True)
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    # backward: gradients of every mapped parameter agree
    ours(x).square().sum().backward()
    ref(x).square().sum().backward()
    g_ref = timm_vit_to_diffmm({k: p.grad for k, p in ref.named_parameters()}, prefix="")
    for k, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, g_ref[k], atol=1e-4, rtol=1e-4, msg=k)
    with torch.no_grad():  # the comparison can fail
        ours.blocks[0].attn.lambda_q1.add_(0.5)
        assert (ours(x) - ref(x)).abs().max() > 1e-4


@pytest.mark.parametrize("config", ["DiffCLIP-star-Tiny", "CLIP-Tiny"])
def test_timm_entrypoint_is_the_image_tower(config):
    torch.manual_seed(0)
    clip = create_model(config).eval()
    vit = timm.create_model("diffmm_" + config.lower().replace("-", "_")).eval()
    vit.load_state_dict(diffmm_vit_to_timm(clip.state_dict()), strict=True)
    assert [b.attn.lambda_init for b in vit.blocks if hasattr(b.attn, "lambda_init")] == \
        [b.attn.lambda_init for b in clip.visual.blocks if hasattr(b.attn, "lambda_init")]
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(vit(x), clip.visual(x), atol=1e-6, rtol=1e-6)
    head = timm.create_model("diffmm_" + config.lower().replace("-", "_"), num_classes=7)
    assert head(x).shape == (2, 7)


def test_timm_entrypoints_registered_for_every_config():
    names = set(timm.list_models("diffmm_*"))
    for size in ("vit_b_16", "vit_b_32", "vit_l_14", "tiny"):
        assert {f"diffmm_diffclip_{size}", f"diffmm_diffclip_star_{size}", f"diffmm_clip_{size}"} <= names
