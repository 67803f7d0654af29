"""swap_attention on Hugging Face BERT-family encoders (a tiny random ``BertConfig``; no downloads)."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

import diffmm
from diffmm.models.attn_adapters import HFBertDiffV2Attention, HFBertUpcycledDiffAttention
from diffmm.models.swap import get_attn
from diffmm.nn import DiffAttention, DiffV2Attention, UpcycledDiffAttention

transformers = pytest.importorskip("transformers")

TOL = dict(atol=1e-5, rtol=1e-5)
IMPLS = ("eager", "sdpa")


def tiny_bert(impl: str, seed: int = 0) -> nn.Module:
    """A 3-layer BERT (width 32, 4 heads) with random weights, in eval mode."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=16)
    return transformers.BertModel._from_config(cfg, attn_implementation=impl).eval()


def batch() -> dict[str, torch.Tensor]:
    """Three sequences of 7 tokens; the second and third are padded (mask 0 at the end)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 60, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def hidden(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).last_hidden_state


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("attn_type", ["diff", "diff_v2"])
def test_upcycle_preserves_function(impl, attn_type):
    model, inputs = tiny_bert(impl), batch()
    ref = hidden(model, inputs)
    no_mask = hidden(model, {"input_ids": inputs["input_ids"]})
    diffmm.swap_attention(model, attn_type=attn_type, init="upcycle", generator=torch.Generator().manual_seed(0))
    cls = HFBertUpcycledDiffAttention if attn_type == "diff" else HFBertDiffV2Attention
    for layer in model.encoder.layer:
        assert type(layer.attention.self) is cls
        assert isinstance(layer.attention.output.dense, nn.Identity)
    torch.testing.assert_close(hidden(model, inputs), ref, **TOL)
    torch.testing.assert_close(hidden(model, {"input_ids": inputs["input_ids"]}), no_mask, **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_is_masked(impl):
    """Changing a padded token changes nothing at the kept positions of the upcycled model."""
    model, inputs = tiny_bert(impl), batch()
    diffmm.swap_attention(model, attn_type="diff", init="upcycle")
    other = dict(inputs, input_ids=inputs["input_ids"].clone())
    other["input_ids"][1, 5] = (other["input_ids"][1, 5] % 59) + 1
    torch.testing.assert_close(hidden(model, other)[1, :4], hidden(model, inputs)[1, :4], **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_per_layer_selection(impl):
    model, inputs = tiny_bert(impl), batch()
    ref = hidden(model, inputs)
    diffmm.swap_attention(model, attn_type="diff", init="upcycle", layers=[0, -1])
    kinds = [type(get_attn(layer)).__name__ for layer in model.encoder.layer]
    assert kinds == ["HFBertUpcycledDiffAttention", "BertAttention", "HFBertUpcycledDiffAttention"]
    assert isinstance(model.encoder.layer[1].attention.output.dense, nn.Linear)
    torch.testing.assert_close(hidden(model, inputs), ref, **TOL)
    diffmm.swap_attention(model, attn_type="diff_v2", init="upcycle", layers={"text": 1})  # the remaining layer
    assert isinstance(get_attn(model.encoder.layer[1]), DiffV2Attention)
    torch.testing.assert_close(hidden(model, inputs), ref, **TOL)
    assert [r["layers"] for r in model.diffmm_swaps] == [[0, 2], [1]]
    with pytest.raises(ValueError, match="no visual tower"):
        diffmm.swap_attention(model, towers="visual")


@pytest.mark.parametrize("impl", IMPLS)
def test_scratch_swap_runs(impl):
    model, inputs = tiny_bert(impl), batch()
    diffmm.swap_attention(model, attn_type="diff", init="scratch", layers=1)
    layer = get_attn(model.encoder.layer[1])
    assert isinstance(layer, DiffAttention) and not isinstance(layer, UpcycledDiffAttention)
    assert layer.num_heads == 2  # 4 standard heads -> 2 differential heads
    assert hidden(model, inputs).shape == (3, 7, 32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("attn_type", ["diff", "diff_v2"])
def test_gradients_reach_lambdas(impl, attn_type):
    model, inputs = tiny_bert(impl), batch()
    diffmm.swap_attention(model, attn_type=attn_type, init="upcycle", generator=torch.Generator().manual_seed(0))
    model.train()
    out = model(**inputs).last_hidden_state
    keep = inputs["attention_mask"][..., None].float()
    ((out * keep).pow(2).sum() / keep.sum()).backward()
    names = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "norm_gate") if attn_type == "diff" \
        else ("lambda_proj.weight",)
    for i, layer in enumerate(model.encoder.layer):
        params = dict(layer.attention.self.named_parameters())
        for n in names:
            assert params[n].grad is not None and params[n].grad.abs().sum() > 0, f"layer {i}: no gradient for {n}"
    assert model.embeddings.word_embeddings.weight.grad.abs().sum() > 0


def test_swapped_model_pickles_and_rejects_cross_attention():
    model, inputs = tiny_bert("sdpa"), batch()
    diffmm.swap_attention(model, attn_type="diff", init="upcycle")
    clone = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(hidden(clone, inputs), hidden(model, inputs))
    layer = copy.deepcopy(model.encoder.layer[0].attention.self)
    with pytest.raises(ValueError, match="only encoder self-attention"):
        layer(torch.zeros(1, 3, 32), encoder_hidden_states=torch.zeros(1, 3, 32))


def test_open_clip_hf_text_tower(tmp_path):
    """An open_clip ``CustomTextCLIP`` whose text tower is a Hugging Face BERT (``HFTextEncoder``, built from a
    local config folder): the text tower swaps, its features at step 0 equal the original's."""
    open_clip_model = pytest.importorskip("open_clip.model")
    transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=16).save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = open_clip_model.CustomTextCLIP(
        embed_dim=24, vision_cfg=dict(image_size=32, patch_size=8, width=64, layers=1, head_width=16),
        text_cfg=dict(hf_model_name=str(tmp_path), hf_model_pretrained=False, hf_pooler_type="mean_pooler",
                      hf_proj_type="linear", context_length=8, vocab_size=60)).eval()
    ids = torch.randint(1, 60, (3, 8), generator=torch.Generator().manual_seed(2))
    ids[1, 5:] = 0  # pad_token_id: HFTextEncoder masks these
    with torch.no_grad():
        ref = model.encode_text(ids)
    diffmm.swap_attention(model, towers="text", attn_type="diff", init="upcycle")
    assert all(type(get_attn(b)) is HFBertUpcycledDiffAttention for b in model.text.transformer.encoder.layer)
    with torch.no_grad():
        torch.testing.assert_close(model.encode_text(ids), ref, **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_roberta_family(impl):
    """RoBERTa has BERT's attention layout (its own classes), so it swaps the same way."""
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=20)
    model, inputs = transformers.RobertaModel._from_config(cfg, attn_implementation=impl).eval(), batch()
    ref = hidden(model, inputs)
    diffmm.swap_attention(model, attn_type="diff_v2", init="upcycle")
    assert all(type(get_attn(b)) is HFBertDiffV2Attention for b in model.encoder.layer)
    torch.testing.assert_close(hidden(model, inputs), ref, **TOL)


def test_other_layouts_are_refused():
    cfg = transformers.DistilBertConfig(vocab_size=60, dim=32, n_heads=4, n_layers=1, hidden_dim=64)
    with pytest.raises(TypeError, match="does not know where the attention blocks of DistilBertModel are"):
        diffmm.swap_attention(transformers.DistilBertModel(cfg))
