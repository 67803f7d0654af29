"""Bad configs end with a short ``error:`` message naming the key, not a traceback."""
from __future__ import annotations

import copy

import pytest

from train_configs import lm_config, write_yaml
from diffmm.train.cli import main


@pytest.fixture
def base_cfg(tmp_path, text_data):
    return lm_config(str(tmp_path / "run"), text_data, max_steps=1)


def _run(tmp_path, capsys, cfg: dict, *extra: str) -> tuple[int, str]:
    rc = main(["fit", "--config", write_yaml(tmp_path / "bad.yaml", cfg), *extra])
    err = capsys.readouterr().err
    return rc, err


def _short(err: str) -> list[str]:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("usage:", " ", "INFO", "Seed"))]
    assert "Traceback" not in err
    return lines


def test_unknown_key(tmp_path, capsys, base_cfg):
    cfg = copy.deepcopy(base_cfg)
    cfg["model"]["init_args"]["learning_rate"] = 1e-3
    rc, err = _run(tmp_path, capsys, cfg)
    assert rc == 2 and "learning_rate" in err
    print(err)
    assert len(_short(err)) <= 6


def test_wrong_type(tmp_path, capsys, base_cfg):
    cfg = copy.deepcopy(base_cfg)
    cfg["data"]["init_args"]["batch_size"] = "many"
    rc, err = _run(tmp_path, capsys, cfg)
    assert rc == 2 and "batch_size" in err
    print(err)
    assert len(_short(err)) <= 6


def test_missing_shards_is_one_line(tmp_path, capsys, base_cfg):
    cfg = copy.deepcopy(base_cfg)
    cfg["data"]["init_args"]["train_shards"] = str(tmp_path / "nowhere-{000..002}.tar")
    rc, err = _run(tmp_path, capsys, cfg)
    lines = _short(err)
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("diffmm fit: error: data.train_shards: 3 shard(s) not found:")
    assert "nowhere-000.tar" in lines[0]


def test_unknown_model_name(tmp_path, capsys, base_cfg):
    cfg = copy.deepcopy(base_cfg)
    cfg["model"]["init_args"]["model_name"] = "diff-huge"
    rc, err = _run(tmp_path, capsys, cfg)
    assert rc == 2 and "diff-huge" in err
    print(err)
    assert len(_short(err)) <= 3, err


def test_print_config_resolves_defaults(tmp_path, capsys, base_cfg):
    rc = main(["fit", "--config", write_yaml(tmp_path / "ok.yaml", base_cfg), "--print_config"])
    out = capsys.readouterr().out
    assert rc == 0
    for key in ("checkpoint:", "save_last: true", "lr_monitor:", "betas:", "weight_decay: 0.05", "warmup_steps: 3"):
        assert key in out, key


@pytest.mark.parametrize("bad", ["int64", "truncated"])
def test_bad_pretrained_weights_are_one_line(tmp_path, capsys, image_text_data, bad):
    """``model.init_args.pretrained`` with integer weights or a truncated file: one line naming the key / the file."""
    from safetensors.torch import save_file

    import diffmm
    from train_configs import SHRINK, clip_config

    sd = {k: v.clone() for k, v in diffmm.create_model("DiffCLIP-Tiny", **SHRINK).state_dict().items()}
    path = tmp_path / "w.safetensors"
    if bad == "int64":
        sd["text_projection"] = (sd["text_projection"] * 100).long()
        save_file(sd, str(path))
    else:
        save_file(sd, str(path))
        path.write_bytes(path.read_bytes()[:5000])
    cfg = clip_config(str(tmp_path / "run"), image_text_data, max_steps=1)
    rc, err = _run(tmp_path, capsys, cfg, "--model.init_args.pretrained", str(path))
    lines = _short(err)
    assert rc == 2 and len(lines) == 1 and str(path) in lines[0], err
    expected = "wrong dtype: text_projection is int64" if bad == "int64" else "not a readable safetensors file"
    assert expected in lines[0]
