"""A whole training step on CUDA tensors without a GPU (tests/fake_cuda.py): forward, loss, backward and the AdamW
step of DiffCLIP-Tiny, DiffCLIP-ViT-B-16 (bf16 weights), a LiT model with cached tower prefixes and the DIFF LM
(plus KV-cache generation) run on fake ``cuda:0`` tensors, where a CPU tensor meeting a CUDA one raises; each stage
has the dtype a GPU run would give, and the dispatch picks the fused Triton op (its fake implementation runs)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import diffmm
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.train.losses import ContrastiveLoss
from diffmm.train.optim import adamw
from fake_cuda import backward, fake_cuda, one_gpu, ops_called, to_fake_cuda

pytest.importorskip("triton")
CUDA = torch.device("cuda:0")


def optimizer_step(model: torch.nn.Module) -> None:
    """Every trainable parameter has a gradient of its own dtype on its device; diffmm's AdamW (fused on CUDA)
    steps."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            assert (p.grad.device, p.grad.dtype) == (CUDA, p.dtype), name
    adamw(model, 1e-3, 0.1, (0.9, 0.98), 1e-8).step()


def clip_step(model, images, tokens, ops) -> None:
    img, txt = model.encode_image(images), model.encode_text(tokens)
    low = model.image_projection.dtype
    assert (img.device, img.dtype, txt.dtype) == (CUDA, low, low)
    loss = ContrastiveLoss()(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), model.logit_scale_value())
    assert (loss.device, loss.dtype, loss.shape) == (CUDA, torch.float32, ())
    backward(loss)
    optimizer_step(model)
    assert ops["aten::_fused_adamw_"] > 0


@pytest.mark.parametrize("name", ["DiffCLIP-Tiny", "DiffCLIP-ViT-B-16"])
def test_diffclip_step(name):
    with torch.device("meta"):  # shapes only: the fake step needs no weights
        model = diffmm.create_model(name, precision="bf16")
    layers = model.config.vision_cfg.layers + model.config.text_cfg.layers
    with fake_cuda() as mode:
        to_fake_cuda(model, mode)
        size, ctx = model.config.vision_cfg.image_size, model.config.text_cfg.context_length
        with one_gpu(), ops_called() as ops:
            clip_step(model, torch.randn(2, 3, size, size), torch.randint(0, 49408, (2, ctx)), ops)
    assert ops["diffmm::triton_diff_fwd"] == ops["diffmm::triton_diff_bwd"] == layers


def test_diffclip_step_on_the_sdpa_backend(monkeypatch):
    """A GPU without the fused kernel: the sdpa backend's CUDA layouts (split; pair for short queries)."""
    with torch.device("meta"):
        model = diffmm.create_model("DiffCLIP-Tiny", precision="bf16")
    monkeypatch.setenv("DIFFMM_ATTN_BACKEND", "sdpa")
    with fake_cuda() as mode:
        to_fake_cuda(model, mode)
        with one_gpu(), ops_called() as ops:
            clip_step(model, torch.randn(2, 3, 64, 64), torch.randint(0, 49408, (2, 8)), ops)
    # (without a GPU, torch's SDPA picks its math kernel for fake tensors)
    assert ops["diffmm::triton_diff_fwd"] == ops["diffmm::combined_diff_fwd"] == 0 and ops["aten::bmm"] > 0


def test_lit_step_with_cached_prefixes(tmp_path):
    """LiT: both towers locked below their last layers, what is locked computed once (the feature caches' part,
    under no_grad), the unlocked layers, projections and loss trained on CUDA."""
    from hf_helpers import write_tiny_bert

    cfg = {"embed_dim": 64,
           "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 128, "layers": 2, "head_width": 32,
                          "attn_type": "diff", "lambda_init": "constant"},
           "text_cfg": {"hf_model_name": str(write_tiny_bert(tmp_path / "bert")), "context_length": 16,
                        "attn_type": ["standard", "diff", "diff"]}}
    (tmp_path / "lit.json").write_text(json.dumps(cfg))
    model = diffmm.create_model(str(tmp_path / "lit.json"))  # on the CPU: Hugging Face loads real weights
    v_start, t_start = 1, 2  # the first block / layer that trains
    trained = ("visual.blocks.1.", "visual.norm.", "text.transformer.encoder.layer.2.", "image_projection",
               "text.proj", "logit_scale")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(trained))
    with fake_cuda() as mode:
        to_fake_cuda(model, mode)
        images, tokens = torch.randn(2, 3, 32, 32), torch.randint(0, 20, (2, 16))
        with one_gpu(), ops_called() as ops:
            with torch.no_grad():
                hv = model.visual.prefix(images, v_start)
                ht, mask = model.text.prefix(tokens, t_start)
            img = model.visual.suffix(hv, v_start) @ model.image_projection
            txt = model.text.proj(model.text.suffix(ht, mask, t_start))
            assert (img.device, img.dtype, txt.dtype) == (CUDA, torch.float32, torch.float32)
            loss = ContrastiveLoss()(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), model.logit_scale_value())
            backward(loss)
            optimizer_step(model)
    # the image tower's head dim 32 takes the fused kernel; the tiny BERT's (8) and its additive mask take sdpa
    assert (ops["diffmm::triton_diff_fwd"], ops["diffmm::triton_diff_bwd"]) == (2, 1)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_lm_step_and_generation():
    """DIFF LM (GQA, head dim 64) under bf16 autocast: logits bf16, loss and gradients fp32, with the logits and
    with the fused head loss; then KV-cache generation (one fused call per layer and token)."""
    with torch.device("meta"):
        model = DiffLM(LMConfig.from_name("diff-tiny", width=256, kv_heads=2))
    with fake_cuda() as mode:
        to_fake_cuda(model, mode)
        idx = torch.randint(0, 256, (2, 16))
        with one_gpu(), ops_called() as ops:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, loss = model(idx, idx)
            assert (logits.device, logits.dtype, loss.dtype) == (CUDA, torch.bfloat16, torch.float32)
            backward(loss)
            optimizer_step(model)
            assert ops["diffmm::triton_diff_fwd"] == ops["diffmm::triton_diff_bwd"] == 2
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):  # the fused head loss: no logits
                logits, loss = model(idx, idx, return_logits=False)
            assert (logits, loss.device, loss.dtype) == (None, CUDA, torch.float32)
            backward(loss)
            optimizer_step(model)
            out = model.generate(idx[:, :4], 3, greedy=True)
        assert (out.shape, out.device, out.dtype) == ((2, 7), CUDA, torch.int64)
        assert ops["diffmm::triton_diff_fwd"] == 4 + 3 * 2


def test_a_cpu_tensor_in_the_step_is_caught():
    """The check can fail: a CPU tensor meeting the CUDA ones raises in the forward, a CPU gradient in backward."""
    class CPUGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return torch.ones(g.shape, device="cpu")

    with fake_cuda():
        x = torch.randn(3, 4, requires_grad=True)
        with pytest.raises(RuntimeError, match="cpu"):
            x @ torch.randn(4, 2, device="cpu")
        with pytest.raises(RuntimeError, match="gradient on cpu"):
            backward(CPUGrad.apply(x).sum())
