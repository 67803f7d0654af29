"""The demo's evaluations of image-text models: closures ``fn(model, seed) -> dict`` that a
:class:`~diffmm_demo.parts.Part` runs on each trained checkpoint (zero-shot on the held-out emoji style, retrieval,
the non-emoji image sets), and the pictures of a LiT part. Each calls what ``diffmm eval`` / ``diffmm classify`` run
and puts chance beside every number.
"""
from __future__ import annotations

import glob
import itertools
import json
import math
import os
from typing import Any, Callable, Optional

import torch
from PIL import Image

from diffmm import load_pretrained
from diffmm.data.stats import DataStats
from diffmm.data.tar_reader import iter_tar_samples
from diffmm.eval.classify import classify_images
from diffmm.eval.image_sources import open_image_source
from diffmm.eval.plots import cls_attention, plot_attention_maps
from diffmm.eval.retrieval import retrieval_on_shards
from diffmm.eval.zeroshot import build_zero_shot_classifier, encode_images, zero_shot
from diffmm.models.clip.preprocess import tokenizer_for, transforms_for

from diffmm_demo.imageset import ICON_SET, STAMPS
from diffmm_demo.montage import draw_predictions


#: the prompt of the emoji captions the CLIP models train on ("an emoji of NAME, keywords")
EMOJI_TEMPLATE = "an emoji of {}."
#: the non-emoji zero-shot set (``python -m diffmm_demo data icons``)
ICONS = f"icons-{ICON_SET}"


def _zero_shot(model, spec: str, label_field: str, names: list[str], templates: list[str], n: Optional[int]) -> dict:
    source = open_image_source(spec, transforms_for(model)[1], label_field=label_field, batch_size=128, num_workers=0)
    r = zero_shot(model, tokenizer_for(model), source, names, templates, precision="fp32",
                  max_batches=n and math.ceil(n / 128))
    return {"top1": r.top1, "top5": r.top5, "images": r.n, "classes": len(names), "chance_top1": 1 / len(names),
            "chance_top5": min(5, len(names)) / len(names)}


def attention_maps(held: str, prefix: str, n: int = 4) -> Callable[[dict, str], list[str]]:
    """The plot of a CLIP part: CLS attention of the last vision layer of each model (first seed) on the first ``n``
    images of the shards ``held``, to ``attention/<prefix>_<i>.png``."""
    def plot(res: dict, out: str) -> list[str]:
        models = {x: load_pretrained(os.path.join(out, next(iter(rs.values()))["train"]["checkpoint"]))
                  for x, rs in res["runs"].items()}
        images = {x: next(iter(open_image_source(held, transforms_for(m)[1], label_field="json:group_id",
                                                 batch_size=n, num_workers=0)))[0] for x, m in models.items()}
        shown = next(iter(images.values()))  # (n, 3, S, S)
        return [os.path.relpath(plot_attention_maps(
            shown[i], {x: cls_attention(m, images[x][i]) for x, m in models.items()},
            os.path.join(out, "attention", f"{prefix}_{i}.png"), title=f"held-out image {i}: CLS attention, last "
            "vision layer"), out) for i in range(len(shown))]
    return plot


