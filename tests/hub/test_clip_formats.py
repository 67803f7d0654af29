"""Loading CLIP weights: official DiffCLIP layout, open_clip, timm, diffmm exports, hf-hub, and the export CLI."""
from __future__ import annotations

import argparse
import json
from functools import partial

import pytest
import timm
import torch
import torch.nn as nn
from open_clip.model import CLIP
from safetensors.torch import save_file

import diffmm
from diffmm.cli import main as diffmm_main
from diffmm.hub.factory import create_model

OC_CFG = dict(embed_dim=48, vision_cfg=dict(image_size=32, patch_size=8, width=64, layers=2, head_width=16),
              text_cfg=dict(context_length=16, vocab_size=49408, width=64, heads=4, layers=2))


def official_shapes(vw: int, vl: int, tw: int, tl: int, d: int, embed: int, grid: int, patch: int, ctx: int = 77,
                    vocab: int = 49408) -> dict[str, tuple]:
    """The keys and shapes of the official DiffCLIP checkpoints (github hammoudhasan/DiffCLIP; the layout
    docs/models.md documents), written out here rather than derived from diffmm's code."""
    s = {"positional_embedding": (ctx, tw), "image_projection": (vw, embed), "text_projection": (tw, embed),
         "logit_scale": (), "token_embedding.weight": (vocab, tw), "ln_final.weight": (tw,), "ln_final.bias": (tw,),
         "visual.cls_token": (1, 1, vw), "visual.pos_embed": (1, grid * grid + 1, vw),
         "visual.patch_embed.proj.weight": (vw, 3, patch, patch), "visual.patch_embed.proj.bias": (vw,),
         "visual.norm.weight": (vw,), "visual.norm.bias": (vw,)}
    for prefix, n, w, norms, fc in (("visual.blocks", vl, vw, ("norm1", "norm2"), ("fc1", "fc2")),
                                    ("transformer.resblocks", tl, tw, ("ln_1", "ln_2"), ("c_fc", "c_proj"))):
        for i in range(n):
            b = f"{prefix}.{i}"
            for nm in norms:
                s[f"{b}.{nm}.weight"] = s[f"{b}.{nm}.bias"] = (w,)
            for lam in ("q1", "k1", "q2", "k2"):
                s[f"{b}.attn.lambda_{lam}"] = (d,)
            for p in ("q", "k", "v", "out"):
                s[f"{b}.attn.{p}_proj.weight"], s[f"{b}.attn.{p}_proj.bias"] = (w, w), (w,)
            s[f"{b}.attn.diff_norm.weight"] = (2 * d,)
            s[f"{b}.mlp.{fc[0]}.weight"], s[f"{b}.mlp.{fc[0]}.bias"] = (4 * w, w), (4 * w,)
            s[f"{b}.mlp.{fc[1]}.weight"], s[f"{b}.mlp.{fc[1]}.bias"] = (w, 4 * w), (w,)
    return s


VOCAB = 1000  # a small vocabulary keeps the test fast; the layout is the same
TINY = dict(vw=128, vl=4, tw=128, tl=4, d=32, embed=128, grid=8, patch=8, ctx=32, vocab=VOCAB)
TINY_OVERRIDES = {"text_cfg": {"vocab_size": VOCAB}}


def official_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A DiffCLIP-Tiny-sized checkpoint in the official layout, `module.` prefix included."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shape in official_shapes(**TINY).items():
        t = torch.randn(shape, generator=g) * 0.05
        if k.endswith(("norm1.weight", "norm2.weight", "ln_1.weight", "ln_2.weight", "norm.weight", "ln_final.weight",
                       "diff_norm.weight")):
            t = t + 1.0
        sd["module." + k] = t
    sd["module.logit_scale"] = torch.tensor(2.6592)
    return sd


def inputs(size: int = 64, ctx: int = 32, vocab: int = VOCAB):
    """Images and token ids < vocab ending in an EOT (the largest id) followed by padding."""
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(1, vocab - 1, (2, ctx), generator=g)
    tok[0, 5:], tok[1, 9:] = 0, 0
    tok[0, 4], tok[1, 8] = vocab - 1, vocab - 1
    return torch.randn(2, 3, size, size, generator=g), tok


