"""Weights that must not load: integer/bool tensors for float parameters, and damaged files.

Every loader (``diffmm.load_pretrained``, ``create_model(pretrained=...)``, export folders, DiffLlama
folders) and the CLIs (``diffmm export``, ``diffmm eval``) refuse them with one line naming the key or file.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import diffmm
from diffmm.hub.checkpoint import DamagedFileError, load_state_file, torch_file_damage
from diffmm.hub.difflama import save_difflama
from diffmm.cli import main as diffmm_main
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.models.weights import check_state_dict

TINY_CLIP = {"embed_dim": 16, "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 1,
                                             "head_width": 8},
             "text_cfg": {"context_length": 16, "width": 32, "heads": 4, "layers": 1, "vocab_size": 64}}
BAD_DTYPES = [torch.int64, torch.int32, torch.bool]


def tiny_clip():
    torch.manual_seed(0)
    return diffmm.create_model("DiffCLIP-Tiny", **TINY_CLIP).eval()


def tiny_lm():
    torch.manual_seed(0)
    return DiffLM(LMConfig(vocab_size=64, block_size=16, n_layer=1, n_embd=32, n_head=4)).eval()


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` scaled so the cast changes it (what a silent cast would load: int weights differ by up to 99.9)."""
    return (t * 100).to(dtype)


def retype(path, key: str, dtype: torch.dtype) -> None:
    sd = load_file(str(path))
    sd[key] = as_dtype(sd[key], dtype)
    save_file(sd, str(path), metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_check_state_dict_refuses_non_float_for_float(dtype):
    expected = {"w": torch.zeros(2, 3), "ids": torch.zeros(4, dtype=torch.long)}
    with pytest.raises(KeyError, match=rf"src: wrong dtype: w is {str(dtype)[6:]}, expected float \(float32\)"):
        check_state_dict({"w": torch.zeros(2, 3, dtype=dtype), "ids": torch.zeros(4, dtype=torch.long)},
                         expected, source="src")
    with pytest.raises(KeyError, match=r"wrong dtype: ids is float32, expected integer \(int64\)"):
        check_state_dict({"w": torch.zeros(2, 3), "ids": torch.zeros(4)}, expected, source="src")
    # float widths may differ (fp16/bf16 files into fp32 models), and shape-only expectations skip the dtype
    check_state_dict({"w": torch.zeros(2, 3, dtype=torch.bfloat16), "ids": torch.zeros(4, dtype=torch.int32)},
                     expected, source="src")
    check_state_dict({"w": torch.zeros(2, 3, dtype=dtype)}, {"w": (2, 3)}, source="src")


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_clip_export_and_pretrained_refuse_integer_weights(tmp_path, dtype):
    model = tiny_clip()
    model.save_pretrained(tmp_path / "exp")
    weights = tmp_path / "exp" / "model.safetensors"
    retype(weights, "text_projection", dtype)
    with pytest.raises(KeyError, match=rf"{weights}: wrong dtype: text_projection is {str(dtype)[6:]}") as e:
        diffmm.load_pretrained(tmp_path / "exp")
    assert "\n" not in str(e.value)
    # a state-dict file given as create_model(pretrained=...)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["visual.blocks.0.attn.q_proj.weight"] = as_dtype(sd["visual.blocks.0.attn.q_proj.weight"], dtype)
    torch.save({"state_dict": sd}, tmp_path / "w.pt")
    with pytest.raises(KeyError, match=r"wrong dtype: visual.blocks.0.attn.q_proj.weight"):
        diffmm.create_model("DiffCLIP-Tiny", pretrained=str(tmp_path / "w.pt"), **TINY_CLIP)


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_lm_export_and_difflama_refuse_integer_weights(tmp_path, dtype):
    model = tiny_lm()
    model.save_pretrained(tmp_path / "exp")
    retype(tmp_path / "exp" / "model.safetensors", "blocks.0.attn.lambda_q1", dtype)
    with pytest.raises(KeyError, match="wrong dtype: blocks.0.attn.lambda_q1"):
        diffmm.load_pretrained(tmp_path / "exp")
    save_difflama(model, tmp_path / "hf")
    retype(tmp_path / "hf" / "model.safetensors", "model.layers.0.mlp.up_proj.weight", dtype)
    with pytest.raises(KeyError, match="wrong dtype: model.layers.0.mlp.up_proj.weight"):
        diffmm.load_pretrained(tmp_path / "hf")


def test_half_precision_files_still_load(tmp_path):
    model = tiny_lm()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "exp")
    back = diffmm.load_pretrained(tmp_path / "exp")
    ref = model.state_dict()
    assert all(torch.equal(v.to(torch.bfloat16), ref[k]) for k, v in back.state_dict().items())


