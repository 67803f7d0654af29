"""FX tracing and ``torch.export`` of the ``diffmm_*`` timm models, as timm 1.0.31's ``tests/test_models.py`` checks
its own models (``test_model_forward_fx`` / ``test_model_backward_fx``: torchvision's feature extraction with timm's
leaf modules and autowrapped functions), plus timm's ``feature_cls='fx'`` wrapper and plain ``symbolic_trace``.

The tiny models run by default (backward: one per attention type), every registered ``diffmm_*`` model with
``-m slow``. TorchScript is not supported
(docs/models.md).
"""
from __future__ import annotations

import pytest
import timm
import torch
from timm.models import get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import NodePathTracer, create_feature_extractor, get_graph_node_names

from diffmm.models.timm_models import TIMM_MODELS
from diffmm.ops import attention

TINY = [n for n in TIMM_MODELS if n.endswith("_tiny") or "_tiny_" in n]
MODELS = TINY + [pytest.param(n, marks=pytest.mark.slow) for n in TIMM_MODELS if n not in TINY]
#: one tiny model per attention type (standard, diff constant / depth lambda_init, DIFF V2) by default
BWD = ["diffmm_clip_tiny", "diffmm_diffclip_tiny", "diffmm_diffclip_star_tiny", "diffmm_diffclipv2_tiny"]
BWD_MODELS = BWD + [pytest.param(n, marks=pytest.mark.slow) for n in TIMM_MODELS if n not in BWD]


def _create_fx_model(model, train=False):
    """timm 1.0.31 ``tests/test_models.py::_create_fx_model``, unchanged."""
    tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
                         param_shapes_constant=True)
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)
    eval_return_nodes = [eval_nodes[-1]]
    train_return_nodes = [train_nodes[-1]]
    if train:
        tracer = NodePathTracer(**tracer_kwargs)
        graph = tracer.trace(model)
        graph_nodes = list(reversed(graph.nodes))
        output_node_names = [n.name for n in graph_nodes[0]._input_nodes.keys()]
        graph_node_names = [n.name for n in graph_nodes]
        output_node_indices = [-graph_node_names.index(node_name) for node_name in output_node_names]
        train_return_nodes = [train_nodes[ix] for ix in output_node_indices]
    return create_feature_extractor(model, train_return_nodes=train_return_nodes,
                                    eval_return_nodes=eval_return_nodes, tracer_kwargs=tracer_kwargs)


def _input_size(model) -> tuple:
    return model.pretrained_cfg["input_size"]


def test_tiny_models_cover_every_attention_type():
    assert set(BWD) <= set(TINY)


@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward_fx(model_name):
    """timm's ``test_model_forward_fx``: the traced model's output equals the model's."""
    model = timm.create_model(model_name, pretrained=False).eval()
    with torch.inference_mode():
        inputs = torch.randn((1, *_input_size(model)))
        outputs = model(inputs)
        fx_outputs = torch.cat(tuple(_create_fx_model(model)(inputs).values()))
    torch.testing.assert_close(fx_outputs, outputs, rtol=1e-4, atol=1e-5)
    assert not torch.isnan(outputs).any()


@pytest.mark.parametrize("model_name", BWD_MODELS)
def test_model_backward_fx(model_name):
    """timm's ``test_model_backward_fx``: every parameter of the traced model gets a gradient."""
    model = timm.create_model(model_name, pretrained=False, num_classes=42).train()
    num_params = sum(p.numel() for p in model.parameters())
    fx_model = _create_fx_model(model, train=True)
    outputs = torch.cat(tuple(fx_model(torch.randn((2, *_input_size(model)))).values()))
    outputs.mean().backward()
    for n, p in fx_model.named_parameters():
        assert p.grad is not None, f"No gradient for {n}"
    assert outputs.shape[-1] == 42
    assert num_params == sum(p.grad.numel() for p in fx_model.parameters() if p.grad is not None)


def test_symbolic_trace_exposes_attention_internals_and_matches():
    """Plain ``torch.fx.symbolic_trace`` (no timm tracer settings): the projections are graph nodes, the attention
    kernel one leaf call; torchvision can return an inner node (the queries of block 0)."""
    model = timm.create_model("diffmm_diffclip_tiny").eval()
    x = torch.randn(2, *_input_size(model))
    gm = torch.fx.symbolic_trace(model)
    calls = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "__name__")]
    assert calls.count("diff_attention") == len(model.blocks)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
        q = create_feature_extractor(model, return_nodes=["blocks.0.attn.q_proj"])(x)["blocks.0.attn.q_proj"]
        h = model.norm_pre(model._pos_embed(model.patch_embed(x)))  # (B, N, E) into block 0
        torch.testing.assert_close(q, model.blocks[0].attn.q_proj(model.blocks[0].norm1(h)))


def test_timm_fx_feature_wrapper_matches_getter():
    """timm's own FX feature extraction (``features_only=True, feature_cls='fx'``: the blocks' token outputs)
    gives the getter's maps (patch tokens as (B, C, H, W))."""
    fx = timm.create_model("diffmm_diffclip_tiny", features_only=True, feature_cls="fx", out_indices=(1, 2)).eval()
    getter = timm.create_model("diffmm_diffclip_tiny", features_only=True, out_indices=(1, 2)).eval()
    getter.model.load_state_dict({k.removeprefix("graph_module."): v for k, v in fx.state_dict().items()},
                                 strict=False)  # the getter keeps no head
    x = torch.randn(1, *timm.get_pretrained_cfg_value("diffmm_diffclip_tiny", "input_size"))
    with torch.no_grad():
        for a, b in zip(fx(x), getter(x), strict=True):
            torch.testing.assert_close(a[:, 1:].transpose(1, 2).reshape(b.shape), b)  # CLS token first


@pytest.mark.parametrize("model_name", ["diffmm_diffclip_tiny", "diffmm_diffclipv2_tiny"])
def test_torch_export(model_name):
    """``torch.export`` of a differential timm model runs and matches eager."""
    model = timm.create_model(model_name).eval()
    x = torch.randn(2, *_input_size(model))
    ep = torch.export.export(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), model(x))


def test_unwrapped_op_under_fx_is_a_one_line_error():
    """A user module calling a diffmm op without ``torch.fx.wrap`` gets told what to do, not a type error."""
    class Raw(torch.nn.Module):
        def forward(self, q):
            return attention(q, q, q)

    with pytest.raises(TypeError, match="q is an FX Proxy: .*torch.fx.wrap"):
        torch.fx.symbolic_trace(Raw())
