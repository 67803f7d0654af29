"""`diffmm fit` with CLIPModule(swap=...): a pretrained open_clip CLIP upcycled to DiffCLIP trains from the source
model's loss, its checkpoints hold the lambdas and load in eval / classify / resume without the training code."""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch
import yaml
from open_clip.model import CLIP
from PIL import Image

from diffmm.cli import main as diffmm_main
from diffmm.train.cli import main as fit_main
from train_configs import SHRINK, clip_config, read_metrics, series, write_yaml

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _open_clip_file(path) -> str:
    """A random open_clip CLIP of the shrunk OpenCLIP-Tiny shape, saved as torch.save(model.state_dict())."""
    torch.manual_seed(0)
    v, t = SHRINK["vision_cfg"], SHRINK["text_cfg"]
    oc = CLIP(embed_dim=SHRINK["embed_dim"], vision_cfg=dict(v), text_cfg={**t, "vocab_size": 49408})
    torch.save(oc.state_dict(), path)
    return str(path)


def _config(tmp_path, data, name, pretrained, swap=None, model_name="OpenCLIP-Tiny", steps=2):
    cfg = clip_config(str(tmp_path / name), data, max_steps=steps, model_name=model_name)
    cfg["model"]["init_args"]["pretrained"] = pretrained
    if swap is not None:
        cfg["model"]["init_args"]["swap"] = swap
    return write_yaml(tmp_path / f"{name}.yaml", cfg)


def test_upcycled_fit_starts_at_the_source_loss_and_its_checkpoint_loads_everywhere(tmp_path, image_text_data, capsys,
                                                                                     caplog):
    pre = _open_clip_file(tmp_path / "clip.pt")
    assert fit_main(["fit", "--config", _config(tmp_path, image_text_data, "src", pre)]) == 0
    up_cfg = _config(tmp_path, image_text_data, "up", pre, swap={"init": "upcycle"})
    assert fit_main(["fit", "--config", up_cfg]) == 0
    src, up = (series(read_metrics(str(tmp_path / n)), "train/loss") for n in ("src", "up"))
    torch.testing.assert_close(torch.tensor(up[0]), torch.tensor(src[0]), rtol=1e-5, atol=1e-6)
    assert up[1] != src[1]  # then they train differently
    assert series(read_metrics(str(tmp_path / "up")), "lambda/visual.blocks.0.attn")
    ckpt = str(tmp_path / "up" / "checkpoints" / "last.ckpt")
    state = torch.load(ckpt, weights_only=True)
    lambdas = [k for k in state["state_dict"] if k.endswith(("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"))]
    assert len(lambdas) == 4 * 2 and state["hyper_parameters"]["swap"] == {"init": "upcycle"}
    assert state["diffmm_model"]["config"]["vision_cfg"]["attn_type"] == "diff_upcycled"
    # resume to a later step (the pretrained file is read again at construction, then the checkpoint wins)
    assert fit_main(["fit", "--config", up_cfg, "--ckpt_path", "last", "--trainer.max_steps", "3"]) == 0
    assert torch.load(ckpt, weights_only=True)["global_step"] == 3
    # the pretrained file is not needed any more: resuming, eval zeroshot and classify take the checkpoint
    os.remove(pre)
    before = torch.load(ckpt, weights_only=True)["state_dict"]
    assert fit_main(["fit", "--config", up_cfg, "--ckpt_path", "last", "--trainer.max_steps", "4"]) == 0
    after = torch.load(ckpt, weights_only=True)
    assert after["global_step"] == 4 and after["hyper_parameters"]["pretrained"] == pre  # provenance kept
    assert any(not torch.equal(before[k], after["state_dict"][k]) for k in before)  # it trained on
    assert f"{pre} is not there" in caplog.text and "is not read" in caplog.text
    (tmp_path / "colours.txt").write_text("red\ngreen\nblue\n")
    rc = diffmm_main(["eval", "zeroshot", "--model", ckpt, "--data", image_text_data[1], "--label_field",
                      "json:label", "--classnames", str(tmp_path / "colours.txt"),
                      "--templates", "a silhouette of a {}",
                      "--workers", "0", "--progress", "false", "--out", str(tmp_path / "zs.json")])
    assert rc == 0
    res = json.loads((tmp_path / "zs.json").read_text())
    assert res["n"] == 16 and res["model"] == ckpt
    for i, c in enumerate(((200, 30, 30), (30, 200, 30))):
        Image.new("RGB", (16, 16), c).save(tmp_path / f"img{i}.png")
    rc = diffmm_main(["classify", "--model", ckpt, "--labels", "red,green,blue", "--workers", "0", "--progress",
                      "false", "--out", str(tmp_path / "preds.csv"), *sorted(glob.glob(str(tmp_path / "img*.png")))])
    assert rc == 0 and len((tmp_path / "preds.csv").read_text().strip().splitlines()) == 1 + 2


