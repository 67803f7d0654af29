"""DiffCLIP encoders: configs, open_clip interface and parity with open_clip's CLIP for standard attention."""
from __future__ import annotations

import math

import open_clip
import pytest
import torch
from open_clip.model import CLIP

import diffmm
from diffmm.hub.clip_convert import from_open_clip_config, open_clip_to_diffmm
from diffmm.hub.factory import create_model
from diffmm.models.clip import CLIPConfig, DiffCLIP, get_model_config, list_models
from diffmm.nn import DiffAttention, DiffV2Attention
from diffmm.nn.attention import Attention

OC_CFG = dict(embed_dim=48, vision_cfg=dict(image_size=32, patch_size=8, width=64, layers=2, head_width=16),
              text_cfg=dict(context_length=16, vocab_size=49408, width=64, heads=4, layers=2))
CAPTIONS = ["a cat", "two dogs running on the grass", "x", "a red apple on a table"]


def tokens(context_length: int = 16) -> torch.Tensor:
    return open_clip.tokenizer.SimpleTokenizer(context_length=context_length)(CAPTIONS)


SMALL = {"vision_cfg": {"image_size": 32}, "text_cfg": {"vocab_size": 1000, "context_length": 16}}


def small_inputs(n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and token ids for a ``SMALL`` model: ids < 1000, EOT (999, the largest) then padding."""
    g = torch.Generator().manual_seed(0)
    txt = torch.randint(1, 998, (n, 16), generator=g)
    for r in range(n):
        txt[r, 5 + r] = 999
        txt[r, 6 + r:] = 0
    return torch.randn(n, 3, 32, 32, generator=g), txt


def test_configs_cover_sizes_and_variants():
    names = set(list_models())
    for size in ("ViT-B-16", "ViT-B-32", "ViT-L-14", "Tiny"):
        for var in ("DiffCLIP", "DiffCLIP-star", "DiffCLIP-dagger", "CLIP", "OpenCLIP"):
            assert f"{var}-{size}" in names
    assert {"DiffCLIPv2-Tiny", "DiffCLIPv2-ViT-B-16"} <= names
    b16 = get_model_config("DiffCLIP-ViT-B-16")
    assert (b16.vision_cfg.width, b16.vision_cfg.heads, b16.text_cfg.width, b16.text_cfg.heads) == (768, 12, 512, 8)
    assert (b16.text_cfg.context_length, b16.text_cfg.vocab_size, b16.embed_dim) == (77, 49408, 512)
    assert math.isclose(b16.init_logit_scale, math.log(1 / 0.07)) and b16.logit_scale_max == 100
    assert get_model_config("DiffCLIP-dagger-Tiny").text_cfg.attn_type == "standard"
    assert get_model_config("DiffCLIP-star-Tiny").vision_cfg.lambda_init == "depth"


@pytest.mark.parametrize("name", ["DiffCLIP-ViT-B-16", "DiffCLIP-star-ViT-L-14", "CLIP-ViT-B-32"])
def test_large_configs_build_on_meta(name):
    with torch.device("meta"):
        m = create_model(name)
    cfg = m.config
    assert len(m.visual.blocks) == cfg.vision_cfg.layers and len(m.transformer.resblocks) == cfg.text_cfg.layers
    layer = m.visual.blocks[0].attn
    if cfg.vision_cfg.attn_type == "diff":  # half the heads of the standard Transformer (DIFF Transformer)
        assert isinstance(layer, DiffAttention) and layer.num_heads == cfg.vision_cfg.heads // 2
        assert layer.head_dim == 64
    else:
        assert isinstance(layer, Attention) and layer.num_heads == cfg.vision_cfg.heads


def test_tower_attention_and_lambda_init():
    m = create_model("DiffCLIP-Tiny")
    assert all(b.attn.lambda_init == 0.8 for b in m.visual.blocks)
    assert all(b.attn.causal for b in m.transformer.resblocks) and not m.visual.blocks[0].attn.causal
    star = create_model("DiffCLIP-star-Tiny")
    assert [round(b.attn.lambda_init, 3) for b in star.transformer.resblocks] == [0.2, 0.356, 0.471, 0.556]
    dagger = create_model("DiffCLIP-dagger-Tiny")
    assert isinstance(dagger.visual.blocks[0].attn, DiffAttention)
    assert isinstance(dagger.transformer.resblocks[0].attn, Attention)


def test_unknown_config_key_is_named():
    with pytest.raises(ValueError, match="vision_cfg: unknown keys widht"):
        CLIPConfig.from_dict({"vision_cfg": {"widht": 3}})
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        create_model("nope")


@pytest.mark.parametrize("quick_gelu", [False, True])
def test_standard_clip_matches_open_clip(quick_gelu):
    torch.manual_seed(0)
    ref = CLIP(**OC_CFG, quick_gelu=quick_gelu).eval()
    model = DiffCLIP(from_open_clip_config(dict(OC_CFG, quick_gelu=quick_gelu))).eval()
    model.load_state_dict(open_clip_to_diffmm(ref.state_dict()), strict=True)
    img, txt = torch.randn(4, 3, 32, 32), tokens()
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(img), ref.encode_image(img), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.encode_text(txt), ref.encode_text(txt), atol=1e-5, rtol=1e-5)
        # the comparison can fail: other attention weights give other features
        model.transformer.resblocks[0].attn.q_proj.weight.mul_(3.0)
        model.visual.blocks[0].attn.q_proj.weight.mul_(3.0)
        assert (model.encode_text(txt) - ref.encode_text(txt)).abs().max() > 1e-3
        assert (model.encode_image(img) - ref.encode_image(img)).abs().max() > 1e-3


def test_standard_clip_backward_matches_open_clip():
    torch.manual_seed(1)
    ref = CLIP(**OC_CFG).train()
    model = DiffCLIP(from_open_clip_config(OC_CFG)).train()
    model.load_state_dict(open_clip_to_diffmm(ref.state_dict()), strict=True)
    img, txt = torch.randn(4, 3, 32, 32), tokens()
    for m in (ref, model):
        (m.encode_image(img, normalize=True) @ m.encode_text(txt, normalize=True).T).sum().backward()
    g_ref = open_clip_to_diffmm({k: p.grad for k, p in ref.named_parameters()})
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g_ref[k], atol=1e-5, rtol=1e-4, msg=k)


def test_forward_interface_and_logit_scale():
    torch.manual_seed(0)
    m = create_model("DiffCLIP-Tiny", **SMALL).eval()
    img, txt = small_inputs()
    i, t, s = m(img, txt)
    assert i.shape == t.shape == (2, 128) and math.isclose(s.item(), 1 / 0.07, rel_tol=1e-5)
    torch.testing.assert_close(i.norm(dim=-1), torch.ones(2))  # normalised in forward (open_clip's convention)
    m.output_dict = True
    out = m(img, txt, normalize=False)  # the raw features (as the official DiffCLIP's forward)
    torch.testing.assert_close(out["image_features"], m.encode_image(img))
    with torch.no_grad():
        m.logit_scale.fill_(10.0)
    # unclamped, as open_clip's forward
    assert math.isclose(m(img, txt)["logit_scale"].item(), math.exp(10.0), rel_tol=1e-6)
    assert m.logit_scale_value().item() == 100.0  # diffmm's training and evaluation clamp
    assert m(image=img)["text_features"] is None


def test_eot_pooling_is_causal():
    """Tokens after the EOT token (padding) never change the text features: causal mask + argmax pooling."""
    torch.manual_seed(0)
    m = create_model("DiffCLIP-Tiny").eval()
    txt = tokens(32)
    eot = txt.argmax(dim=-1)
    noisy = txt.clone()
    for r, e in enumerate(eot):
        noisy[r, e + 1:] = torch.randint(1, 1000, (txt.shape[1] - e - 1,))
    with torch.no_grad():
        torch.testing.assert_close(m.encode_text(noisy), m.encode_text(txt))
        changed = txt.clone()
        changed[:, 1] = 500  # a token before EOT changes them
        assert (m.encode_text(changed) - m.encode_text(txt)).abs().max() > 1e-4


def test_zero_shot_classifier_runs_unchanged():
    torch.manual_seed(0)
    m = create_model("DiffCLIP-Tiny").eval()
    tok = diffmm.get_tokenizer("DiffCLIP-Tiny")
    classes, templates = ["cat", "dog", "apple"], [lambda c: f"a photo of a {c}.", lambda c: f"a {c}."]
    w = open_clip.build_zero_shot_classifier(m, tok, classes, templates, num_classes_per_batch=2, device="cpu",
                                             use_tqdm=False)
    with torch.no_grad():
        e = torch.stack([m.encode_text(tok([t(c) for t in templates]), normalize=True).mean(0) for c in classes])
    torch.testing.assert_close(w, (e / e.norm(dim=-1, keepdim=True)).T)


def test_diff_v2_towers_train():
    m = create_model("DiffCLIPv2-Tiny", vision_cfg={"image_size": 32},
                     text_cfg={"vocab_size": 1000, "context_length": 16})
    for block in list(m.visual.blocks) + list(m.transformer.resblocks):
        assert isinstance(block.attn, DiffV2Attention) and block.attn.num_heads == 4  # the twin's heads, 8 q maps
    i, t, s = m(*small_inputs())
    (i.sum() + t.sum()).backward()
    assert m.visual.blocks[0].attn.lambda_proj.weight.grad.abs().sum() > 0


def test_grad_checkpointing_same_gradients():
    torch.manual_seed(0)
    m = create_model("DiffCLIP-Tiny", **SMALL).train()
    img, txt = small_inputs()
    grads = []
    for ckpt in (False, True):
        m.zero_grad()
        m.set_grad_checkpointing(ckpt)
        i, t, _ = m(img, txt)
        (i.square().sum() + t.square().sum()).backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None})
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], msg=k)


def test_fp64_matches_fp32():
    torch.manual_seed(0)
    m = create_model("DiffCLIP-Tiny", **SMALL).eval()
    img, txt = small_inputs()
    with torch.no_grad():
        f32 = m.encode_image(img), m.encode_text(txt)
        m64 = m.double()
        f64 = m64.encode_image(img.double()), m64.encode_text(txt)
    for a, b in zip(f32, f64):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


def test_create_model_and_transforms_and_tokenizer():
    from PIL import Image

    m, train, val = diffmm.create_model_and_transforms("CLIP-Tiny")
    img = Image.new("RGB", (100, 80), (255, 0, 0))
    assert train(img).shape == val(img).shape == (3, 64, 64)
    assert diffmm.get_tokenizer("CLIP-Tiny")(["hi"]).shape == (1, 32)
    assert diffmm.get_tokenizer("DiffCLIP-ViT-B-16")(["hi"]).shape == (1, 77)
