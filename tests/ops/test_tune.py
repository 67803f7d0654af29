"""The measured CPU layout table: every layout it can pick agrees with the reference on the shapes it covers,
the dispatch follows it, and a missing or damaged table falls back to the heuristics without breaking a call."""
import json
import logging
from pathlib import Path

import pytest
import torch

import diffmm.ops as ops
from diffmm.ops import tune
from diffmm.ops.sdpa import LAYOUTS, _layout, diff_attention_sdpa
from diffmm.ops._validate import prepare_mask

F64 = torch.float64


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.delenv("DIFFMM_SDPA_LAYOUT", raising=False)
    monkeypatch.delenv(tune.ENV_TABLE, raising=False)
    tune.clear_cache()
    yield
    tune.clear_cache()


def packaged_entries():
    return json.loads(tune.TABLE_PATH.read_text())["entries"]


def entry(**kw):
    e = dict(dtype="float32", mask="causal", grad=True, threads=torch.get_num_threads(), B=4, N=512, S=512, h=8,
             h_kv=8, d=32, ms={}, best="halves")
    e.update(kw)
    return e


def write_table(tmp_path, entries, version=tune.VERSION, name="t.json"):
    p = tmp_path / name
    p.write_text(json.dumps({"version": version, "device": "cpu", "entries": entries}))
    return p


def layout_for(B=4, N=512, h=8, d=32, causal=True, grad=True, dtype=torch.float32):
    q = torch.empty(B, N, 2 * h, d, dtype=dtype)
    spec = prepare_mask(None, causal, B, h, N, N, q.device, q.dtype)
    return _layout(q, None, spec, B, N, N, h, d, grad)


# ---- the packaged table ---------------------------------------------------------------------------------------


def test_packaged_table_is_valid_and_ships_with_the_package():
    data = json.loads(tune.TABLE_PATH.read_text())
    entries = tune.validate_table(data, str(tune.TABLE_PATH), LAYOUTS)
    assert entries, "the packaged table has no entries"
    assert {e["mask"] for e in entries} >= {"none", "causal"} and {e["grad"] for e in entries} == {True, False}
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '"ops/*.json"' in pyproject, "pyproject package-data must ship diffmm/ops/cpu_tune.json"


def covered_cases():
    """One small case per (mask kind, h, d) the table covers, N capped so that the fp64 reference stays cheap."""
    cases = sorted({(e["mask"], e["h"], e["d"], min(e["N"], 48)) for e in packaged_entries()})
    return [pytest.param(*c, id=f"{c[0]}-h{c[1]}-d{c[2]}-N{c[3]}") for c in cases]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask,h,d,N", covered_cases())
