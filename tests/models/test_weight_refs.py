"""Weights named by reference: the hash covers names, shapes, dtypes and bytes; restoring checks it."""
from __future__ import annotations

import pytest
import torch

from diffmm.models.weight_refs import restore_weights, weight_reference, weights_digest


def test_digest_sees_every_change():
    base = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    d = weights_digest(base)
    assert d == weights_digest({k: v.clone() for k, v in reversed(base.items())})  # order of the dict: no matter
    for changed in ({**base, "a": base["a"].view(3, 2)}, {**base, "a": base["a"].double()},
                    {"c": base["a"], "b": base["b"]}, {**base, "b": base["b"] * 2}):
        assert weights_digest(changed) != d


def test_restore_puts_back_and_checks():
    model = {"enc.w": torch.randn(3, 3), "enc.b": torch.randn(3), "proj": torch.randn(2, 3)}
    ref = weight_reference({k: model[k] for k in ("enc.w", "enc.b")}, "text_cfg.hf_model_name x")
    sd = restore_weights({"model.proj": model["proj"] + 1}, [ref], model, prefix="model.")
    assert sd.keys() == {"model.proj", "model.enc.w", "model.enc.b"} and torch.equal(sd["model.enc.w"], model["enc.w"])
    other = {**model, "enc.b": model["enc.b"] + 1e-6}
    with pytest.raises(ValueError, match=r"^ckpt: text_cfg.hf_model_name x now gives other weights") as e:
        restore_weights({}, [ref], other, where="ckpt")
    assert "\n" not in str(e.value)
    with pytest.raises(KeyError, match="gives no enc.w"):
        restore_weights({}, [ref], {"enc.b": model["enc.b"]})
    assert restore_weights({"p": model["proj"]}, None, {}) == {"p": model["proj"]}
