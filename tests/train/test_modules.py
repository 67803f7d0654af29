"""CLIPModule / LMModule pieces: logit-scale clamp, lambda logging, grad checkpointing, compile, precision, warmup."""
from __future__ import annotations

import math

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.utils.checkpoint

from train_configs import SHRINK
from diffmm.train.base import enable_grad_checkpointing
from diffmm.train.clip_module import MAX_LOGIT_SCALE, CLIPModule
from diffmm.train.datamodules import ImageTextDataModule
from diffmm.train.lm_module import LMModule
from diffmm.train.monitor import lambda_layers, lambda_values
from train_helpers import TinyCLIP


def test_logit_scale_clamped_at_100():
    module = CLIPModule(model=TinyCLIP())
    with torch.no_grad():
        module.model.logit_scale.fill_(math.log(1000.0))
    images, tokens = torch.randn(4, 3, 16, 16), torch.randint(1, 100, (4, 16))
    _, _, scale = module.features(images, tokens)
    assert float(scale) == 100.0
    module.on_train_batch_end(None, None, 0)  # after the optimizer step
    assert float(module.model.logit_scale) == float(torch.tensor(MAX_LOGIT_SCALE, dtype=torch.float32))


def test_lambda_values_are_each_layers_lambda():
    model = TinyCLIP()
    vals = lambda_values(lambda_layers(model))
    assert set(vals) == {"lambda/visual.blocks.0.attn", "lambda/transformer.0.attn", "lambda_mean/visual",
                         "lambda_mean/transformer"}
    assert vals["lambda/visual.blocks.0.attn"] == float(model.visual.blocks[0].attn.lambda_full())
    assert vals["lambda_mean/transformer"] == float(model.transformer[0].attn.lambda_full())


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x.sum()


def test_generic_grad_checkpointing_same_grads(monkeypatch):
    torch.manual_seed(0)
    plain, ckpt = _Blocks(), _Blocks()
    ckpt.load_state_dict(plain.state_dict())
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert enable_grad_checkpointing(ckpt) == 3
    x = torch.randn(4, 8)
    plain(x).backward()
    ckpt(x).backward()
    assert len(calls) == 3
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)
    assert set(plain.state_dict()) == set(ckpt.state_dict())


def test_grad_checkpointing_uses_the_models_switch():
    module = CLIPModule("DiffCLIP-Tiny", model_kwargs=SHRINK, grad_checkpointing=True)
    assert module.model.transformer.grad_checkpointing


def test_compile_keeps_checkpoint_keys(monkeypatch, text_data):
    compiled = []

    def fake_compile(model, **kw):
        compiled.append(model)
        return lambda *a, **k: ("compiled", model(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)
    module = LMModule("diff-tiny", model_kwargs={"n_layer": 1, "n_embd": 32, "n_head": 4}, tokenizer=text_data[2],
                      compile=True)
    keys = set(module.state_dict())
    module.configure_model()
    assert compiled == [module.model] and set(module.state_dict()) == keys
    assert module.run_model(torch.zeros(1, 4, dtype=torch.long))[0] == "compiled"


def test_lm_vocab_comes_from_the_tokenizer(text_data):
    module = LMModule("diff-tiny", model_kwargs={"n_layer": 1, "n_embd": 32, "n_head": 4}, tokenizer=text_data[2])
    assert module.model.config.vocab_size == 320  # 300 BPE tokens padded to a multiple of 64
    assert module.context_length == 64 and module.tokenizer == text_data[2]


def test_bf16_mixed_fit_and_warmup_epochs(tmp_path, image_text_data):
    """bf16 autocast on CPU trains; warmup_epochs becomes steps per epoch x epochs."""
    module = CLIPModule("DiffCLIP-Tiny", model_kwargs=SHRINK, warmup_epochs=0.5, lr=1e-3)
    data = ImageTextDataModule(image_text_data[0], batch_size=16, num_workers=0, image_size=16, context_length=16)
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, precision="bf16-mixed", logger=False, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.lr_lambdas[0].warmup_steps == 3  # 96 samples / 16 = 6 steps per epoch, half of it
    assert sched.lr_lambdas[0].total_steps == 3
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))


def test_lm_training_step_takes_the_fused_head_loss_between_logging_steps(monkeypatch, text_data):
    """Off the logging steps the DIFF LM's step skips the logits (head and loss fused); the loss is the same."""
    module = LMModule("diff-tiny", model_kwargs={"layers": 1, "width": 32, "heads": 4}, tokenizer=text_data[2])
    batch = torch.randint(0, 300, (2, 17))
    calls = []
    forward = module.model.forward
    monkeypatch.setattr(module.model, "forward", lambda *a, **k: calls.append(k) or forward(*a, **k))
    fused = module.training_step(batch, 0)  # no trainer attached: not a logging step
    assert calls[-1].get("return_logits") is False
    monkeypatch.setattr(module, "should_log_now", lambda: True)
    monkeypatch.setattr(module, "log_step", lambda *a, **k: None)
    with_logits = module.training_step(batch, 1)
    assert "return_logits" not in calls[-1]
    torch.testing.assert_close(fused, with_logits)