def held_out_zero_shot(data: str, held: str, n: Optional[int]) -> dict[str, Callable[[Any, int], dict]]:
    """``zs_group`` and ``zs_subgroup``: zero-shot on the held-out emoji shards by emoji group and by subgroup (names
    lower-cased, '-' -> ' ', the prompt :data:`EMOJI_TEMPLATE`), the first ``n`` images rounded up to batches of 128
    (None: all). The images are encoded once per model: the second evaluation reuses the first's image features
    (the numbers equal :func:`~diffmm.eval.zeroshot.zero_shot`'s, tests/demo/test_demo_evals.py)."""
    memo: dict[str, Any] = {}

    def features(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if memo.get("model") is not model:
            def source(level: str):
                src = open_image_source(held, transforms_for(model)[1], label_field=f"json:{level}_id",
                                        batch_size=128, num_workers=0)
                return itertools.islice(src, n and math.ceil(n / 128))
            feats, groups = zip(*[(encode_images(model, x), y) for x, y in source("group")])
            memo.update(model=model, feats=torch.cat(feats), labels={
                "group": torch.cat(groups), "subgroup": torch.cat([y for _, y in source("subgroup")])})
        return memo["feats"], memo["labels"]

    def evaluation(level: str) -> Callable[[Any, int], dict]:
        def run(model, seed: int) -> dict:
            with open(os.path.join(data, "emoji", "classes.json")) as f:
                names = [c.replace("-", " ").lower() for c in json.load(f)[f"{level}s"]]
            feats, labels = features(model)
            ranked = (feats @ build_zero_shot_classifier(model, tokenizer_for(model), names, [EMOJI_TEMPLATE])).topk(
                min(5, len(names)), dim=1).indices  # (N, 5)
            hit = ranked == labels[level].to(ranked.device)[:, None]
            return {"top1": hit[:, 0].float().mean().item(), "top5": hit.any(1).float().mean().item(),
                    "images": len(feats), "classes": len(names), "chance_top1": 1 / len(names),
                    "chance_top5": min(5, len(names)) / len(names)}
        return run
    return {"zs_group": evaluation("group"), "zs_subgroup": evaluation("subgroup")}


def held_out_retrieval(held: str, n: Optional[int]) -> Callable[[Any, int], dict]:
    """Image<->text retrieval on the held-out emoji shards, with chance beside it."""
    def run(model, seed: int) -> dict:
        r = retrieval_on_shards(model, tokenizer_for(model), held, transforms_for(model)[1], batch_size=128,
                                num_workers=0, precision="fp32", max_batches=n and math.ceil(n / 128))
        return {**r, "chance_R1": 1 / r["images"], "chance_R5": min(5, r["images"]) / r["images"]}
    return run


def _image_set_zero_shot(model, root: str, templates: Optional[int] = None) -> tuple[Any, dict]:
    """Zero-shot on a non-emoji image set (an image folder with ``classes.json``) with its own class names and its
    first ``templates`` prompts (all: None); the result and the set's classes.json."""
    with open(os.path.join(root, "classes.json")) as f:
        c = json.load(f)
    source = open_image_source(root, transforms_for(model)[1], classnames=c["classes"], batch_size=128, num_workers=0)
    r = zero_shot(model, tokenizer_for(model), source, c["classes"], list(c["templates"][:templates]),
                  precision="fp32")
    n = len(c["classes"])
    return {"top1": r.top1, "top5": r.top5, "mean_per_class": r.mean_per_class_accuracy, "images": r.n,
            "classes": n, "chance_top1": 1 / n, "chance_top5": min(5, n) / n}, c


def icons_zero_shot(data: str) -> Callable[[Any, int], dict]:
    """Zero-shot on the non-emoji icon set (``python -m diffmm_demo data icons``): 31 publisher categories as class
    names, the first prompt."""
    return lambda model, seed: _image_set_zero_shot(model, os.path.join(data, ICONS), templates=1)[0]


def stamps_zero_shot(data: str) -> Callable[[Any, int], dict]:
    """Zero-shot on Tux Paint's stamps (``python -m diffmm_demo data stamps``; clip art and cut-out photos, not
    emoji): 17 publisher categories, unbalanced (the majority class, ``symbols``, holds 31 %), so the mean per-class
    accuracy is reported beside top-1, with chance and the majority share."""
    def run(model, seed: int) -> dict:
        result, meta = _image_set_zero_shot(model, os.path.join(data, STAMPS))
        return {**result, "majority": meta["majority_share"]}
    return run


def lit_pictures(data: str, held: str, model_label: str, prefix: str = "lit") -> Callable[[dict, str], list[str]]:
    """A LiT part's pictures: CLS attention maps, and the zero-shot predictions of ``model_label`` (first seed)
    on two held-out images of each emoji group, written as ``{prefix}_predictions.png`` and ``.md``."""
    maps = attention_maps(held, f"{prefix}_attention")

    def plot(res: dict, out: str) -> list[str]:
        run = next(iter(res["runs"][model_label].values()))
        model = load_pretrained(os.path.join(out, run["train"]["checkpoint"]))
        with open(os.path.join(data, "emoji", "classes.json")) as f:
            groups = json.load(f)["groups"]
        picked: dict[int, list] = {}
        for url in sorted(glob.glob(held)):
            for s in iter_tar_samples(url, DataStats("predictions")):
                g = json.loads(s["json"])["group_id"]
                if len(picked.setdefault(g, [])) < 2:
                    picked[g].append(s)
        samples = [s for g in sorted(picked) for s in picked[g]]
        folder = os.path.join(out, f"{prefix}_predictions")  # a folder of images, as `diffmm classify` reads
        os.makedirs(folder, exist_ok=True)
        files = [os.path.join(folder, f"{s['__key__']}.png") for s in samples]
        for s, path in zip(samples, files):
            with open(path, "wb") as f:
                f.write(s["png"])
        names = [n.lower() for n in groups]
        preds = classify_images(model, tokenizer_for(model), transforms_for(model)[1], files, names, [EMOJI_TEMPLATE],
                                top_k=1, show_progress=False, num_workers=0)
        cells = [(Image.open(path), names[json.loads(s["json"])["group_id"]], lab[0], p[0])
                 for path, s, lab, p in zip(preds.files, samples, preds.labels, preds.probs)]
        title = f"{model_label}, seed {next(iter(res['runs'][model_label]))}: zero-shot emoji group of unseen art"
        draw_predictions(cells, os.path.join(out, f"{prefix}_predictions.png"), title, n_cols=9)
        rows = [f"| {json.loads(s['json'])['name']} | {t} | {pr} ({100 * p:.0f} %) | {'✓' if pr == t else '✗'} |"
                for (img, t, pr, p), s in zip(cells, samples)]
        with open(os.path.join(out, f"{prefix}_predictions.md"), "w") as f:
            f.write("| emoji (held-out art) | group | predicted | |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
        return [f"{prefix}_predictions.png", f"{prefix}_predictions.md", *maps(res, out)]
    return plot


def fashion_zero_shot(data: str, n: Optional[int]) -> Callable[[Any, int], dict]:
    """Zero-shot on the first ``n`` Fashion-MNIST test images (10 classes; its prompts and the emoji prompt)."""
    def run(model, seed: int) -> dict:
        with open(os.path.join(data, "fashion-mnist", "classes.json")) as f:
            c = json.load(f)
        return _zero_shot(model, os.path.join(data, "fashion-mnist", "test", "*.tar"), "cls", c["classes"],
                          c["templates"] + [EMOJI_TEMPLATE], n)
    return run