def test_export_cli_refuses_integer_weights_in_lightning_checkpoint(tmp_path, capsys):
    model = tiny_clip()
    sd = {"model." + k: v for k, v in model.state_dict().items()}
    sd["model.logit_scale"] = sd["model.logit_scale"].long()
    torch.save({"state_dict": sd, "hyper_parameters": {"model_name": "DiffCLIP-Tiny", "model_kwargs": TINY_CLIP}},
               tmp_path / "last.ckpt")
    assert diffmm_main(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "wrong dtype: logit_scale is int64" in err and str(tmp_path / "last.ckpt") in err and "\n" not in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------- damaged files
def damage(path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"not a checkpoint " * 40, "empty": b""}[how])


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_damaged_weight_files_name_the_file(tmp_path, capsys, how, suffix):
    model = tiny_clip()
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        save_file(model.state_dict(), str(path))
    else:
        torch.save(model.state_dict(), path)
    damage(path, how)
    for load in (lambda: diffmm.load_pretrained(path), lambda: load_state_file(path),
                 lambda: diffmm.create_model("DiffCLIP-Tiny", pretrained=str(path), **TINY_CLIP)):
        with pytest.raises(DamagedFileError) as e:
            load()
        msg = str(e.value)
        assert msg.startswith(f"{path}: ") and "\n" not in msg
        assert ("truncated" in msg or "empty" in msg or "corrupt" in msg), msg
    assert diffmm_main(["export", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0]


def test_damaged_safetensors_in_folders_name_the_file(tmp_path):
    tiny_lm().save_pretrained(tmp_path / "exp")
    damage(tmp_path / "exp" / "model.safetensors", "truncated")
    with pytest.raises(DamagedFileError, match=f"{tmp_path / 'exp' / 'model.safetensors'}: not a readable"):
        diffmm.load_pretrained(tmp_path / "exp")
    save_difflama(tiny_lm(), tmp_path / "hf")
    damage(tmp_path / "hf" / "model.safetensors", "garbage")
    with pytest.raises(DamagedFileError, match=f"{tmp_path / 'hf' / 'model.safetensors'}: not a readable"):
        diffmm.load_pretrained(tmp_path / "hf")


def test_eval_cli_names_the_damaged_file(tmp_path, capsys):
    path = tmp_path / "w.safetensors"
    save_file(tiny_clip().state_dict(), str(path))
    damage(path, "truncated")
    rc = diffmm_main(["eval", "zeroshot", "--model", "DiffCLIP-Tiny", "--pretrained", str(path), "--data",
                      str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and f"{path}: not a readable safetensors file" in err[0], err


def test_torch_file_damage_accepts_intact_and_legacy_files(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "ok.pt")
    torch.save({"w": torch.ones(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert torch_file_damage(tmp_path / "ok.pt") is None and torch_file_damage(tmp_path / "legacy.pt") is None
    data = bytearray((tmp_path / "ok.pt").read_bytes())
    i = data.index(b"data.pkl") + 40  # inside the pickle record: its CRC no longer matches
    data[i] ^= 0xFF
    (tmp_path / "flip.pt").write_bytes(bytes(data))
    assert "corrupt" in (torch_file_damage(tmp_path / "flip.pt") or "")
