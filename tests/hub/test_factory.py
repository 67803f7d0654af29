"""One rule for model names (diffmm.create_model and the CLIs), open_clip:NAME, list_pretrained, swap=, and the
timm entrypoints registered by `import diffmm` (a plain import of diffmm.models.timm_models)."""
from __future__ import annotations

import json
import subprocess
import sys

import open_clip
import pytest
import torch
from open_clip.model import CLIP
from safetensors.torch import save_file

import diffmm
from diffmm.hub.clip_convert import TAGS
from diffmm.hub.factory import UnknownModelError, create_model, has_weights, model_kind

# a tiny open_clip architecture registered under a test name (open_clip's registry is global: a unique name)
OC_TINY = {"embed_dim": 32,
           "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 16},
           "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2}}
OC_TIMM = {"embed_dim": 32, "vision_cfg": {"timm_model_name": "test_vit", "timm_model_pretrained": False,
                                           "timm_pool": "token", "timm_proj": "linear", "image_size": 160},
           "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 1}}


@pytest.fixture(scope="module")
def oc_names(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oc_cfgs")
    (folder / "diffmm-test-tiny.json").write_text(json.dumps(OC_TINY))
    (folder / "diffmm-test-timm.json").write_text(json.dumps(OC_TIMM))
    open_clip.add_model_config(str(folder))
    return "diffmm-test-tiny", "diffmm-test-timm"


def _feats(m, img, txt):
    with torch.no_grad():
        return m.encode_image(img), m.encode_text(txt)


def test_unknown_names_are_one_line_errors_listing_what_is_accepted(tmp_path):
    with pytest.raises(UnknownModelError) as e:
        create_model("ViT-B-32")  # open_clip's name: never silently open_clip's random model
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("unknown model 'ViT-B-32'; accepted:")
    for part in ("DiffCLIP-ViT-B-16", "diff-tiny", "open_clip:NAME", "local-dir:FOLDER", "Lightning .ckpt",
                 "did you mean open_clip:ViT-B-32?"):
        assert part in msg
    with pytest.raises(UnknownModelError, match="'No-Such'; accepted") as e:
        create_model("No-Such")
    assert "did you mean" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="runs/x/last.ckpt: no such file or folder"):
        create_model("runs/x/last.ckpt")
    with pytest.raises(UnknownModelError, match="open_clip:No-Such: open_clip has no such architecture"):
        create_model("open_clip:No-Such")
    # the same rule in the eval CLI
    from diffmm.eval.loading import load_clip

    with pytest.raises(UnknownModelError, match="did you mean open_clip:ViT-B-32"):
        load_clip("ViT-B-32")


def test_kinds_and_weights(tmp_path):
    (tmp_path / "w.pt").write_bytes(b"")
    assert model_kind("CLIP-Tiny") == "config" and not has_weights("CLIP-Tiny", None)
    assert has_weights("CLIP-Tiny", "w.pt") and model_kind("open_clip:ViT-B-32") == "open_clip"
    assert model_kind("local-dir:x") == "saved" and has_weights("local-dir:x", None)
    assert model_kind(str(tmp_path / "w.pt")) == "path" and has_weights(str(tmp_path / "w.pt"), None)
    with pytest.raises(ValueError, match="already holds weights"):
        create_model(str(tmp_path / "w.pt"), pretrained="other.pt")


def test_open_clip_name_builds_diffclip_with_open_clips_weights(tmp_path, oc_names, monkeypatch):
    torch.manual_seed(0)
    ref = CLIP(**OC_TINY).eval()
    save_file(ref.state_dict(), str(tmp_path / "oc.safetensors"))
    m = create_model(f"open_clip:{oc_names[0]}", pretrained=str(tmp_path / "oc.safetensors")).eval()
    assert isinstance(m, diffmm.models.clip.DiffCLIP) and m.config.vision_cfg.pre_norm
    tok = diffmm.get_tokenizer(f"open_clip:{oc_names[0]}")
    img, txt = torch.randn(2, 3, 32, 32), tok(["a red square", "a blue circle"])
    assert txt.shape == (2, 16)
    for a, b in zip(_feats(m, img, txt), _feats(ref, img, txt)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # an open_clip hub tag: open_clip downloads it (here: a stand-in that returns the local file), its mean/std recorded
    pcfg = {"url": "x", "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    orig = open_clip.get_pretrained_cfg
    monkeypatch.setattr(open_clip, "get_pretrained_cfg",
                        lambda name, tag: pcfg if tag == "test-tag" else orig(name, tag))
    monkeypatch.setattr(open_clip, "download_pretrained", lambda cfg, **kw: str(tmp_path / "oc.safetensors"))
    tagged = create_model(f"open_clip:{oc_names[0]}", pretrained="test-tag")
    assert tagged.config.vision_cfg.mean == (0.5, 0.5, 0.5)
    torch.testing.assert_close(tagged.state_dict()["logit_scale"], m.state_dict()["logit_scale"])
    with pytest.raises(FileNotFoundError, match="not an open_clip tag"):
        create_model(f"open_clip:{oc_names[0]}", pretrained="no-such-tag")


def test_open_clip_name_that_diffmm_does_not_implement_is_open_clips_model(tmp_path, oc_names):
    torch.manual_seed(0)
    ref = open_clip.create_model(oc_names[1]).eval()
    torch.save({"state_dict": {"module." + k: v for k, v in ref.state_dict().items()}}, tmp_path / "t.pt")
    m = create_model(f"open_clip:{oc_names[1]}", pretrained=str(tmp_path / "t.pt")).eval()
    assert type(m) is type(ref)  # open_clip's own model (timm image tower)
    tok = diffmm.get_tokenizer(m)
    img, txt = torch.randn(2, 3, 160, 160), tok(["a", "b"])
    for a, b in zip(_feats(m, img, txt), _feats(ref, img, txt)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="config overrides"):
        create_model(f"open_clip:{oc_names[1]}", embed_dim=8)
    # swap_attention works on it (timm tower, text transformer)
    up = create_model(f"open_clip:{oc_names[1]}", pretrained=str(tmp_path / "t.pt"), swap={"init": "upcycle"}).eval()
    assert any(k.endswith("lambda_q1") for k in up.state_dict())
    for a, b in zip(_feats(up, img, txt), _feats(ref, img, txt)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_swap_argument_of_create_model(tmp_path):
    torch.manual_seed(0)
    ref = CLIP(**OC_TINY).eval()
    torch.save(ref.state_dict(), tmp_path / "oc.pt")
    over = {"embed_dim": 32, "vision_cfg": OC_TINY["vision_cfg"], "text_cfg": {**OC_TINY["text_cfg"], "heads": 4}}
    base = create_model("OpenCLIP-Tiny", pretrained=str(tmp_path / "oc.pt"), **over).eval()
    state = torch.random.get_rng_state()
    up = create_model("OpenCLIP-Tiny", pretrained=str(tmp_path / "oc.pt"), swap={"init": "upcycle"}, **over).eval()
    v2 = create_model("OpenCLIP-Tiny", pretrained=str(tmp_path / "oc.pt"),
                      swap={"attention": "diff_v2", "init": "upcycle", "towers": "visual"}, **over).eval()
    assert up.config.vision_cfg.attn_type == up.config.text_cfg.attn_type == "diff_upcycled"
    assert v2.config.vision_cfg.attn_type == "diff_v2" and v2.config.text_cfg.attn_type == "standard"
    img, txt = torch.randn(2, 3, 32, 32), diffmm.get_tokenizer(base)(["a cat", "two dogs"])
    for m in (up, v2):
        for a, b in zip(_feats(m, img, txt), _feats(base, img, txt)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the upcycled layers' random parts come from the swap's own seed, not the global RNG
    assert not torch.equal(state, torch.zeros_like(state))
    up2 = create_model("OpenCLIP-Tiny", pretrained=str(tmp_path / "oc.pt"), swap={"init": "upcycle", "seed": 0}, **over)
    assert all(torch.equal(a, b) for a, b in zip(up.state_dict().values(), up2.state_dict().values()))
    with pytest.raises(ValueError, match="swap: unknown keys attn; expected some of attention"):
        create_model("CLIP-Tiny", swap={"attn": "diff"})
    # standard weights into a differential config: one line pointing at swap
    with pytest.raises(ValueError, match=r"holds standard-attention weights.*swap: \{init: upcycle\}"):
        create_model("DiffCLIP-Tiny", pretrained=str(tmp_path / "oc.pt"), **over)


def test_list_pretrained():
    pairs = diffmm.list_pretrained()
    assert ("DiffCLIP-ViT-B-16", "official") in pairs and ("OpenCLIP-ViT-B-16", "open_clip") in pairs
    assert ("CLIP-Tiny", "official") not in pairs and ("CLIP-Tiny", "diffmm") in pairs
    assert {n for n, _ in pairs} == set(diffmm.list_models())
    assert "DiffCLIP-Tiny:official" in diffmm.list_pretrained(as_str=True)
    assert set(TAGS) == {t for _, t in pairs}  # every tag names files of some config
    with_oc = diffmm.list_pretrained(open_clip_tags=True)
    assert ("open_clip:ViT-B-32", "openai") in with_oc


@pytest.mark.parametrize("order", ["diffmm_first", pytest.param("timm_first", marks=pytest.mark.slow)])
def test_import_diffmm_registers_timm_models(order):
    first, second = ("diffmm", "timm") if order == "diffmm_first" else ("timm", "diffmm")
    code = f"""
import sys, torch
import {first}
if "{first}" == "diffmm":  # timm is imported (it registers the names); open_clip and the training stack are not
    heavy = [m for m in ("open_clip", "lightning", "pytorch_lightning", "webdataset") if m in sys.modules]
    assert not heavy, heavy
import {second}
import timm
names = timm.list_models("diffmm_*")
assert "diffmm_diffclip_vit_b_16" in names and "diffmm_clip_tiny" in names, names
with torch.device("meta"):
    m = timm.create_model("diffmm_diffclip_vit_b_16")
assert type(m).__name__ == "VisionTransformer" and m.blocks[0].attn.lambda_q1.shape == (64,)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_one_public_way_to_load():
    """diffmm and diffmm.hub export the public loading API only (the classes add save/from_pretrained)."""
    import diffmm.hub

    public = {"create_model", "create_model_and_transforms", "get_tokenizer", "list_pretrained", "load_pretrained"}
    assert set(diffmm.hub.__all__) == public | {"DamagedFileError"}
    assert public <= set(diffmm.__all__)
    assert not {n for n in set(diffmm.__all__) - public if "load" in n or "pretrained" in n or "create" in n}
    assert {"save_pretrained", "from_pretrained"} <= set(dir(diffmm.DiffLM))


def test_lm_names_without_a_prefix(tmp_path):
    torch.manual_seed(0)
    lm = diffmm.create_model("diff-tiny", vocab_size=100)
    assert model_kind("diff-tiny") == "lm" and isinstance(lm, diffmm.DiffLM) and lm.config.vocab_size == 100
    lm.save_pretrained(tmp_path / "lm")
    torch.manual_seed(1)
    again = diffmm.create_model("diff-tiny", pretrained=str(tmp_path / "lm"), vocab_size=100)
    for a, b in zip(lm.state_dict().values(), again.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert isinstance(diffmm.create_model(str(tmp_path / "lm")), diffmm.DiffLM)
