"""timm's feature API on every ``diffmm_*`` model (features_only, forward_intermediates, num_classes, global_pool)
against timm's own ViT, and the pretrained tags' mean/std and local weight files."""
from __future__ import annotations

import argparse

import pytest
import timm
import torch
from open_clip import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from open_clip.model import CLIP as OpenClipCLIP
from safetensors.torch import save_file
from timm.data import resolve_data_config
from timm.models._features import FeatureGetterNet

import diffmm
from diffmm.hub.factory import create_model
from diffmm.models.clip import VisionTransformer as DiffmmViT
from diffmm.models.clip import get_model_config, normalization_of
from diffmm.models.clip.config import IMAGENET_MEAN, IMAGENET_STD
from diffmm.models.timm_models import TIMM_CONFIGS, timm_name, vit_kwargs

CONFIG_OF = {timm_name(n): n for n in TIMM_CONFIGS}
ALL = timm.list_models("diffmm_*")
# the towers that run on CPU in the tests: the Tiny ones, and the DINOv2-shaped one (layer scale: timm's init_values)
SMALL = [n for n in ALL if get_model_config(CONFIG_OF[n]).vision_cfg.width <= 256
         or get_model_config(CONFIG_OF[n]).vision_cfg.layer_scale_init is not None]


def _vision(name):
    return get_model_config(CONFIG_OF[name]).vision_cfg


def _meta(name, **kwargs):
    """A model on the meta device: shapes and structure only, nothing allocated (cheap for B/16 and L/14 too)."""
    with torch.device("meta"):
        return timm.create_model(name, **kwargs)


def _images(name, b=2, device="cpu"):
    v = _vision(name)
    if device == "meta":
        return torch.empty(b, 3, v.image_size, v.image_size, device="meta")
    return torch.randn(b, 3, v.image_size, v.image_size, generator=torch.Generator().manual_seed(0))


def _from_file(name, path, **kwargs):
    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs).eval()


def test_every_config_is_registered():
    assert sorted(ALL) == sorted(CONFIG_OF) and len(ALL) >= 21 and len(SMALL) >= 8


@pytest.mark.parametrize("out_indices", [None, (0, -1)])
@pytest.mark.parametrize("name", ALL)
def test_features_only_shapes_and_feature_info(name, out_indices):
    v = _vision(name)
    kwargs = {} if out_indices is None else dict(out_indices=out_indices)
    net = _meta(name, features_only=True, **kwargs)
    assert type(net).__name__ == "FeatureGetterNet"
    taken = list(range(v.layers - 3, v.layers)) if out_indices is None else [0, v.layers - 1]  # timm's ViT default: 3
    grid = v.image_size // v.patch_size
    feats = net(_images(name, device="meta"))
    assert [tuple(f.shape) for f in feats] == [(2, v.width, grid, grid)] * len(taken)
    assert net.feature_info.channels() == [v.width] * len(taken)
    assert net.feature_info.reduction() == [v.patch_size] * len(taken)
    assert net.feature_info.module_name() == [f"blocks.{i}" for i in taken]
    # the wrapped model's diffmm layers know their depth and the config's lambda_init, as in diffmm's own tower
    with torch.device("meta"):
        tower = DiffmmViT(v)
    blocks = net.model.blocks
    assert [getattr(b.attn, "layer_idx", i) for i, b in enumerate(blocks)] == list(range(len(blocks)))
    assert [getattr(b.attn, "lambda_init", None) for b in blocks] == \
        [getattr(b.attn, "lambda_init", None) for b in tower.blocks[:len(blocks)]]


