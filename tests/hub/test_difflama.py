"""HF DiffLlama interop and the diffmm export folder: logit parity, exact round trips, loader, bad files."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import diffmm
from diffmm.hub.difflama import (from_difflama, hf_to_lm_config, interleaved_to_blocks, lm_config_to_hf,
                                 save_difflama, to_difflama)
from diffmm.models.lm import DiffLM, LMConfig

transformers = pytest.importorskip("transformers")
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM  # noqa: E402

CONFIGS = {  # (n_head, n_kv_head, tie, rope_theta): MHA, GQA 2:1, GQA 4:1 (one kv head pair), tied
    "mha": dict(n_head=8, n_kv_head=None, tie_embeddings=False, rope_theta=10000.0),
    "gqa2": dict(n_head=8, n_kv_head=4, tie_embeddings=False, rope_theta=500000.0),
    "gqa4-tied": dict(n_head=8, n_kv_head=2, tie_embeddings=True, rope_theta=10000.0),
}


def random_lm(seed=0, dtype=torch.float32, **kw) -> DiffLM:
    """A DiffLM with random weights, including non-trivial norm weights and lambdas."""
    torch.manual_seed(seed)
    cfg = LMConfig(**{**dict(vocab_size=97, block_size=64, n_layer=3, n_embd=64, n_head=8, init_std=0.15), **kw})
    model = DiffLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "lambda" in name:
                p.copy_(0.4 * torch.randn_like(p))
    return model


def hf_model(cfg: LMConfig) -> DiffLlamaForCausalLM:
    hf = {k: v for k, v in lm_config_to_hf(cfg).items() if k not in ("architectures", "model_type", "dtype")}
    return DiffLlamaForCausalLM(DiffLlamaConfig(**hf, attn_implementation="eager")).eval()


def converted(model: DiffLM) -> DiffLlamaForCausalLM:
    hf = hf_model(model.config)
    info = hf.load_state_dict(to_difflama(model.state_dict(), model.config), strict=False)
    assert not info.unexpected_keys and set(info.missing_keys) <= {"lm_head.weight"}
    if model.config.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


# --------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_difflama(name):
    model = random_lm(**CONFIGS[name])
    hf = converted(model)
    idx = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # Right padding: positions of valid tokens are unchanged, so their logits must agree.
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 17:] = False
    with torch.no_grad():
        ours, theirs = model(idx, attn_mask=mask), hf(idx, attention_mask=mask.long()).logits
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-4, rtol=0)


def test_gradients_match_difflama():
    model = random_lm(**CONFIGS["gqa2"])
    hf = converted(model)
    idx, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    model(idx, targets)[1].backward()
    logits = hf(idx).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    d = model.config.head_dim
    blk, hl = model.blocks[1], hf.model.layers[1]
    close = dict(atol=1e-5, rtol=1e-4)
    attn, hattn = blk.attn, hl.self_attn
    torch.testing.assert_close(interleaved_to_blocks(attn.q_proj.weight.grad, 4, d), hattn.q_proj.weight.grad, **close)
    torch.testing.assert_close(interleaved_to_blocks(attn.v_proj.weight.grad, 2, d), hattn.v_proj.weight.grad, **close)
    torch.testing.assert_close(blk.attn.lambda_q2.grad, hl.self_attn.lambda_q2.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(blk.mlp.up_proj.weight.grad, hl.mlp.up_proj.weight.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model.wte.weight.grad, hf.model.embed_tokens.weight.grad, atol=1e-5, rtol=1e-4)


def test_greedy_generation_matches_difflama():
    model = random_lm(**CONFIGS["gqa2"])
    hf = converted(model)
    prompt = torch.randint(0, 97, (2, 5))
    ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt),
                      pad_token_id=0)
    assert torch.equal(model.generate(prompt, 10, greedy=True), ref)


# ----------------------------------------------------------------------------- round trips
def test_difflama_state_dict_round_trip_is_bit_exact():
    for name, kw in CONFIGS.items():
        model = random_lm(**kw)
        hf_sd = {k: v.clone() for k, v in converted(model).state_dict().items() if k != "lm_head.weight"
                 or not model.config.tie_embeddings}
        back = to_difflama(from_difflama(hf_sd, model.config), model.config)
        assert set(back) == set(hf_sd), name
        for k in hf_sd:
            assert back[k].dtype == hf_sd[k].dtype and torch.equal(back[k], hf_sd[k]), (name, k)


def test_diffmm_round_trip_is_exact_as_a_function():
    model = random_lm(**CONFIGS["gqa2"])
    back = DiffLM(model.config).eval()
    back.load_state_dict(from_difflama(to_difflama(model.state_dict(), model.config), model.config))
    idx = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(back(idx), model(idx), atol=1e-5, rtol=0)
    # The per-head norm weight moved into out_proj; with g = 1 the state dict comes back bit-exact.
    for blk in model.blocks:
        blk.attn.diff_norm.weight.data.fill_(1.0)
    sd = model.state_dict()
    again = from_difflama(to_difflama(sd, model.config), model.config)
    assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) for k in sd)


def test_float64_parity():
    model = random_lm(dtype=torch.float64, **CONFIGS["mha"])
    hf = converted(model).double()
    idx = torch.randint(0, 97, (1, 16))
    with torch.no_grad():  # RoPE tables are computed in fp32 by both, so fp64 agrees to ~1e-6, not 1e-12
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ configs
def test_config_round_trip():
    cfg = random_lm(**CONFIGS["gqa2"]).config
    back = hf_to_lm_config(lm_config_to_hf(cfg))
    for f in ("vocab_size", "block_size", "n_layer", "n_embd", "n_head", "n_kv_head", "mlp_hidden", "rope_theta",
              "norm_eps", "tie_embeddings", "init_std", "lambda_std", "attention", "lambda_init"):
        assert getattr(back, f) == getattr(cfg, f), f
    legacy = {**lm_config_to_hf(cfg), "rope_theta": 1234.0}
    del legacy["rope_parameters"]
    assert hf_to_lm_config(legacy).rope_theta == 1234.0


@pytest.mark.parametrize("change, match", [
    (dict(model_type="llama"), "model_type 'llama'; expected 'diffllama'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_type 'linear'"),
    (dict(head_dim=16), "head_dim 16 \\* num_attention_heads 8 != hidden_size 64"),
    (dict(num_key_value_heads=3), "heads 8 is not divisible by kv_heads 3"),
])
def test_bad_hf_config(change, match):
    hf = {**lm_config_to_hf(random_lm().config), **change}
    with pytest.raises(ValueError, match=match) as info:
        hf_to_lm_config(hf, source="x/config.json")
    assert str(info.value).startswith("x/config.json: ") and "\n" not in str(info.value)


def test_export_refuses_what_difflama_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="attention='standard'"):
        save_difflama(random_lm(attention="standard"), tmp_path)
    with pytest.raises(ValueError, match="lambda_init='constant'"):
        save_difflama(random_lm(lambda_init="constant"), tmp_path)


# ------------------------------------------------------------------------------- folders
def test_export_folder_loads_in_transformers_and_back(tmp_path):
    model = random_lm(**CONFIGS["gqa4-tied"])
    save_difflama(model, tmp_path / "out")
    hf, info = DiffLlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True,
                                                    attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    loaded = diffmm.load_pretrained(tmp_path / "out")
    assert isinstance(loaded, DiffLM) and loaded.config.tie_embeddings
    idx = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        ref = model(idx)
        torch.testing.assert_close(hf.eval()(idx).logits, ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(loaded(idx), ref, atol=1e-5, rtol=0)


def test_load_pretrained_reads_transformers_folders_incl_shards(tmp_path):
    hf = converted(random_lm(**CONFIGS["gqa2"]))
    hf.save_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    idx = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        ref = hf(idx).logits
        for sub in ("one", "sharded"):
            model = diffmm.load_pretrained(tmp_path / sub)
            assert model.config.rope_theta == 500000.0 and model.config.n_kv_head == 4
            torch.testing.assert_close(model(idx), ref, atol=1e-4, rtol=0)


def _corrupt(tmp_path, edit):
    folder = tmp_path / "bad"
    save_difflama(random_lm(**CONFIGS["mha"]), folder)
    sd = load_file(str(folder / "model.safetensors"))
    edit(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("edit, match", [
    (lambda sd: sd.pop("model.layers.1.self_attn.lambda_k2"), "missing keys: model.layers.1.self_attn.lambda_k2"),
    (lambda sd: sd.update({"model.layers.0.self_attn.bonus": torch.zeros(2)}),
     "unexpected keys: model.layers.0.self_attn.bonus"),
    (lambda sd: sd.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(3, 64)}),
     "mis-shaped: model.layers.2.mlp.up_proj.weight \\(3, 64\\) != \\(192, 64\\)"),
])
def test_bad_checkpoint_errors_name_the_key(tmp_path, edit, match):
    folder = _corrupt(tmp_path, edit)
    with pytest.raises(KeyError, match=match) as info:
        diffmm.load_pretrained(folder)
    assert "\n" not in str(info.value)


def test_wrong_model_type_and_missing_weights(tmp_path):
    folder = tmp_path / "llama"
    save_difflama(random_lm(), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match="not a recognised checkpoint"):
        diffmm.load_pretrained(folder)
    with pytest.raises(ValueError, match="model_type 'llama'; expected 'diffllama'"):
        diffmm.load_pretrained(folder, format="difflama")
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        diffmm.load_pretrained(folder, format="difflama")


# ---------------------------------------------------------------------------- diffmm export
@pytest.mark.parametrize("kw", [dict(attention="diff", tie_embeddings=True),
                                dict(attention="standard", tie_embeddings=False, n_kv_head=2)])
def test_diffmm_export_round_trip(tmp_path, kw):
    model = random_lm(**kw)
    model.save_pretrained(tmp_path / "exp")
    meta = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert meta["diffmm_export"]["kind"] == "lm" and meta["config"]["attn_type"] == kw["attention"]
    stored = load_file(str(tmp_path / "exp" / "model.safetensors"))
    assert ("lm_head.weight" in stored) != kw["tie_embeddings"]  # tied weights are written once
    loaded = diffmm.load_pretrained(tmp_path / "exp")
    assert isinstance(loaded, DiffLM) and loaded.config == model.config
    assert (loaded.lm_head.weight is loaded.wte.weight) == kw["tie_embeddings"]
    sd, ref = loaded.state_dict(), model.state_dict()
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


def test_diffmm_export_bad_files(tmp_path):
    random_lm().save_pretrained(tmp_path / "exp")
    path = tmp_path / "exp" / "model.safetensors"
    sd = load_file(str(path))
    sd.pop("blocks.0.attn.diff_norm.weight")
    save_file(sd, str(path))
    with pytest.raises(KeyError, match="missing keys: blocks.0.attn.diff_norm.weight"):
        diffmm.load_pretrained(tmp_path / "exp")
    cfg_path = tmp_path / "exp" / "config.json"
    meta = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**meta, "diffmm_export": {"kind": "vit"}}))
    with pytest.raises(ValueError, match="unknown export kind 'vit'"):
        diffmm.load_pretrained(tmp_path / "exp")
    cfg_path.write_text(json.dumps({**meta, "config": {**meta["config"], "n_heads": 3}}))
    with pytest.raises(ValueError, match="unknown LMConfig field\\(s\\) n_heads"):
        diffmm.load_pretrained(tmp_path / "exp")
