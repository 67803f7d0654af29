"""Checkpoints and exports written before Lightning checkpoints carried their model record (the fixtures in
``old_format/``, written by diffmm at ce43097) still load, as the same models."""
from pathlib import Path

import pytest
import torch

import diffmm

OLD = Path(__file__).parent / "old_format"


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["clip", "lm"])
def test_old_checkpoint_and_export_load_as_one_model(kind):
    ckpt = diffmm.load_pretrained(OLD / f"{kind}.ckpt")
    export = diffmm.load_pretrained(OLD / f"{kind}_export")
    assert type(ckpt) is type(export) and ckpt.config == export.config and not ckpt.training
    assert_same(ckpt, export)
    assert_same(diffmm.create_model(str(OLD / f"{kind}.ckpt")), export)


def test_old_lm_checkpoint_vocabulary_from_its_weights():
    """The old LM checkpoint records only model_name / model_kwargs and a tokenizer path that is gone: the padded
    vocabulary (40 tokens -> 64) comes from the embedding, as the export's config says."""
    lm = diffmm.load_pretrained(OLD / "lm.ckpt")
    assert lm.config.vocab_size == 64 == lm.wte.weight.shape[0]
    assert lm(torch.tensor([[1, 2, 3]])).shape == (1, 3, 64)


def test_old_checkpoint_as_pretrained_of_its_config():
    model = diffmm.create_model("DiffCLIP-Tiny", pretrained=str(OLD / "clip.ckpt"),
                                **diffmm.load_pretrained(OLD / "clip_export").config.to_dict())
    assert_same(model, diffmm.load_pretrained(OLD / "clip_export"))