def feats(m, img, txt):
    with torch.no_grad():
        return m.encode_image(img), m.encode_text(txt)


def test_official_key_table_at_vit_b16():
    with torch.device("meta"):
        m = create_model("DiffCLIP-ViT-B-16")
    ours = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    spec = official_shapes(vw=768, vl=12, tw=512, tl=12, d=64, embed=512, grid=14, patch=16)
    assert ours == spec


@pytest.mark.parametrize("kind", ["pickle", "safetensors"])
def test_official_checkpoint_loads_strictly(tmp_path, kind):
    sd = official_state_dict()
    if kind == "pickle":  # SLIP format, with an argparse.Namespace that needs full unpickling
        path = tmp_path / "checkpoint_best.pt"
        torch.save({"epoch": 39, "state_dict": sd, "optimizer": {}, "scaler": {}, "best_acc1": 14.4,
                    "args": argparse.Namespace(model="DiffCLIP_VITB16", lr=5e-4)}, path)
        with pytest.raises(PermissionError, match="trust_pickle=True"):
            diffmm.load_pretrained(path)
        model = diffmm.load_pretrained(path, trust_pickle=True)
    else:
        path = tmp_path / "diffclip.safetensors"
        save_file(sd, str(path))
        model = diffmm.load_pretrained(path)
    assert model.config.vision_cfg.attn_type == model.config.text_cfg.attn_type == "diff"
    assert model.config.vision_cfg.heads == 4 and not model.config.vision_cfg.pre_norm
    ours = model.state_dict()
    assert set(ours) == {k[len("module."):] for k in sd}
    for k, v in sd.items():
        assert torch.equal(ours[k[len("module."):]], v), k
    # the same file into a named model, and features survive export -> load exactly
    named = create_model("DiffCLIP-Tiny", pretrained=str(path), trust_pickle=True, **TINY_OVERRIDES)
    model.save_pretrained(tmp_path / "export")
    back = diffmm.load_pretrained(tmp_path / "export")
    img, txt = inputs()
    for a, b, c in zip(feats(model, img, txt), feats(back, img, txt), feats(named, img, txt)):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_loading_errors_name_the_keys(tmp_path):
    sd = {k[len("module."):]: v for k, v in official_state_dict().items()}
    sd.pop("visual.blocks.1.attn.lambda_q1")
    sd["visual.blocks.0.attn.extra"] = torch.zeros(3)
    sd["text_projection"] = torch.zeros(128, 64)
    path = tmp_path / "bad.safetensors"
    save_file(sd, str(path))
    with pytest.raises(KeyError) as e:
        create_model("DiffCLIP-Tiny", pretrained=str(path), **TINY_OVERRIDES)
    msg = str(e.value)
    assert "missing keys: visual.blocks.1.attn.lambda_q1" in msg
    assert "unexpected keys: visual.blocks.0.attn.extra" in msg
    assert "mis-shaped: text_projection (128, 64) != (128, 128)" in msg
    with pytest.raises(FileNotFoundError, match="no such file"):
        diffmm.load_pretrained(tmp_path / "nope.pt")