def test_every_layout_matches_reference_on_covered_shapes(layout, mask, h, d, N):
    g = torch.Generator().manual_seed(N + d)
    B, h_kv = 2, max(1, h // 2)  # GQA too: the table's shapes are MHA, the layouts must not care
    q = torch.randn(B, N, 2 * h, d, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(B, N, 2 * h_kv, d, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(B, N, h_kv, 2 * d, generator=g, dtype=F64, requires_grad=True)
    lam = torch.tensor(0.37, dtype=F64, requires_grad=True)
    w = (torch.rand(2 * d, generator=g, dtype=F64) + 0.5).requires_grad_()
    attn_mask = None
    if mask == "padding":
        attn_mask = torch.rand(B, N, generator=g) > 0.3
        attn_mask[0, :3] = False  # left padding: the first causal rows of sequence 0 see no key
    elif mask == "additive":
        attn_mask = torch.randn(B, h, N, N, generator=g, dtype=F64)
    kw = dict(causal=mask in ("causal", "padding"), attn_mask=attn_mask, norm_weight=w, lambda_init=0.3)
    dy = torch.randn(B, N, h, 2 * d, generator=g, dtype=F64)
    ref = ops.diff_attention_reference(q, k, v, lam, **kw)
    out = diff_attention_sdpa(q, k, v, lam, layout=layout, **kw)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for n, a, b in zip(["q", "k", "v", "lam", "w"], torch.autograd.grad((out * dy).sum(), (q, k, v, lam, w)),
                       torch.autograd.grad((ref * dy).sum(), (q, k, v, lam, w))):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda m: f"grad {n}: {m}")


# ---- dispatch --------------------------------------------------------------------------------------------------


def test_dispatch_follows_the_table(tmp_path, monkeypatch):
    p = write_table(tmp_path, [entry(best="halves"), entry(grad=False, best="flash2d"),
                               entry(mask="none", N=64, S=64, B=64, h=2, best="split")])
    monkeypatch.setenv(tune.ENV_TABLE, str(p))
    assert layout_for() == "halves"
    assert layout_for(grad=False) == "flash2d"
    assert layout_for(N=400, B=5) == "halves"  # nearest entry within 4x
    assert layout_for(B=64, N=65, h=2, causal=False) == "split"
    assert layout_for(B=64, N=65, h=2, causal=False, grad=False) == "combined"  # no (none, fwd) entry: heuristics
    assert layout_for(N=8192, B=1) == "combined"  # 16x away: heuristics
    assert layout_for(N=8, B=1) == "pair"  # decoding: heuristics
    assert layout_for(dtype=torch.bfloat16) == "halves"  # no bf16 entries: the float32 ones


def test_dispatch_prefers_matching_dtype_and_nearest_threads(tmp_path, monkeypatch):
    p = write_table(tmp_path, [entry(best="halves", threads=1), entry(best="split", threads=8),
                               entry(dtype="bfloat16", best="flash2d", threads=1)])
    monkeypatch.setenv(tune.ENV_TABLE, str(p))
    assert tune.choose_layout(LAYOUTS, B=4, N=512, S=512, h=8, d=32, dtype=torch.float32, mask="causal", grad=True,
                              threads=1) == "halves"
    assert tune.choose_layout(LAYOUTS, B=4, N=512, S=512, h=8, d=32, dtype=torch.float32, mask="causal", grad=True,
                              threads=6) == "split"
    assert tune.choose_layout(LAYOUTS, B=4, N=512, S=512, h=8, d=32, dtype=torch.bfloat16, mask="causal", grad=True,
                              threads=1) == "flash2d"


def test_the_chosen_layout_runs(tmp_path, monkeypatch):
    """End to end through diff_attention: the layout the table names is the one that runs."""
    import diffmm.ops.sdpa as sdpa
    calls = []
    real = sdpa.combined_diff_attention
    monkeypatch.setattr(sdpa, "combined_diff_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q = torch.randn(1, 64, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 64, 4, 8), torch.randn(1, 64, 2, 16)
    for best, n_calls in (("combined", 1), ("flash2d", 1)):
        p = write_table(tmp_path, [entry(best=best, B=1, N=64, S=64, h=2, d=8)], name=f"{best}.json")
        monkeypatch.setenv(tune.ENV_TABLE, str(p))
        ops.diff_attention(q, k, v, 0.3, causal=True, backend="sdpa")
        assert len(calls) == n_calls


def test_env_forces_layout_over_table(tmp_path, monkeypatch):
    monkeypatch.setenv(tune.ENV_TABLE, str(write_table(tmp_path, [entry(best="halves")])))
    monkeypatch.setenv("DIFFMM_SDPA_LAYOUT", "split")
    assert layout_for() == "split"


# ---- robustness ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [
    "{not json", "[]", json.dumps({"version": 99, "entries": []}), json.dumps({"version": 1, "entries": {}}),
    json.dumps({"version": 1, "entries": [{"mask": "causal"}]}),
    json.dumps({"version": 1, "entries": [entry(best="warp-drive")]}),
    json.dumps({"version": 1, "entries": [entry(N=0)]}),
    json.dumps({"version": 1, "entries": [entry(mask="sometimes")]}),
    json.dumps({"version": 1, "entries": [entry(grad="yes")]}), "",
], ids=["garbage", "list", "version", "entries-type", "missing-keys", "bad-layout", "zero-size", "bad-mask",
        "bad-grad", "empty"])
def test_damaged_table_falls_back_with_one_warning(tmp_path, monkeypatch, caplog, content):
    p = tmp_path / "bad.json"
    p.write_text(content)
    monkeypatch.setenv(tune.ENV_TABLE, str(p))
    with caplog.at_level(logging.WARNING, logger="diffmm.ops"):
        assert layout_for() == "combined"
        assert layout_for(grad=False) == "combined"
        q, k, v = torch.randn(1, 20, 4, 8), torch.randn(1, 20, 4, 8), torch.randn(1, 20, 2, 16)
        ops.diff_attention(q, k, v, 0.3, causal=True, backend="sdpa")  # a call never breaks
    warnings = [r for r in caplog.records if "tune table" in r.getMessage()]
    assert len(warnings) == 1 and "heuristics" in warnings[0].getMessage()


def test_missing_or_disabled_table_uses_heuristics(tmp_path, monkeypatch):
    monkeypatch.setenv(tune.ENV_TABLE, str(tmp_path / "nope.json"))
    assert layout_for() == "combined" and layout_for(N=4, B=1) == "pair"
    monkeypatch.setenv(tune.ENV_TABLE, "off")
    assert tune.table_path() is None and layout_for() == "combined"
    monkeypatch.setattr(tune, "TABLE_PATH", tmp_path / "absent.json")  # a wheel without the table
    monkeypatch.delenv(tune.ENV_TABLE)
    tune.clear_cache()
    assert layout_for() == "combined"


def test_validate_names_the_file_and_field(tmp_path):
    with pytest.raises(tune.TableError, match=r"t.json: entries\[0\].N is 0"):
        tune.validate_table({"version": 1, "entries": [entry(N=0)]}, "t.json", LAYOUTS)
