"""``diffmm fit`` on CPU: the loss falls, checkpoints are written, ``validate`` and ``predict`` run from them."""
from __future__ import annotations

import os

import pytest
import torch

from train_configs import clip_config, lm_config, read_metrics, series, write_yaml
from diffmm.train.cli import run_cli


def _falls(loss: dict[int, float], k: int = 4) -> tuple[float, float]:
    steps = sorted(loss)
    first = sum(loss[s] for s in steps[:k]) / k
    last = sum(loss[s] for s in steps[-k:]) / k
    return first, last


def test_lm_fit_validate_predict(tmp_path, text_data):
    root = str(tmp_path / "run")
    cfg = write_yaml(tmp_path / "lm.yaml", lm_config(root, text_data, max_steps=30, val_check_interval=15))
    run_cli(["fit", "--config", cfg])
    rows = read_metrics(root)
    first, last = _falls(series(rows, "train/loss"))
    assert last < first - 0.5, (first, last)
    assert series(rows, "val/ppl"), "validation perplexity was logged"
    assert series(rows, "train/tokens_per_s"), "throughput was logged"
    assert series(rows, "lambda/blocks.0.attn"), "lambda was logged"
    ckpt = os.path.join(root, "checkpoints", "last.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    # data position, saved through Lightning's stateful-dataloader protocol: 30 steps = whole epochs + batches
    [pos] = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert "TextDataModule" not in state  # no second copy in the data module's state
    assert state["global_step"] == 30 and pos["epoch"] * pos["epoch_batches"] + pos["batches"] == 30
    assert state["lr_schedulers"][0]["lr_lambdas"][0]["total_steps"] == 30

    cli = run_cli(["validate", "--config", cfg, "--ckpt_path", ckpt])
    val_loss = float(cli.trainer.callback_metrics["val/loss"])
    assert val_loss < first
    out = str(tmp_path / "pred")
    run_cli(["predict", "--config", cfg, "--ckpt_path", ckpt, "--prediction_writer.output_dir", out,
             "--trainer.limit_predict_batches", "2"])
    pred = torch.load(os.path.join(out, "predictions_rank0.pt"), weights_only=True)
    assert pred["nll"].ndim == 1 and len(pred["nll"]) >= 8 and torch.isfinite(pred["nll"]).all()
    # every row names the document and token where it starts
    assert len(pred["keys"]) == len(pred["nll"]) and all(":" in k for k in pred["keys"])


@pytest.mark.parametrize("model_name", ["DiffCLIP-Tiny", "CLIP-Tiny"])
def test_clip_fit_validate_predict(tmp_path, image_text_data, model_name):
    root = str(tmp_path / "run")
    config = clip_config(root, image_text_data, max_steps=24, val_check_interval=12, model_name=model_name)
    config["model"]["init_args"]["zeroshot"] = {  # colour classes of the val images
        "dataset": image_text_data[1], "classnames": ["red", "green", "blue"], "templates": ["a {} shape"],
        "label_field": "json:label", "batch_size": 8}
    cfg = write_yaml(tmp_path / "clip.yaml", config)
    run_cli(["fit", "--config", cfg])
    rows = read_metrics(root)
    first, last = _falls(series(rows, "train/loss"))
    assert last < first - 0.3, (first, last)
    keys = ["train/logit_scale", "train/samples_per_s", "lr-AdamW/decay", "val/loss", "data_train/samples_in",
            "zeroshot/top1"]
    if model_name.startswith("Diff"):
        keys += ["lambda/visual.blocks.0.attn", "lambda_mean/transformer"]
    else:
        assert not any(k.startswith("lambda") for k in rows[0]), "standard attention has no lambda"
    for key in keys:
        assert series(rows, key), key
    ckpt = os.path.join(root, "checkpoints", "last.ckpt")
    assert os.path.exists(ckpt)
    cli = run_cli(["validate", "--config", cfg, "--ckpt_path", ckpt])
    assert float(cli.trainer.callback_metrics["val/loss"]) < first
    out = str(tmp_path / "pred")
    run_cli(["predict", "--config", cfg, "--ckpt_path", ckpt, "--prediction_writer.output_dir", out])
    pred = torch.load(os.path.join(out, "predictions_rank0.pt"), weights_only=True)
    assert pred["image_features"].shape == (16, 16) and pred["text_features"].shape == (16, 16)  # embed_dim 16
    torch.testing.assert_close(pred["image_features"].norm(dim=-1), torch.ones(16))
    assert len(pred["keys"]) == 16 == len(set(pred["keys"]))  # the sample key of every row
