"""open_clip's conventions on DiffCLIP, each checked against open_clip's own code on a tiny model built here (no
downloads): forward (normalised features, logit_scale.exp(), logit_bias), precision names, get_model_preprocess_cfg,
the error for a pretrained tag, and open_clip's factory building a DiffCLIP-dagger image tower by its timm name."""
from __future__ import annotations

import json

import numpy as np
import open_clip
import pytest
import torch
from open_clip.model import get_input_dtype
from open_clip.transformer import LayerNormFp32
from open_clip.transform import PreprocessCfg, image_transform_v2
from PIL import Image

import diffmm
from diffmm.hub.clip_convert import open_clip_to_diffmm
from diffmm.hub.precision import PRECISIONS
from diffmm.models.clip.config import IMAGENET_MEAN, IMAGENET_STD
from diffmm.models.clip.preprocess import transforms_for
from diffmm.nn import LayerNorm

# tiny open_clip architectures registered under test names (open_clip's registry is global: unique names)
OC_TINY = {"embed_dim": 32,
           "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 16},
           "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2}}
OC_BIAS = {**OC_TINY, "init_logit_bias": -10.0}
# open_clip's factory with diffmm's DiffCLIP(-dagger) image tower by its timm name and an open_clip text tower
# (QuickGELU, as DiffCLIP's): the architecture of diffmm's DiffCLIP-dagger-Tiny
OC_DAGGER = {"embed_dim": 128, "quick_gelu": True,
             "vision_cfg": {"timm_model_name": "diffmm_diffclip_tiny", "timm_pool": "token", "timm_proj": "linear",
                            "image_size": 64},
             "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 4}}
TOL = dict(atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def oc_names(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oc_conv_cfgs")
    names = {"tiny": "diffmm-conv-tiny", "bias": "diffmm-conv-bias", "dagger": "diffmm-conv-dagger-tiny"}
    for key, cfg in (("tiny", OC_TINY), ("bias", OC_BIAS), ("dagger", OC_DAGGER)):
        (folder / f"{names[key]}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(str(folder))
    return names


def inputs(size: int = 32, context: int = 16, n: int = 3):
    g = torch.Generator().manual_seed(0)
    tok = open_clip.tokenizer.SimpleTokenizer(context_length=context)
    return torch.randn(n, 3, size, size, generator=g), tok(["a cat", "two dogs on the grass", "x"][:n])


def twins(name: str, **kw):
    """open_clip's model of a registered config and diffmm's DiffCLIP of it with the same weights."""
    torch.manual_seed(0)
    ref = open_clip.create_model(name, **kw).eval()
    model = diffmm.create_model(f"open_clip:{name}", **kw).eval()
    model.load_state_dict(open_clip_to_diffmm(ref.state_dict()), strict=True)
    return ref, model


# ---------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("output_dict", [False, True])
def test_forward_normalised_as_open_clip(oc_names, output_dict):
    ref, model = twins(oc_names["tiny"], output_dict=output_dict)
    with torch.no_grad():
        for p in (ref.logit_scale, model.logit_scale):
            p.fill_(5.0)  # above ln(100): forward returns the unclamped exp, as open_clip's
    img, txt = inputs()
    with torch.no_grad():
        want, got = ref(img, txt), model(img, txt)
        assert type(got) is type(want)
        if output_dict:
            assert set(got) == set(want) == {"image_features", "text_features", "logit_scale"}
            want, got = [want[k] for k in sorted(want)], [got[k] for k in sorted(got)]
        assert len(got) == len(want) == 3 and model.logit_bias is None and ref.logit_bias is None
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)
        feats = model(img, txt)
        feats = feats if isinstance(feats, tuple) else (feats["image_features"], feats["text_features"])
        torch.testing.assert_close(feats[0].norm(dim=-1), torch.ones(3))
        # encode_* default to raw features in both; forward(normalize=False) (diffmm's extra) gives them too
        torch.testing.assert_close(model.encode_image(img), ref.encode_image(img), **TOL)
        torch.testing.assert_close(model.encode_text(txt), ref.encode_text(txt), **TOL)
        raw = model(img, txt, normalize=False)
        raw = raw if isinstance(raw, tuple) else (raw["image_features"], raw["text_features"])
        torch.testing.assert_close(raw[0], ref.encode_image(img), **TOL)
        one = model(image=img)
        assert (one["text_features"] if output_dict else one[1]) is None
        for a, b in zip(model.get_logits(img, txt), ref.get_logits(img, txt)):
            torch.testing.assert_close(a, b, **TOL)


def test_logit_bias_as_open_clip(oc_names, tmp_path):
    """``init_logit_bias`` (open_clip's SigLIP-style key): forward's 4-tuple / dict entry and get_logits."""
    ref, model = twins(oc_names["bias"])
    assert model.config.init_logit_bias == -10.0 and model.logit_bias is not None
    img, txt = inputs()
    with torch.no_grad():
        got, want = model(img, txt), ref(img, txt)
        assert len(got) == len(want) == 4
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)
        for a, b in zip(model.get_logits(img, txt), ref.get_logits(img, txt)):
            torch.testing.assert_close(a, b, **TOL)
        model.output_dict = ref.output_dict = True
        torch.testing.assert_close(model(img, txt)["logit_bias"], ref(img, txt)["logit_bias"])
    # an open_clip file with a bias loads with it (config inferred from its keys)
    torch.save(ref.state_dict(), tmp_path / "siglip_style.pt")
    loaded = diffmm.load_pretrained(tmp_path / "siglip_style.pt", head_width=16, text_head_width=16).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.get_logits(img, txt)[0], ref.get_logits(img, txt)[0], **TOL)
    # and a diffmm export keeps it
    model.output_dict = False
    model.save_pretrained(tmp_path / "export")
    with torch.no_grad():
        for a, b in zip(diffmm.load_pretrained(tmp_path / "export")(img, txt), model(img, txt)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_training_refuses_logit_bias(oc_names):
    from diffmm.train.clip_module import CLIPModule

    _, model = twins(oc_names["bias"])
    with pytest.raises(ValueError, match="logit_bias.*sigmoid loss is not implemented"):
        CLIPModule(model=model)


# -------------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_as_open_clip(oc_names, precision):
    """Every parameter has the dtype open_clip's factory gives its counterpart; features match open_clip's with
    inputs in open_clip's input dtype."""
    ref, model = twins(oc_names["tiny"], precision=precision)
    want = {k: v.dtype for k, v in open_clip_to_diffmm(ref.state_dict()).items()}
    assert {k: v.dtype for k, v in model.state_dict().items()} == want
    if precision.startswith("amp"):
        return  # fp32 weights: the fp32 forward is checked above
    img, txt = inputs()
    img = img.to(get_input_dtype(precision))
    with torch.no_grad():
        for a, b in zip(model(img, txt), ref(img, txt)):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layernorm_as_open_clip_fp32_layernorm(dtype):
    """Under mixed precision (fp32 weights, low-precision input) diffmm's LayerNorm is open_clip's LayerNormFp32."""
    torch.manual_seed(0)
    ours, ref = LayerNorm(64), LayerNormFp32(64)
    with torch.no_grad():
        ours.weight.normal_(), ours.bias.normal_()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 7, 64).to(dtype)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    assert ours(x).dtype == dtype


def test_precision_errors():
    with pytest.raises(ValueError, match="precision 'bfloat16'; expected one of fp32, fp16, bf16, pure_fp16"):
        diffmm.create_model("CLIP-Tiny", precision="bfloat16")


# ----------------------------------------------------------------------------------------------- preprocessing
def test_get_model_preprocess_cfg(oc_names):
    ref, model = twins(oc_names["tiny"])
    assert open_clip.get_model_preprocess_cfg(model) == open_clip.get_model_preprocess_cfg(ref)
    official = diffmm.create_model("DiffCLIP-Tiny", vision_cfg={"image_mean": IMAGENET_MEAN,
                                                                "image_std": IMAGENET_STD})
    cfg = open_clip.get_model_preprocess_cfg(official)
    assert (cfg["size"], cfg["mean"], cfg["std"]) == ((64, 64), IMAGENET_MEAN, IMAGENET_STD)
    # open_clip's transform from that dict equals the one diffmm's pipelines use
    pil = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 80, 3), dtype=np.uint8))
    oc_val = image_transform_v2(PreprocessCfg(**cfg), is_train=False)
    torch.testing.assert_close(oc_val(pil), transforms_for(official)[1](pil))
    # open_clip's setter writes the normalisation into the config; what diffmm's transforms cannot do is refused
    open_clip.model.set_model_preprocess_cfg(official, {**cfg, "mean": (0.5,) * 3, "std": (0.5,) * 3})
    assert official.config.vision_cfg.mean == (0.5,) * 3 and transforms_for(official)[1](pil).min() >= -1
    with pytest.raises(ValueError, match="preprocess_cfg interpolation 'bilinear'; diffmm's transforms use"):
        official.visual.preprocess_cfg = {**cfg, "interpolation": "bilinear"}