def test_open_clip_file_and_local_dir(tmp_path):
    torch.manual_seed(0)
    oc = CLIP(**OC_CFG, quick_gelu=True).eval()
    torch.save({"epoch": 1, "state_dict": {"module." + k: v for k, v in oc.state_dict().items()}}, tmp_path / "e.pt")
    folder = tmp_path / "oc"
    folder.mkdir()
    save_file(oc.state_dict(), str(folder / "open_clip_model.safetensors"))
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": dict(OC_CFG, quick_gelu=True)}))
    img, txt = inputs(32, 16, vocab=49408)
    ref = feats(oc, img, txt)
    from_file = diffmm.load_pretrained(tmp_path / "e.pt", head_width=16, text_head_width=16, quick_gelu=True)
    from_dir = diffmm.load_pretrained(f"local-dir:{folder}")
    from_dir2 = create_model(f"local-dir:{folder}")
    assert diffmm.get_tokenizer(f"local-dir:{folder}")(["a cat"]).shape == (1, 16)
    for m in (from_file, from_dir, from_dir2):
        for a, b in zip(feats(m, img, txt), ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_timm_checkpoints(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    std = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2,
                                                          num_heads=4, num_classes=5).eval()
    diff = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, attn_layer="diff", num_classes=0,
        norm_layer=partial(nn.LayerNorm, eps=1e-5)).eval()
    for b in diff.blocks:
        nn.init.normal_(b.attn.sub_norm.weight, 1.0, 0.2)
    save_file(std.state_dict(), str(tmp_path / "std.safetensors"))
    torch.save(diff.state_dict(), tmp_path / "diff.pth")
    a = diffmm.load_pretrained(tmp_path / "std.safetensors", head_width=16)
    b = diffmm.load_pretrained(tmp_path / "diff.pth", norm_eps=1e-5)
    assert b.cfg.attn_type == "diff" and b.cfg.lambda_init == "depth"
    with torch.no_grad():
        torch.testing.assert_close(a(x), std.forward_head(std.forward_features(x), pre_logits=True), atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(b(x), diff(x), atol=1e-5, rtol=1e-5)
    # into the image tower of a named model (a timm standard ViT with pre-norm at CLIP-Tiny's sizes)
    tiny = timm.create_model("diffmm_clip_tiny")
    torch.save(tiny.state_dict(), tmp_path / "tiny.pth")
    m = create_model("CLIP-Tiny", pretrained=str(tmp_path / "tiny.pth"))
    x64 = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(m.visual(x64), tiny.eval()(x64))


def test_hf_hub_without_network(monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot(repo, local_files_only=False, **kw):
        calls.append(local_files_only)
        raise FileNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    with pytest.raises(ConnectionError, match=r"hf-hub:org/model: not in the local Hugging Face cache .* local-dir"):
        diffmm.load_pretrained("hf-hub:org/model")
    assert calls == [True, False]  # the cache, then the download


def test_export_cli_from_lightning_and_official(tmp_path, capsys):
    torch.manual_seed(0)
    model = create_model("DiffCLIP-Tiny", **TINY_OVERRIDES).eval()
    torch.save({"epoch": 1, "global_step": 10, "pytorch-lightning_version": "2.6.6",
                "state_dict": {"model." + k: v for k, v in model.state_dict().items()},
                "hyper_parameters": {"model_name": "DiffCLIP-Tiny", "model_kwargs": TINY_OVERRIDES, "lr": 5e-4}},
               tmp_path / "last.ckpt")
    assert diffmm_main(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "out")]) == 0
    img, txt = inputs()
    back = diffmm.load_pretrained(tmp_path / "out")
    for a, b in zip(feats(back, img, txt), feats(model, img, txt)):
        assert torch.equal(a, b)
    torch.save({"state_dict": official_state_dict(), "args": argparse.Namespace(a=1)}, tmp_path / "best.pt")
    assert diffmm_main(["export", str(tmp_path / "best.pt"), str(tmp_path / "out2")]) == 2
    assert "--trust_pickle true" in capsys.readouterr().err
    assert diffmm_main(["export", str(tmp_path / "best.pt"), str(tmp_path / "out2"), "--trust_pickle", "true"]) == 0
    assert json.loads((tmp_path / "out2" / "config.json").read_text())["diffmm_export"]["kind"] == "clip"


def test_open_clip_weights_into_named_open_clip_layout(tmp_path):
    torch.manual_seed(0)
    oc = CLIP(embed_dim=128, vision_cfg=dict(image_size=64, patch_size=8, width=128, layers=4, head_width=32),
              text_cfg=dict(context_length=32, vocab_size=49408, width=128, heads=4, layers=4)).eval()
    save_file(oc.state_dict(), str(tmp_path / "oc.safetensors"))
    m = create_model("OpenCLIP-Tiny", pretrained=str(tmp_path / "oc.safetensors")).eval()
    img, txt = inputs(64, 32, vocab=49408)
    for a, b in zip(feats(m, img, txt), feats(oc, img, txt)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(KeyError, match="missing keys: visual.patch_embed.proj.bias; unexpected keys: visual.norm_pre"):
        create_model("CLIP-Tiny", pretrained=str(tmp_path / "oc.safetensors"))  # DiffCLIP layout: no pre-norm