@pytest.mark.parametrize("name", ALL)
def test_num_classes_reset_classifier_and_pool(name):
    v = _vision(name)
    x = _images(name, device="meta")
    net = _meta(name, num_classes=7)
    assert net(x).shape == (2, 7) and net.num_classes == 7
    net.reset_classifier(3)
    assert net(x).shape == (2, 3)
    net.reset_classifier(0, global_pool="avg")
    assert net(x).shape == (2, v.width) and net.global_pool == "avg"
    plain = _meta(name)  # num_classes 0: the pooled features, CLS token as the config's pool
    assert plain(x).shape == (2, v.width) and plain.global_pool == ("token" if v.pool_type == "tok" else "avg")
    assert _meta(name, global_pool="")(x).shape == (2, 1 + (v.image_size // v.patch_size) ** 2, v.width)


@pytest.mark.parametrize("name", SMALL)
def test_features_equal_diffmm_tower_and_forward_intermediates(name, tmp_path):
    """features_only maps are diffmm's own image tower's block outputs (patch tokens as NCHW), for every Tiny tower
    (diff, diff_v2, standard); forward_intermediates gives the same maps."""
    torch.manual_seed(0)
    v = _vision(name)
    tower = DiffmmViT(v).eval()
    save_file(tower.state_dict(), str(tmp_path / "tower.safetensors"))  # diffmm's ViT keys are the timm model's
    outs = []
    hooks = [b.register_forward_hook(lambda m, i, o: outs.append(o)) for b in tower.blocks]
    x = _images(name)
    with torch.no_grad():
        tower.forward_features(x)  # every token through every block (the pooled forward keeps only CLS after the last)
    for h in hooks:
        h.remove()
    grid = v.image_size // v.patch_size
    maps = [o[:, 1:].transpose(1, 2).reshape(2, v.width, grid, grid) for o in outs]  # (B, C, H/p, W/p)
    idx = [0, v.layers - 2]
    net = _from_file(name, tmp_path / "tower.safetensors", features_only=True, out_indices=idx)
    full = _from_file(name, tmp_path / "tower.safetensors")
    with torch.no_grad():
        feats = net(x)
        inter = full.forward_intermediates(x, indices=idx, intermediates_only=True)
        final, inter2 = full.forward_intermediates(x, indices=idx)
        pooled = full(x)
    assert len(net.model.blocks) == v.layers - 1  # timm pruned the unused last block
    for f, a, b, i in zip(feats, inter, inter2, idx):
        torch.testing.assert_close(f, maps[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, f, atol=0, rtol=0)
        torch.testing.assert_close(b, f, atol=0, rtol=0)
    torch.testing.assert_close(final, tower.forward_features(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, tower(x), atol=1e-5, rtol=1e-5)
    hook_net = _from_file(name, tmp_path / "tower.safetensors", features_only=True, out_indices=idx,
                          feature_cls="hook")  # timm's other feature wrapper: the block outputs as tokens
    with torch.no_grad():
        for t, i in zip(hook_net(x), idx):
            torch.testing.assert_close(t, outs[i], atol=1e-5, rtol=1e-5)


def _timm_reference(name, **kwargs):
    """timm's own registered ViT with the diffmm config's shape (its Attention, or its DiffAttention for 'diff')."""
    v = _vision(name)
    kw = {k: val for k, val in vit_kwargs(v).items() if k != "attn_layer"}
    if v.attn_type == "diff":  # timm counts differential heads: half diffmm's standard heads
        kw.update(attn_layer="diff", num_heads=v.heads // 2)
    return timm.create_model("vit_base_patch16_224", **{**kw, **kwargs})


@pytest.mark.parametrize("pool", ["token", "avg", "", "avgmax", "map"])
def test_global_pool_and_head_match_timm_vit(pool, tmp_path):
    """A standard-attention model equals timm's own ViT (fused qkv, timm's Attention) with the same weights: pooled
    features, logits of a 7-way head, forward_features, forward_intermediates, features_only."""
    torch.manual_seed(0)
    name = "diffmm_openclip_tiny"
    ref = _timm_reference(name, num_classes=7, global_pool=pool).eval()
    torch.save(ref.state_dict(), tmp_path / "vit.pth")  # timm's layout, fused qkv
    ours = timm.create_model(name, num_classes=7, global_pool=pool, pretrained=True,
                             pretrained_cfg_overlay=dict(file=str(tmp_path / "vit.pth"), num_classes=7)).eval()
    x = _images(name)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.forward_head(ours.forward_features(x), pre_logits=True),
                                   ref.forward_head(ref.forward_features(x), pre_logits=True), atol=1e-5, rtol=1e-5)
        for a, b in zip(ours.forward_intermediates(x, indices=2, norm=True, return_prefix_tokens=True)[1],
                        ref.forward_intermediates(x, indices=2, norm=True, return_prefix_tokens=True)[1]):
            for u, w in zip(a, b):
                torch.testing.assert_close(u, w, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the comparison can fail
        ours.head.bias.add_(0.1)
        assert (ours(x) - ref(x)).abs().max() > 0.05


@pytest.mark.parametrize("name", ["diffmm_openclip_tiny", "diffmm_diffclip_tiny", "diffmm_diffclip_star_tiny"])
def test_features_only_matches_timm_vit(name, tmp_path):
    """features_only of a diffmm model equals timm's own features_only ViT with the same weights; for the
    differential towers timm's DiffAttention (lambda_init 0.8 for DiffCLIP, depth-dependent for DiffCLIP*), so the
    layers inside the features_only wrapper have the config's lambda_init."""
    torch.manual_seed(0)
    vit = _timm_reference(name).eval()
    if _vision(name).attn_type == "diff":
        for blk in vit.blocks:
            torch.nn.init.normal_(blk.attn.sub_norm.weight, 1.0, 0.2)
            if _vision(name).lambda_init == "constant":
                blk.attn.lambda_init = 0.8
    torch.save(vit.state_dict(), tmp_path / "vit.pth")
    ref = FeatureGetterNet(vit, out_indices=(0, 1, 3))  # what timm's features_only wraps its ViTs in
    ours = _from_file(name, tmp_path / "vit.pth", features_only=True, out_indices=(0, 1, 3))
    x = _images(name)
    with torch.no_grad():
        got, want = ours(x), ref(x)
    assert ours.feature_info.channels() == ref.feature_info.channels()
    assert ours.feature_info.reduction() == ref.feature_info.reduction()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if _vision(name).attn_type == "diff":  # a wrong lambda_init would show
        with torch.no_grad():
            for blk in ours.model.blocks:
                blk.attn.lambda_init += 0.1
            assert (ours(x)[-1] - want[-1]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ALL)
def test_pretrained_tags_mean_std(name):
    """One tag per weight source diffmm.list_pretrained() names for the config; mean/std per source."""
    config = CONFIG_OF[name]
    sources = {t for n, t in diffmm.list_pretrained() if n == config}
    expected = {"diffmm": (_vision(name).mean, _vision(name).std)}
    if "official" in sources:
        expected["official"] = (IMAGENET_MEAN, IMAGENET_STD)
    if "open_clip" in sources:
        expected["open_clip"] = (tuple(OPENAI_DATASET_MEAN), tuple(OPENAI_DATASET_STD))
    assert _meta(name).pretrained_cfg["tag"] == "diffmm"  # the default
    for tag, (mean, std) in expected.items():
        net = _meta(f"{name}.{tag}")
        assert net.pretrained_cfg["tag"] == tag
        data = resolve_data_config({}, model=net)
        torch.testing.assert_close(torch.tensor(data["mean"]), torch.tensor(mean))
        torch.testing.assert_close(torch.tensor(data["std"]), torch.tensor(std))
        assert data["input_size"] == (3, _vision(name).image_size, _vision(name).image_size)
    for tag in {"official", "open_clip"} - set(expected):
        with pytest.raises(RuntimeError, match="Invalid pretrained tag"):
            timm.create_model(f"{name}.{tag}")


def test_official_weights_load_with_imagenet_mean_std(tmp_path):
    """The official DiffCLIP checkpoint format (SLIP's checkpoint_best.pt: DDP ``module.`` keys, ``args`` as an
    argparse.Namespace, which timm's weights_only reader allows) under ``.official``: the image tower and the
    normalisation equal what diffmm.load_pretrained makes of the same file."""
    torch.manual_seed(0)
    sd = {"module." + k: v for k, v in create_model("DiffCLIP-Tiny").state_dict().items()}
    torch.save({"epoch": 39, "state_dict": sd, "optimizer": {}, "scaler": {}, "best_acc1": 14.4,
                "args": argparse.Namespace(model="DiffCLIP_VITB16")}, tmp_path / "checkpoint_best.pt")
    clip = diffmm.load_pretrained(tmp_path / "checkpoint_best.pt", trust_pickle=True).eval()
    net = _from_file("diffmm_diffclip_tiny.official", tmp_path / "checkpoint_best.pt")
    x = _images("diffmm_diffclip_tiny")
    with torch.no_grad():
        torch.testing.assert_close(net(x), clip.visual(x), atol=1e-5, rtol=1e-5)
    data = resolve_data_config({}, model=net)
    assert (tuple(data["mean"]), tuple(data["std"])) == normalization_of(clip) == (IMAGENET_MEAN, IMAGENET_STD)


def test_open_clip_weights_load_under_open_clip_tag(tmp_path):
    torch.manual_seed(0)
    oc = OpenClipCLIP(embed_dim=128, vision_cfg=dict(image_size=64, patch_size=8, width=128, layers=4, head_width=32),
                      text_cfg=dict(context_length=32, vocab_size=49408, width=128, heads=4, layers=4)).eval()
    save_file(oc.state_dict(), str(tmp_path / "open_clip_model.safetensors"))
    net = _from_file("diffmm_openclip_tiny.open_clip", tmp_path / "open_clip_model.safetensors")
    x = _images("diffmm_openclip_tiny")
    with torch.no_grad():
        torch.testing.assert_close(net(x) @ oc.visual.proj, oc.encode_image(x), atol=1e-5, rtol=1e-5)
    data = resolve_data_config({}, model=net)
    assert (tuple(data["mean"]), tuple(data["std"])) == (tuple(OPENAI_DATASET_MEAN), tuple(OPENAI_DATASET_STD))
    with pytest.raises(ValueError, match=r"open_clip-layout weights under the pretrained tag 'diffmm', which takes "
                                         r"diffclip or timm or open_clip_timm layout; load them as "
                                         r"diffmm_openclip_tiny\.open_clip"):
        _from_file("diffmm_openclip_tiny", tmp_path / "open_clip_model.safetensors")
    with pytest.raises(ValueError, match="tag 'official', which takes diffclip layout; diffmm_diffclip_tiny has no"):
        _from_file("diffmm_diffclip_tiny.official", tmp_path / "open_clip_model.safetensors")
    with pytest.raises(ValueError, match=r"diffmm_openclip_tiny: no weights to download; give a local file with "
                                         r"pretrained_cfg_overlay=dict\(file=PATH\) \(tags: diffmm, open_clip\)"):
        timm.create_model("diffmm_openclip_tiny.open_clip", pretrained=True)
    torch.save({"foo.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(KeyError, match="other.pth: no visual.conv1.weight"):
        _from_file("diffmm_openclip_tiny", tmp_path / "other.pth")
