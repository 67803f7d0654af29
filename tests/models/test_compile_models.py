"""``torch.compile(fullgraph=True)`` of whole differential models: DiffCLIP, a LiT model (Hugging Face text tower
with upcycled differential layers under a padding mask) and the DIFF LM. On the CPU the compiled training loss and
its gradients equal eager's; on fake CUDA tensors (tests/fake_cuda.py) the capture is one graph holding the fused
Triton op, run to its gradients. Tiny models: compiling is slow on 2 cores (inductor's code generation only in the
slow tests)."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F

import diffmm
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.train.losses import ContrastiveLoss
from fake_cuda import backward, fake_cuda, to_fake_cuda, trusting_triton

TOL = dict(atol=2e-5, rtol=2e-5)
SHRINK = {"embed_dim": 16, "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 1, "head_width": 8},
          "text_cfg": {"context_length": 16, "width": 32, "heads": 4, "layers": 1}}


def clip_loss(model, images, tokens):
    img, txt = model.encode_image(images), model.encode_text(tokens)
    return ContrastiveLoss()(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), model.logit_scale_value())


def lm_loss(model, idx):
    return model(idx, idx)[1]


def diffclip():
    return diffmm.create_model("DiffCLIP-Tiny", **SHRINK), (torch.randn(3, 3, 16, 16),
                                                            torch.randint(0, 49408, (3, 16)))


def lit(root):
    from hf_helpers import write_tiny_bert

    cfg = {"embed_dim": 16,
           "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 1, "head_width": 8,
                          "attn_type": "diff"},
           "text_cfg": {"hf_model_name": str(write_tiny_bert(root / "bert", layers=2)), "context_length": 12,
                        "attn_type": ["standard", "diff"]}}
    (root / "lit.json").write_text(json.dumps(cfg))
    tokens = torch.randint(5, 20, (3, 12))
    tokens[0, 7:] = tokens[1, 4:] = 0  # padding: the key-padding mask reaches the differential layer
    return diffmm.create_model(str(root / "lit.json")), (torch.randn(3, 3, 16, 16), tokens)


def lm():
    return DiffLM(LMConfig.from_name("diff-tiny", n_layer=1)), (torch.randint(0, 256, (2, 24)),)


def eager_and_compiled(model, loss_fn, inputs, backend):
    """(loss, grads) of eager and of the fullgraph-compiled loss."""
    results = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True, backend=backend)):
        model.zero_grad(set_to_none=True)
        loss = fn(model, *inputs)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    return results


@pytest.mark.parametrize("which", ["diffclip", "lit"])  # the LM: tests/models/test_lm.py
def test_fullgraph_compile_matches_eager_cpu(which, tmp_path):
    torch._dynamo.reset()
    model, inputs = diffclip() if which == "diffclip" else lit(tmp_path)
    (loss, grads), (c_loss, c_grads) = eager_and_compiled(model, clip_loss, inputs, "aot_eager")
    torch.testing.assert_close(c_loss, loss, **TOL)
    assert c_grads.keys() == grads.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], **TOL, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["diffclip", "lm"])
def test_inductor_compile_matches_eager_cpu(which):
    torch._dynamo.reset()
    model, inputs = {"diffclip": diffclip, "lm": lm}[which]()
    (loss, grads), (c_loss, c_grads) = eager_and_compiled(model, lm_loss if which == "lm" else clip_loss, inputs,
                                                          "inductor")
    torch.testing.assert_close(c_loss, loss, **TOL)
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("which", ["diffclip", "lit", "lm"])
def test_fullgraph_capture_on_fake_cuda(which, tmp_path):
    """Tracing only (a backend that keeps dynamo's graph and runs it): without a GPU, AOTAutograd cannot trace a
    CUDA backward (tests/fake_cuda.py); the gradients of the captured forward come from the graph walk. DiffCLIP-Tiny
    and an LM of head dim 64 take the fused Triton op; the tiny LiT (head dim 8) sdpa's CUDA layout."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fused = contextlib.nullcontext()
    if which == "lit":
        model, inputs = lit(tmp_path)  # Hugging Face loads real weights: built on the CPU
    else:
        fused = trusting_triton()
        with torch.device("meta"):
            if which == "lm":
                model, inputs = DiffLM(LMConfig.from_name("diff-tiny", width=256)), (torch.randint(0, 256, (2, 16)),)
            else:
                model = diffmm.create_model("DiffCLIP-Tiny")
                inputs = (torch.randn(2, 3, 64, 64), torch.randint(0, 49408, (2, 32)))
    loss_fn = lm_loss if which == "lm" else clip_loss
    with fake_cuda() as mode, fused:
        to_fake_cuda(model, mode)
        inputs = [mode.from_tensor(t).to("cuda:0") for t in inputs]
        loss = torch.compile(loss_fn, fullgraph=True, backend=capture)(model, *inputs)
        assert (loss.device, loss.dtype) == (torch.device("cuda:0"), torch.float32)
        backward(loss)
        assert all(p.grad is not None and p.grad.device == loss.device for p in model.parameters())
    assert len(graphs) == 1
    code = "".join(m.code for m in graphs[0].modules() if isinstance(m, torch.fx.GraphModule))
    layers = {"diffclip": 8, "lit": 0, "lm": 2}[which]
    assert code.count("diffmm.triton_diff_fwd") == code.count("diffmm.triton_diff_bwd") == layers