# ------------------------------------------------------------------------------------------------ pretrained
def test_pretrained_tag_is_one_line_error():
    name = "DiffCLIP-ViT-B-16"
    tags = [t for n, t in diffmm.list_pretrained() if n == name]
    assert tags == ["diffmm", "official", "timm"]
    with pytest.raises(FileNotFoundError) as e:
        diffmm.create_model(name, pretrained="official")
    msg = str(e.value)
    assert "\n" not in msg and "names a format of local files" in msg and "checkpoint_best.pt" in msg
    with pytest.raises(FileNotFoundError) as e:
        diffmm.create_model(name, pretrained="laion2b_s34b_b88k")
    assert "\n" not in str(e.value) and f"list_pretrained() offers {name} with {', '.join(tags)}" in str(e.value)


# --------------------------------------------------------------------------------------- open_clip's factory
def test_open_clip_factory_builds_dagger_tower(oc_names):
    """``open_clip.create_model`` with ``vision_cfg.timm_model_name: diffmm_diffclip_tiny`` (after ``import diffmm``)
    is DiffCLIP-dagger-Tiny: with the same weights (``visual.trunk.*`` = ``visual.*``, ``visual.head.proj.weight`` =
    ``image_projection.T``), the same outputs; ``open_clip:NAME`` of it is that DiffCLIP."""
    torch.manual_seed(0)
    route = open_clip.create_model(oc_names["dagger"]).eval()
    model = diffmm.create_model("DiffCLIP-dagger-Tiny").eval()
    model.load_state_dict(open_clip_to_diffmm(route.state_dict()), strict=True)
    assert diffmm.create_model(f"open_clip:{oc_names['dagger']}").config == model.config
    img, txt = inputs(64, 32)
    with torch.no_grad():
        for a, b in zip(model(img, txt), route(img, txt)):
            torch.testing.assert_close(a, b, **TOL)
    assert open_clip.get_model_preprocess_cfg(route) == open_clip.get_model_preprocess_cfg(model)
