"""The demo's data: build what is missing with the :mod:`diffmm.demo.datasets` builders, and name the shards.

Layout (``docs/data.md``): ``DATA/emoji/<style>/`` (+ ``classes.json``), ``DATA/fashion-mnist/test/``
(+ ``classes.json``), ``DATA/python-docs/{train,val}/`` (+ ``tokenizer.json``, ``info.json``). Every
shard folder has a ``sizes.json``; its keys are the shard files, so no shard name is hard-coded.
"""
from __future__ import annotations

import json
import logging
import os
import tarfile
from dataclasses import dataclass
from typing import Optional

from diffmm.demo.datasets import build_emoji, build_fashion_mnist, build_python_docs

log = logging.getLogger("diffmm.demo")


def shard_paths(folder: str) -> list[str]:
    """The shards listed in ``folder/sizes.json`` (sorted); [] when it or any shard is missing."""
    sizes = os.path.join(folder, "sizes.json")
    if not os.path.isfile(sizes):
        return []
    with open(sizes) as f:
        names = sorted(json.load(f))
    paths = [os.path.join(folder, n) for n in names]
    return paths if paths and all(os.path.isfile(p) for p in paths) else []


def shard_count(folder: str) -> int:
    """Samples in ``folder`` according to its ``sizes.json``."""
    with open(os.path.join(folder, "sizes.json")) as f:
        return int(sum(json.load(f).values()))


def spec(paths: list[str]) -> str:
    """A source spec of :mod:`diffmm.data` for a list of shard files (``::`` between them)."""
    return "::".join(paths)


def missing_emoji_styles(data: str, styles: tuple[str, ...]) -> list[str]:
    root = os.path.join(data, "emoji")
    if not os.path.isfile(os.path.join(root, "classes.json")):
        return list(styles)
    return [s for s in styles if not shard_paths(os.path.join(root, s))]


def fashion_ready(data: str) -> bool:
    root = os.path.join(data, "fashion-mnist")
    return os.path.isfile(os.path.join(root, "classes.json")) and bool(shard_paths(os.path.join(root, "test")))


def text_ready(data: str) -> bool:
    root = os.path.join(data, "python-docs")
    return (os.path.isfile(os.path.join(root, "tokenizer.json"))
            and all(shard_paths(os.path.join(root, s)) for s in ("train", "val")))


def ensure_demo_data(data: str, parts: tuple[str, ...], styles: tuple[str, ...]) -> dict:
    """Build the demo datasets the ``parts`` need and that are not there yet; returns what was built.

    Raises whatever the builders raise (a missing source file: ``FileNotFoundError`` naming its package).
    """
    built: dict = {}
    if "clip" in parts:
        missing = missing_emoji_styles(data, styles)
        if missing:
            log.info("building emoji styles %s under %s", missing, data)
            built["emoji"] = build_emoji(data, missing)
        if not fashion_ready(data):
            log.info("building Fashion-MNIST under %s", data)
            built["fashion-mnist"] = build_fashion_mnist(data)
    if "lm" in parts and not text_ready(data):
        log.info("building the Python-docs corpus under %s", data)
        built["python-docs"] = build_python_docs(data)
    return built


@dataclass
class DemoData:
    """Paths of everything the demo reads (filled in by :func:`locate`)."""

    data: str
    train_shards: list[str]
    holdout_shards: list[str]
    emoji_classes: Optional[dict]
    fashion_shards: list[str]
    fashion_classes: Optional[dict]
    lm_train_shards: list[str]
    lm_val_shards: list[str]
    tokenizer: Optional[str]

    def summary(self) -> dict:
        def n(paths: list[str]) -> int:
            folders = sorted({os.path.dirname(p) for p in paths})
            total = 0
            for f in folders:
                with open(os.path.join(f, "sizes.json")) as fh:
                    sizes = json.load(fh)
                total += sum(v for k, v in sizes.items() if os.path.join(f, k) in paths)
            return total

        return {"train_pairs": n(self.train_shards), "holdout_pairs": n(self.holdout_shards),
                "fashion_test_images": n(self.fashion_shards), "lm_train_documents": n(self.lm_train_shards),
                "lm_val_documents": n(self.lm_val_shards), "tokenizer": self.tokenizer}


def locate(data: str, parts: tuple[str, ...], train_styles: tuple[str, ...], holdout: str) -> DemoData:
    """Find the shards of every dataset the ``parts`` need; raises FileNotFoundError naming what is missing."""
    def need(paths: list[str], what: str) -> list[str]:
        if not paths:
            raise FileNotFoundError(f"{what}: no shards (sizes.json + tar files) under {data}; "
                                    f"build them with `diffmm shards demo-all --out {data}`")
        return paths

    def read(path: str) -> dict:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found; build the demo data with `diffmm shards demo-all --out {data}`")
        with open(path) as f:
            return json.load(f)

    d = DemoData(data, [], [], None, [], None, [], [], None)
    if "clip" in parts:
        root = os.path.join(data, "emoji")
        d.emoji_classes = read(os.path.join(root, "classes.json"))
        d.train_shards = [p for s in train_styles for p in need(shard_paths(os.path.join(root, s)), f"emoji style {s}")]
        d.holdout_shards = need(shard_paths(os.path.join(root, holdout)), f"emoji style {holdout}")
        froot = os.path.join(data, "fashion-mnist")
        d.fashion_classes = read(os.path.join(froot, "classes.json"))
        d.fashion_shards = need(shard_paths(os.path.join(froot, "test")), "Fashion-MNIST test")
    if "lm" in parts:
        root = os.path.join(data, "python-docs")
        d.lm_train_shards = need(shard_paths(os.path.join(root, "train")), "Python-docs train")
        d.lm_val_shards = need(shard_paths(os.path.join(root, "val")), "Python-docs val")
        d.tokenizer = os.path.join(root, "tokenizer.json")
        if not os.path.isfile(d.tokenizer):
            raise FileNotFoundError(f"{d.tokenizer} not found; build it with `diffmm shards demo-text --out {data}`")
    return d


def read_documents(paths: list[str], field: str = "txt", max_chars: int = 2_000_000) -> list[str]:
    """The text documents (``KEY.txt`` members) of text shards, in shard order (for needle haystacks)."""
    docs: list[str] = []
    n = 0
    for p in paths:
        with tarfile.open(p) as tf:
            for m in tf:
                if m.isfile() and m.name.endswith("." + field):
                    text = tf.extractfile(m).read().decode("utf-8", errors="replace")
                    docs.append(text)
                    n += len(text)
                    if n >= max_chars:
                        return docs
    return docs
