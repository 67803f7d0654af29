"""Shared fixtures of the demo tests: tiny synthetic demo data and the demo's config files with the models shrunk.

The synthetic emoji shards are written directly; Fashion-MNIST and the text corpus go through the real demo
builders on small synthetic sources. Models are the Tiny configs shrunk to one layer and 16 px (the LiT configs
keep the pretrained MiniLM text tower, which their tests need installed; the DINOv2 ones keep DINOv2 at 28 px).
"""
from __future__ import annotations

import gzip
import io
import json
import os
import random
import struct

import numpy as np
import pytest
import yaml
from PIL import Image

from diffmm.data.writer import ShardWriter

from diffmm_demo.datasets import STYLES, build_fashion_mnist, build_python_docs
from diffmm_demo.evals import ICONS
from diffmm_demo.imageset import STAMPS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GROUPS = ["Smileys & Emotion", "Animals & Nature", "Flags"]
SUBGROUPS = ["face-smiling", "animal-mammal", "animal-bird", "country-flag"]
SUB_TO_GROUP = [0, 1, 1, 2]
WORDS = ("python module function class method value list string file object return import error "
         "the a of to is in and for with as by on this that be are can it from").split()
TINY = {"clip_tiny_emoji.yaml": dict(embed_dim=16, vision_cfg=dict(image_size=16, patch_size=8, width=32, layers=1,
                                                                   head_width=16),
                                     text_cfg=dict(context_length=16, width=32, heads=2, layers=1)),
        "lm_transformer_tiny_pydocs.yaml": dict(n_layer=1, n_embd=32, n_head=2, block_size=128)}
TINY["diffclip_tiny_emoji.yaml"], TINY["lm_diff_tiny_pydocs.yaml"] = TINY["clip_tiny_emoji.yaml"], TINY[
    "lm_transformer_tiny_pydocs.yaml"]
for _name in ("lit_clip_tiny_emoji.yaml", "lit_diffclip_tiny_emoji.yaml", "lit_diffclip_diffminilm_tiny_emoji.yaml"):
    TINY[_name] = dict(embed_dim=16, vision_cfg=TINY["clip_tiny_emoji.yaml"]["vision_cfg"],
                       text_cfg=dict(context_length=16))
for _name in ("lit_clip_dinov2_emoji.yaml", "lit_diffclip_dinov2_emoji.yaml"):  # DINOv2's weights at 28 px (2 x 2)
    TINY[_name] = dict(embed_dim=16, vision_cfg=dict(image_size=28), text_cfg=dict(context_length=16))


def _emoji_style(root: str, style: str, n: int, seed: int) -> None:
    rng = random.Random(0)  # the same emoji (names, labels) in every style; the art differs by `seed`
    art = np.random.default_rng(seed)
    with ShardWriter(os.path.join(root, style), f"emoji-{style}", maxcount=16) as w:
        for i in range(n):
            sub = rng.randrange(len(SUBGROUPS))
            buf = io.BytesIO()
            Image.fromarray(art.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(buf, "PNG")
            name = f"{SUBGROUPS[sub].replace('-', ' ')} {i}"
            meta = {"name": name, "group_id": SUB_TO_GROUP[sub], "subgroup_id": sub, "style": style}
            w.write(f"e{i:04d}", {"png": buf.getvalue(), "txt": f"an emoji of {name}, {WORDS[i % len(WORDS)]}",
                                  "json": json.dumps(meta)})


def _write_idx(path: str, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("demo")
    data = str(root / "data")
    emoji = os.path.join(data, "emoji")
    for k, style in enumerate(STYLES):
        _emoji_style(emoji, style, 24, seed=k)
    with open(os.path.join(emoji, "classes.json"), "w") as f:
        json.dump({"groups": GROUPS, "subgroups": SUBGROUPS, "templates": ["an emoji of {}."]}, f)
    icons = os.path.join(data, ICONS)  # the non-emoji image set: an image folder per class + classes.json
    classes = ["food drinks", "sports", "transportation"]
    for c, name in enumerate(classes):
        os.makedirs(os.path.join(icons, name.replace(" ", "_")))
        for i in range(4):
            Image.fromarray(np.random.default_rng(c * 10 + i).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
                os.path.join(icons, name.replace(" ", "_"), f"i{i}.png"))
    with open(os.path.join(icons, "classes.json"), "w") as f:
        json.dump({"classes": classes, "templates": ["an emoji of {}.", "an icon of {}."]}, f)
    stamps = os.path.join(data, STAMPS)  # the second non-emoji set, as `python -m diffmm_demo data stamps` writes it
    for c, name in enumerate(["animals", "food"]):
        os.makedirs(os.path.join(stamps, name))
        for i in range(3 + c):
            Image.fromarray(np.random.default_rng(100 + c * 10 + i).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
                os.path.join(stamps, name, f"s{i}.png"))
    with open(os.path.join(stamps, "classes.json"), "w") as f:
        json.dump({"classes": ["animals", "food"], "templates": ["an emoji of {}."], "majority_share": 4 / 7}, f)
    idx = root / "idx"
    idx.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 20), ("t10k", 40)):
        _write_idx(str(idx / f"{prefix}-images-idx3-ubyte.gz"), rng.integers(0, 255, (n, 28, 28)))
        _write_idx(str(idx / f"{prefix}-labels-idx1-ubyte.gz"), np.arange(n) % 10)
    build_fashion_mnist(data, source_dir=str(idx), progress=False)
    src = root / "_sources"
    (src / "library").mkdir(parents=True)
    wr = random.Random(0)
    for i in range(24):
        text = "\n\n".join(" ".join(wr.choice(WORDS) for _ in range(wr.randint(3, 6))).capitalize() + "."
                           for _ in range(60))
        (src / "library" / f"mod{i}.rst.txt").write_text(f"Module {i}\n========\n\n{text}\n")
    build_python_docs(data, source_dir=str(src), vocab_size=320, val_every=4, progress=False)
    return data


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> str:
    """The demo's config files with the CLIP and LM models shrunk (the recall configs as they are)."""
    out = tmp_path_factory.mktemp("configs")
    for name in ("recall_transformer_tiny.yaml", "recall_diff_tiny.yaml", "recall_diff_v2_tiny.yaml", *TINY):
        with open(os.path.join(ROOT, "configs", name)) as f:
            cfg = yaml.safe_load(f)
        if name in TINY:
            kwargs = dict(TINY[name])
            if "text_cfg" in kwargs:  # a config's own text settings (the per-layer attention of the MiniLM) stay
                given = cfg["model"]["init_args"].get("model_kwargs") or {}
                kwargs["text_cfg"] = {**given.get("text_cfg", {}), **kwargs["text_cfg"]}
            cfg["model"]["init_args"]["model_kwargs"] = kwargs
        if name.startswith("lit_"):  # two styles of 24 synthetic emoji: a batch must hold fewer than 64 pairs
            cfg["data"]["init_args"]["batch_size"] = 16
        with open(out / name, "w") as f:
            yaml.safe_dump(cfg, f)
    return str(out)
