"""scripts/lm_v1_study.py and scripts/compare_lm_variants.py: the study's patches reproduce or change the library as
documented, and a toy run on a corpus made here writes a JSON that records no machine path."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from diffmm.nn import RotaryEmbedding
from diffmm.nn.attention import Attention
from diffmm.nn.diff_attention import DiffAttention
from diffmm.nn.lambdas import lambda_init_depth
from diffmm.ops import diff_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def study(monkeypatch):
    """The script as a module; the class attributes its patches replace are restored after the test."""
    for cls, name in ((DiffAttention, "forward"), (DiffAttention, "__init__"), (Attention, "forward")):
        monkeypatch.setattr(cls, name, getattr(cls, name))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    spec = importlib.util.spec_from_file_location("lm_v1_study", os.path.join(ROOT, "scripts", "lm_v1_study.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "_EPI", None)
    return mod


def _layer(layer_idx: int) -> tuple[DiffAttention, torch.Tensor, tuple]:
    torch.manual_seed(0)
    attn = DiffAttention(64, 2, layer_idx=layer_idx, lambda_init="depth", causal=True, use_rope=True)
    x = torch.randn(2, 10, 64)
    rope = RotaryEmbedding(16)(torch.arange(10))  # component head dim 64 / (2 * 2)
    return attn, x, rope


def test_epilogue_scale_own_factor_is_the_library(study):
    attn, x, rope = _layer(2)
    want = attn(x, rope=rope)
    study.apply_patches(["--epilogue-scale", "depth"])
    torch.testing.assert_close(attn(x, rope=rope), want, rtol=1e-6, atol=1e-7)


def test_epilogue_scale_number_scales_the_head_output(study):
    attn, x, rope = _layer(1)
    q, k, v = attn._qkv(x, rope, None)
    heads = diff_attention(q, k, v, attn.lambda_full(), causal=True, norm_weight=attn.diff_norm.weight,
                           lambda_init=attn.lambda_init, backend="reference")  # includes (1 - lambda_init)
    study.apply_patches(["--epilogue-scale", "0.1"])
    want = attn.out_proj((heads * (0.1 / (1 - lambda_init_depth(1)))).reshape(2, 10, -1))
    torch.testing.assert_close(attn(x, rope=rope), want, rtol=1e-5, atol=1e-6)


def test_no_subnorm_is_the_raw_differential_output(study):
    attn, x, rope = _layer(0)
    q, k, v = attn._qkv(x, rope, None)
    want = attn.out_proj(diff_attention(q, k, v, attn.lambda_full(), causal=True, backend="reference").reshape(2, 10, -1))
    rest, tag = study.apply_patches(["--no-subnorm", "--steps", "3"])
    assert rest == ["--steps", "3"] and tag == ["no_subnorm"]
    torch.testing.assert_close(attn(x, rope=rope), want, rtol=1e-5, atol=1e-6)


def test_std_subnorm_normalises_each_head(study):
    torch.manual_seed(0)
    attn = Attention(64, 4, layer_idx=3, causal=True)
    study.apply_patches(["--std-subnorm", "--epilogue-scale", "0.2"])
    seen = []
    attn.out_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    attn(torch.randn(2, 10, 64))
    heads = seen[0].view(2, 10, 4, 16)
    torch.testing.assert_close(heads.pow(2).mean(-1).sqrt(), torch.full((2, 10, 4), 0.2), rtol=1e-3, atol=1e-4)


def _corpus(tmp_path) -> str:
    src = tmp_path / "_sources"
    (src / "library").mkdir(parents=True)
    words = "the module returns a list of values from each function call and raises an error".split()
    g = torch.Generator().manual_seed(0)
    for i in range(40):  # hash split: about 1 page in 20 is validation
        text = " ".join(words[j] for j in torch.randint(0, len(words), (1500,), generator=g).tolist())
        (src / "library" / f"page{i}.rst.txt").write_text(text)
    return str(src)


def test_ablate_toy_run_writes_tagged_json_without_machine_paths(study, tmp_path, capsys):
    out = tmp_path / "run.json"
    cache = tmp_path / "cache"
    rc = study.main(["ablate", "--epilogue-scale", "0.2", "--source", _corpus(tmp_path), "--cache", str(cache),
                     "--vocab", "300", "--dim", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2",
                     "--steps", "3", "--warmup", "1", "--val-batches", "1", "--seeds", "0",
                     "--variants", "diff", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["ablation"] == ["epilogue_scale=0.2"]
    assert [r["variant"] for r in d["results"]] == ["diff"] and torch.isfinite(torch.tensor(d["results"][0]["val_loss"]))
    assert d["args"]["cache"] == "<cache>" and str(cache) not in out.read_text()
    assert str(cache) not in capsys.readouterr().out


def test_table_reproduces_the_committed_report_table(study):
    folder = os.path.join(ROOT, "results", "lm_v1_study")
    with open(os.path.join(folder, "table.md")) as f:
        assert study.study_table(folder) == f.read()
