"""``diffmm export CKPT OUT --format difflama|diffmm`` on an LM's Lightning checkpoint: transformers loads the folder
(DiffLlamaForCausalLM + AutoTokenizer) with diffmm's logits and token ids; the tokenizer comes from the checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

import diffmm
from diffmm.cli import main as diffmm_main
from diffmm.data.tokenizers import ClipBPE, TokenizerFile, train_byte_level_bpe
from diffmm.eval.loading import lm_tokenizer
from diffmm.models.lm import DiffLM, LMConfig

transformers = pytest.importorskip("transformers")

KWARGS = dict(vocab_size=49408, block_size=64, n_layer=2, n_embd=32, n_head=4, init_std=0.1)
TEXT = "It's a differential Transformer: attention = softmax(q1 k1) - lambda * softmax(q2 k2)."


def _lm_ckpt(path, hparams: dict, **extra) -> tuple[str, DiffLM]:
    """A Lightning checkpoint as LMModule writes it (model.* weights, its hyper-parameters)."""
    torch.manual_seed(0)
    model = DiffLM(LMConfig.from_name("diff-tiny", **hparams.get("model_kwargs", {}))).eval()
    ckpt = {"epoch": 0, "global_step": 5, "pytorch-lightning_version": "2.6.6", "hyper_parameters": hparams,
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, **extra}
    torch.save(ckpt, path)
    return str(path), model


def test_difflama_export_from_checkpoint_loads_in_transformers(tmp_path):
    ckpt, model = _lm_ckpt(tmp_path / "last.ckpt", {"model_name": "diff-tiny", "model_kwargs": KWARGS,
                                                    "tokenizer": "clip"})
    out = tmp_path / "difflama"
    assert diffmm_main(["export", ckpt, str(out), "--format", "difflama"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "diffllama" and config["eos_token_id"] == ClipBPE().eos_id
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = ClipBPE().encode(TEXT)
    assert tok(TEXT)["input_ids"] == ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(torch.tensor([ids])).logits, model(torch.tensor([ids])), rtol=1e-4, atol=1e-4)
    # diffmm reads the folder back, with the exact open_clip tokenizer
    assert isinstance(lm_tokenizer(str(out)), ClipBPE)
    with torch.no_grad():
        torch.testing.assert_close(diffmm.load_pretrained(out)(torch.tensor([ids])), model(torch.tensor([ids])))


def test_tokenizer_from_datamodule_flag_and_missing(tmp_path, capsys, caplog):
    tj = train_byte_level_bpe([TEXT * 3, "the cat sat on the mat"] * 20, str(tmp_path / "tok" / "tokenizer.json"),
                              vocab_size=300, eos_token="<|endoftext|>")
    kw = {**KWARGS, "vocab_size": 320}
    ckpt, _ = _lm_ckpt(tmp_path / "a.ckpt", {"model_name": "diff-tiny", "model_kwargs": kw, "tokenizer": None},
                           datamodule_hyper_parameters={"tokenizer": tj.path})
    assert lm_tokenizer(ckpt).encode(TEXT) == tj.encode(TEXT)  # evaluations of the checkpoint use it too
    assert diffmm_main(["export", ckpt, str(tmp_path / "a"), "--format", "difflama"]) == 0
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "a")(TEXT)["input_ids"] == tj.encode(TEXT)
    assert isinstance(lm_tokenizer(str(tmp_path / "a")), TokenizerFile)
    # the diffmm format carries it too
    assert diffmm_main(["export", ckpt, str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "tokenizer_config.json").read_text())["diffmm_tokenizer"] == "tokenizer.json"
    assert lm_tokenizer(str(tmp_path / "b")).encode(TEXT) == tj.encode(TEXT)
    assert diffmm.load_pretrained(tmp_path / "b").config.vocab_size == 320
    # --tokenizer overrides what the checkpoint records; one with more tokens than the model is refused
    assert diffmm_main(["export", ckpt, str(tmp_path / "e"), "--tokenizer", "clip"]) == 2
    assert "49408 tokens, more than the model's vocab_size 320" in capsys.readouterr().err
    # a recorded tokenizer that is gone is one error naming it
    ckpt2, _ = _lm_ckpt(tmp_path / "c.ckpt", {"model_name": "diff-tiny", "model_kwargs": kw,
                                              "tokenizer": str(tmp_path / "gone.json")})
    assert diffmm_main(["export", ckpt2, str(tmp_path / "c"), "--format", "difflama"]) == 2
    assert "hyper_parameters.tokenizer" in capsys.readouterr().err
    # none recorded: the export is written without tokenizer files, and a warning says so
    ckpt3, _ = _lm_ckpt(tmp_path / "d.ckpt", {"model_name": "diff-tiny", "model_kwargs": kw, "tokenizer": None})
    assert diffmm_main(["export", ckpt3, str(tmp_path / "d"), "--format", "difflama"]) == 0
    assert not (tmp_path / "d" / "tokenizer.json").exists()
    assert any("no tokenizer recorded" in r.message for r in caplog.records)


def test_difflama_format_refuses_clip_models_and_standard_attention(tmp_path, capsys):
    assert diffmm_main(["export", "CLIP-Tiny", str(tmp_path / "x"), "--format", "difflama"]) == 2
    assert "--format difflama holds LMs" in capsys.readouterr().err
    ckpt, _ = _lm_ckpt(tmp_path / "s.ckpt", {"model_name": "diff-tiny", "tokenizer": "clip",
                                             "model_kwargs": {**KWARGS, "attention": "standard"}})
    assert diffmm_main(["export", ckpt, str(tmp_path / "s"), "--format", "difflama"]) == 2
    assert "differential attention only" in capsys.readouterr().err