def test_pretrained_standard_weights_into_a_diffclip_name_points_at_swap(tmp_path, image_text_data, capsys):
    pre = _open_clip_file(tmp_path / "clip.pt")
    cfg = _config(tmp_path, image_text_data, "bad", pre, model_name="DiffCLIP-Tiny")
    assert fit_main(["fit", "--config", cfg]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("diffmm fit: error:") and "holds standard-attention weights" in err and "swap" in err


def test_shipped_upcycle_configs():
    with open(os.path.join(ROOT, "configs", "upcycle_tiny_emoji.yaml")) as f:
        tiny = yaml.safe_load(f)
    with open(os.path.join(ROOT, "configs", "clip_tiny_emoji.yaml")) as f:
        pretrain = yaml.safe_load(f)
    m = tiny["model"]["init_args"]
    assert m["swap"]["init"] == "upcycle" and tiny["trainer"]["accelerator"] == "cpu"
    # it starts from the run that clip_tiny_emoji.yaml writes, with that run's architecture
    assert m["pretrained"] == os.path.join(pretrain["trainer"]["default_root_dir"], "checkpoints", "last.ckpt")
    assert m["model_name"] == pretrain["model"]["init_args"]["model_name"]
    assert tiny["data"] == pretrain["data"]
    with open(os.path.join(ROOT, "configs", "upcycle_vitb16_cc3m.yaml")) as f:
        gpu = yaml.safe_load(f)
    g = gpu["model"]["init_args"]
    assert g["model_name"] == "OpenCLIP-ViT-B-16" and g["swap"]["init"] == "upcycle"
    assert gpu["trainer"]["precision"] == "bf16-mixed" and gpu["trainer"]["accelerator"] == "gpu"


@pytest.mark.parametrize("name", ["upcycle_tiny_emoji.yaml", "upcycle_vitb16_cc3m.yaml"])
def test_upcycle_configs_parse(name, capsys):
    assert fit_main(["fit", "--config", os.path.join(ROOT, "configs", name), "--print_config"]) == 0
    assert "init: upcycle" in capsys.readouterr().out


def test_command_line_values_of_dict_options_are_typed(tmp_path, image_text_data):
    """`--model.init_args.swap.seed 3` / `--model.init_args.zeroshot.max_batches 2` are typed as in a config file."""
    from diffmm.train.cli import run_cli

    cfg = clip_config(str(tmp_path / "run"), image_text_data, max_steps=1, model_name="CLIP-Tiny")
    args = {"swap.init": "upcycle", "swap.seed": "3", "swap.lambda_init": "0.5", "zeroshot.dataset": "x.tar",
            "zeroshot.classnames": "[a]", "zeroshot.max_batches": "2", "zeroshot.templates": "['a {}']"}
    cli = run_cli(["--config", write_yaml(tmp_path / "c.yaml", cfg),
                   *[w for k, v in args.items() for w in (f"--model.init_args.{k}", v)]], run=False)
    m = cli.model
    assert m.hparams["swap"] == {"init": "upcycle", "seed": 3, "lambda_init": 0.5}
    assert m.model.config.vision_cfg.lambda_init == 0.5 and m.zeroshot.max_batches == 2
