"""A locked image tower in LiTModule with ``cache_image_features``: the blocks before the first unlocked one run once
per image, the rest every step; features, loss and gradients equal the uncached module's; ``image_lr``; a ``diffmm
fit`` whose deterministic train transform (``crop_scale: [1, 1]``) hits the cache from the second epoch on."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import diffmm
from diffmm.models.clip.preprocess import tokenizer_for
from diffmm.train import LiTModule
from diffmm.train.lit import SHARED_IMAGE_CACHES, clear_image_caches
from diffmm.train.cli import run_cli
from train_configs import SHRINK, clip_config, write_yaml

TOL = dict(atol=1e-5, rtol=1e-5)
#: a 3-block image tower, so that blocks can be cached below an unlocked one
KWARGS = {**SHRINK, "vision_cfg": {**SHRINK["vision_cfg"], "layers": 3}}


@pytest.fixture(autouse=True)
def fresh_caches():
    clear_image_caches()
    yield
    clear_image_caches()


def module(attn: str = "diff", seed: int = 0, **kw) -> LiTModule:
    torch.manual_seed(seed)
    return LiTModule(model_name="DiffCLIP-Tiny" if attn == "diff" else "CLIP-Tiny", model_kwargs=KWARGS, **kw)


def batch(m: LiTModule, n: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    return torch.cat([images, images[:1]]), tokenizer_for(m.model)(["a red circle"] * (n + 1))  # a repeated image


@pytest.mark.parametrize("unlocked, start", [([], 3), (["visual.norm."], 3), (["visual.blocks.2."], 2),
                                             (["visual.blocks.1.", "visual.blocks.2.", "visual.norm."], 1)])
def test_cached_image_features_equal_uncached(unlocked, start):
    kw = dict(lock_image=True, lock_image_unlocked=unlocked)
    cached, plain = module(cache_image_features=True, **kw), module(**kw)
    plain.model.load_state_dict(cached.model.state_dict())
    assert cached._image_start == start
    for seed in (0, 1, 0):  # the third batch comes from the cache
        images, tokens = batch(cached, seed=seed)
        for a, b in zip(cached.features(images, tokens), plain.features(images, tokens)):
            torch.testing.assert_close(a, b, **TOL)
    assert len(cached._image_cache) == 8  # 2 batches of 4 distinct images (the repeat is stored once)
    # the tokens entering block `start`, (1 + patches, width) each
    assert all(v.shape == (1 + (16 // 8) ** 2, 32) for v in cached._image_cache.values())
    for m in (cached, plain):
        m.loss_fn(*m.features(*batch(m))).backward()
    names = ["image_projection"] + [n for n, p in cached.model.named_parameters() if n.startswith("visual.")
                                    and p.requires_grad]
    assert len(names) == 1 + len([n for n, _ in cached.model.named_parameters()
                                  if any(f in n for f in unlocked)])
    for name in names:
        got, want = cached.model.get_parameter(name).grad, plain.model.get_parameter(name).grad
        assert got is not None and got.abs().sum() > 0, name
        torch.testing.assert_close(got, want, **TOL, msg=name)


def test_cache_limit_keeps_features_exact():
    cached, plain = module(cache_image_features=True, cache_image_max=3, lock_image=True), module(lock_image=True)
    plain.model.load_state_dict(cached.model.state_dict())
    images, tokens = batch(cached)
    for a, b in zip(cached.features(images, tokens), plain.features(images, tokens)):
        torch.testing.assert_close(a, b, **TOL)
    assert len(cached._image_cache) == 0  # 4 new images would pass the limit of 3: none is stored


@pytest.mark.parametrize("kw, match", [
    (dict(cache_image_features=True), "needs lock_image: true"),
    (dict(cache_image_features=True, lock_image=True, lock_image_unlocked=["visual.pos_embed"]),
     "visual.pos_embed trains"),
])
def test_image_cache_errors(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        module(**kw)
    assert "\n" not in str(e.value)


def test_image_lr_groups():
    m = module(lr=1e-3, image_lr=1e-5, warmup_steps=0)
    m.trainer = SimpleNamespace(estimated_stepping_batches=10)
    opt = m.configure_optimizers()["optimizer"]
    names = {id(p): n for n, p in m.model.named_parameters()}
    for g in opt.param_groups:
        visual = g["name"].endswith("visual.")
        assert all(names[id(p)].startswith("visual.") == visual for p in g["params"]), g["name"]
        assert g["initial_lr"] == (1e-5 if visual else 1e-3)
    assert {g["name"] for g in opt.param_groups} == {"decay", "no_decay", "decay visual.", "no_decay visual."}


@pytest.mark.parametrize("crop_scale", [(1.0, 1.0), (0.5, 1.0)])
def test_fit_cached_image_tower(tmp_path, image_text_data, crop_scale):
    """The training shards draw 96 images of 6 kinds (3 colours x 2 shapes). With crop_scale [1, 1] the train
    transform is deterministic and the cache holds 6 entries after 2 epochs; random crops make nearly every image
    new (the cache stays exact, it only stops paying). The trained model reloads from its checkpoint."""
    root = str(tmp_path / "run")
    config = clip_config(root, image_text_data, max_steps=12)
    config["model"]["class_path"] = "diffmm.train.LiTModule"
    args = config["model"]["init_args"]
    args["model_kwargs"] = KWARGS
    args.update(lock_image=True, lock_image_unlocked=["visual.blocks.2."], cache_image_features=True, image_lr=1e-3)
    config["data"]["init_args"]["crop_scale"] = list(crop_scale)
    config["trainer"]["limit_val_batches"] = 0
    cli = run_cli(["fit", "--config", write_yaml(tmp_path / "lit.yaml", config)])
    assert cli.trainer.global_step == 12
    n = len(cli.model._image_cache)
    assert n == 6 if crop_scale == (1.0, 1.0) else n > 90
    loaded = diffmm.load_pretrained(os.path.join(root, "checkpoints", "last.ckpt"))
    images, tokens = batch(cli.model)
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_image(images), cli.model.model.eval().encode_image(images),
                                   atol=0.0, rtol=0.0)


def test_modules_with_the_same_locked_weights_share_the_cache():
    """Two modules whose locked blocks are equal share one cache (the second computes nothing new, and its features
    are its own: the unlocked block differs); a changed locked weight or another start gets its own cache."""
    kw = dict(lock_image=True, lock_image_unlocked=["visual.blocks.2."], cache_image_features=True)
    a, b, c = module(seed=0, **kw), module(seed=1, **kw), module(seed=0, **kw)
    b.model.visual.load_state_dict({k: v for k, v in a.model.visual.state_dict().items()
                                    if not k.startswith(("blocks.2.", "norm."))}, strict=False)
    images, tokens = batch(a)
    a.features(images, tokens)
    computed = []
    b.model.visual.prefix = lambda *args: computed.append(1) or pytest.fail("recomputed a cached image")
    plain = module(seed=1, lock_image=True, lock_image_unlocked=["visual.blocks.2."])
    plain.model.load_state_dict(b.model.state_dict())
    for x, y in zip(b.features(images, tokens), plain.features(images, tokens)):
        torch.testing.assert_close(x, y, **TOL)
    assert a._image_cache is b._image_cache and len(SHARED_IMAGE_CACHES) == 1
    with torch.no_grad():
        c.model.visual.blocks[0].mlp.fc1.weight.add_(1e-3)
    c.features(images, tokens)
    d = module(seed=0, lock_image=True, lock_image_unlocked=["visual.blocks.1."], cache_image_features=True)
    d.features(images, tokens)
    assert len(SHARED_IMAGE_CACHES) == 3 and c._image_cache is not a._image_cache


def test_low_precision_weights():
    """Images are cast to the patch embedding's dtype, as encode_image does (bf16 weights: no dtype error)."""
    kw = dict(lock_image=True, lock_image_unlocked=["visual.blocks.2."])
    torch.manual_seed(0)
    cached = LiTModule(model_name="DiffCLIP-Tiny", model_kwargs={**KWARGS, "precision": "bf16"},
                        cache_image_features=True, **kw)
    torch.manual_seed(0)
    plain = LiTModule(model_name="DiffCLIP-Tiny", model_kwargs={**KWARGS, "precision": "bf16"}, **kw)
    plain.model.load_state_dict(cached.model.state_dict())
    assert cached.model.visual.patch_embed.proj.weight.dtype == torch.bfloat16
    images, tokens = batch(cached)
    for a, b in zip(cached.features(images, tokens), plain.features(images, tokens)):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)
