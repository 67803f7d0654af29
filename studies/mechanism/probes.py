"""What the mechanism study measures on a trained image tower, through diffmm's public API: zero-shot on the held-out
emoji art, the CLS token's attention inside the subject's alpha mask, robustness to distractors, noise and blur,
a linear probe and 5-shot accuracy from frozen features.

Every image set is built once per process (:class:`EmojiSets`) and is the same for every arm and seed.
"""
from __future__ import annotations

import glob
import io
import json
import math
import os
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter

from diffmm.data.stats import DataStats
from diffmm.data.tar_reader import iter_tar_samples
from diffmm.eval.attention_capture import AttentionRecorder
from diffmm.eval.linear_probe import linear_probe
from diffmm.eval.zeroshot import build_zero_shot_classifier, encode_images
from diffmm.models.clip.preprocess import tokenizer_for, transforms_for

from diffmm_demo.datasets import StyleSource
from diffmm_demo.evals import EMOJI_TEMPLATE

#: robustness conditions: name -> (kind, parameter); scenes put the subject at 40 px on the 64 px canvas
CONDITIONS = {"clean": ("none", 0), "noise_0.1": ("noise", 0.1), "noise_0.2": ("noise", 0.2),
              "blur_1": ("blur", 1.0), "blur_2": ("blur", 2.0), "scene_0": ("scene", 0), "scene_1": ("scene", 1),
              "scene_2": ("scene", 2), "scene_3": ("scene", 3)}


def bare_key(codepoints: str) -> str:
    """A shard's ``codepoints`` (``1f1f0_1f1ed``) as the style sources' lookup key (``1F1F0-1F1ED``, no FE0F)."""
    return "-".join(c.upper() for c in codepoints.split("_") if c.lower() != "fe0f")


def load_style(data: str, style: str) -> list[dict]:
    """The samples of one emoji style's shards: key, RGB image, group and subgroup ids, code points."""
    out = []
    for url in sorted(glob.glob(os.path.join(data, "emoji", style, "*.tar"))):
        for s in iter_tar_samples(url, DataStats(style)):
            meta = json.loads(s["json"])
            out.append({"key": s["__key__"], "image": Image.open(io.BytesIO(s["png"])).convert("RGB"),
                        "group": meta["group_id"], "subgroup": meta["subgroup_id"], "codepoints": meta["codepoints"]})
    return out


class EmojiSets:
    """The held-out art (Twitter style) with its RGBA originals (alpha = the subject's mask), the training art
    (Noto, OpenMoji) for the linear probe, the class names and the robustness images."""

    def __init__(self, data: str, held: str = "twitter", train=("noto", "openmoji"), seed: int = 0,
                 scenes: bool = True):
        with open(os.path.join(data, "emoji", "classes.json")) as f:
            classes = json.load(f)
        self.names = {lvl: [c.replace("-", " ").lower() for c in classes[f"{lvl}s"]] for lvl in ("group", "subgroup")}
        self.held = load_style(data, held)
        self.train = [s for st in train for s in load_style(data, st)]
        source = StyleSource(held)
        self.rgba = [Image.open(source.files[bare_key(s["codepoints"])]).convert("RGBA").resize((64, 64))
                     for s in self.held]
        self.alpha = torch.tensor(np.stack([np.asarray(im)[..., 3] / 255.0 for im in self.rgba]), dtype=torch.float32)
        self.labels = {lvl: torch.tensor([s[lvl] for s in self.held]) for lvl in ("group", "subgroup")}
        self.conditions = {}  # robustness images (not needed to recompute attention records)
        if scenes:
            self.conditions = {name: self._condition(kind, p, seed) for name, (kind, p) in CONDITIONS.items()}

    def _condition(self, kind: str, p: float, seed: int) -> list[Image.Image]:
        rng = np.random.default_rng(seed)
        images = [s["image"] for s in self.held]
        if kind == "noise":
            noisy = [np.clip(np.asarray(im) / 255.0 + rng.normal(0, p, (64, 64, 3)), 0, 1) for im in images]
            return [Image.fromarray((x * 255).round().astype(np.uint8)) for x in noisy]
        if kind == "blur":
            return [im.filter(ImageFilter.GaussianBlur(p)) for im in images]
        if kind == "scene":
            return [self._scene(i, int(p), rng) for i in range(len(images))]
        return images

    def _scene(self, i: int, n: int, rng: np.random.Generator) -> Image.Image:
        """Subject ``i`` at 40 px at a random place on white, with ``n`` emoji of other groups at 20 px beside it."""
        canvas = Image.new("RGBA", (64, 64), (255, 255, 255, 255))
        x0, y0 = (int(v) for v in rng.integers(0, 25, 2))
        canvas.alpha_composite(self.rgba[i].resize((40, 40), Image.LANCZOS), (x0, y0))
        others = np.flatnonzero(self.labels["group"].numpy() != self.held[i]["group"])
        boxes = [(x0, y0, 40)]
        for _ in range(n):
            for _try in range(100):
                x, y = (int(v) for v in rng.integers(0, 45, 2))
                if all(x + 20 <= bx or bx + bs <= x or y + 20 <= by or by + bs <= y for bx, by, bs in boxes):
                    break
            boxes.append((x, y, 20))
            canvas.alpha_composite(self.rgba[int(rng.choice(others))].resize((20, 20), Image.LANCZOS), (x, y))
        return canvas.convert("RGB")


@torch.no_grad()
def encode(model, images: list[Image.Image], batch: int = 256) -> torch.Tensor:
    """L2-normalised image features (N, D) through the model's own eval transform."""
    tf = transforms_for(model)[1]
    return torch.cat([encode_images(model, torch.stack([tf(im) for im in images[i:i + batch]]))
                      for i in range(0, len(images), batch)])


def zero_shot(model, sets: EmojiSets, feats: torch.Tensor) -> dict:
    """Top-1 / top-5 by group (9) and subgroup (99) of held-out features ``feats``, prompt "an emoji of {}."."""
    out = {}
    for lvl in ("group", "subgroup"):
        cls = build_zero_shot_classifier(model, tokenizer_for(model), sets.names[lvl], [EMOJI_TEMPLATE])
        ranked = (feats @ cls).topk(5, dim=1).indices
        hit = ranked == sets.labels[lvl][:, None]
        out[lvl] = {"top1": hit[:, 0].float().mean().item(), "top5": hit.any(1).float().mean().item()}
    return out


@torch.no_grad()
def attention_mass(model, sets: EmojiSets, n: int = 512, layers: Optional[list[int]] = None) -> dict:
    """The CLS row of the last vision attention layer(s) on the first ``n`` held-out images: the share of its
    absolute mass over patch tokens that falls inside the subject's alpha mask (patch coverage weighted), per head
    and averaged, for the head's effective map (A, or A1 - lambda A2) and, for differential layers, each softmax
    map; the entropy of the softmax maps (nats, over all keys); what a uniform map would give."""
    tf = transforms_for(model)[1]
    x = torch.stack([tf(s["image"]) for s in sets.held[:n]])
    with AttentionRecorder(model, include=lambda name: name.startswith("visual")) as rec:
        model.encode_image(x)
    picks = layers if layers is not None else [-1]
    side = x.shape[-1]
    out = {}
    for li in picks:
        r = rec.records[li].select_queries(slice(0, 1))
        probs, maps = r.probs()[:, :, 0], r.maps()[:, :, 0]  # (B, Hq, S), (B, h, S)
        S = maps.shape[-1]
        g = math.isqrt(S - 1)
        pre = S - g * g
        alpha = F.interpolate(sets.alpha[:n, None], size=(side, side), mode="bilinear", align_corners=False)
        cover = F.adaptive_avg_pool2d(alpha, g).flatten(1)  # (B, g*g) share of each patch inside the subject

        def share(w: torch.Tensor, cover=cover, pre=pre) -> torch.Tensor:  # (B, H, S) -> (H,)
            a = w[..., pre:].abs()
            return ((a * cover[:, None]).sum(-1) / a.sum(-1).clamp_min(1e-12)).mean(0)

        rec_out = {"layer": r.name, "kind": r.kind, "uniform_share": cover.mean().item(),
                   "max_entropy": math.log(S), "map_share": share(maps).tolist(),
                   "map_positive_share": share(maps.clamp_min(0)).tolist(),  # added after the first results
                   "map_negative_share": share(maps.clamp_max(0)).tolist()}
        if r.kind == "standard":
            rec_out["entropy"] = entropy(probs).tolist()
        else:
            rec_out.update(a1_share=share(probs[:, 0::2]).tolist(), a2_share=share(probs[:, 1::2]).tolist(),
                           a1_entropy=entropy(probs[:, 0::2]).tolist(), a2_entropy=entropy(probs[:, 1::2]).tolist(),
                           entropy=entropy(probs[:, 0::2]).tolist(),
                           a1_minus_a2=(probs[:, 0::2] - probs[:, 1::2]).flatten(2).norm(dim=-1).mean(0).tolist(),
                           lam=float(r.lam))
        for k in ("map_share", "map_positive_share", "map_negative_share"):
            rec_out[f"{k}_mean"] = float(np.mean(rec_out[k]))
        rec_out["entropy_mean"] = float(np.mean(rec_out["entropy"]))
        out[str(li)] = rec_out
    return out


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of attention rows (B, H, S), averaged over images: (H,)."""
    return -(p * p.clamp_min(1e-12).log()).sum(-1).mean(0)


def robustness(model, sets: EmojiSets) -> dict:
    """Zero-shot group and subgroup top-1 under each of :data:`CONDITIONS`."""
    return {name: zero_shot(model, sets, encode(model, images)) for name, images in sets.conditions.items()}


def probes(model, sets: EmojiSets, feats: torch.Tensor, shots: int = 5, draws: int = 5) -> dict:
    """Linear probe (train art -> held-out art) and ``shots``-shot nearest-class-mean accuracy within the held-out
    art, on the 99 subgroups, from the frozen image features."""
    train_x = encode(model, [s["image"] for s in sets.train]).numpy()
    train_y = np.array([s["subgroup"] for s in sets.train])
    test_y = sets.labels["subgroup"].numpy()
    lp = linear_probe(train_x, train_y, feats.numpy(), test_y, coarse=tuple(10.0 ** np.arange(-1, 5)), refine=0,
                      max_iter=300)
    rng = np.random.default_rng(0)
    accs = []
    for _ in range(draws):
        support, query = [], []
        for c in np.unique(test_y):
            idx = rng.permutation(np.flatnonzero(test_y == c))
            if len(idx) > shots:
                support.append(idx[:shots])
                query.extend(idx[shots:])
        classes = np.array([test_y[s[0]] for s in support])
        protos = F.normalize(torch.stack([feats[s].mean(0) for s in support]), dim=-1)
        pred = classes[(feats[query] @ protos.T).argmax(1).numpy()]
        accs.append(float((pred == test_y[query]).mean()))
    return {"linear_probe": {k: lp[k] for k in ("top1", "mean_per_class_accuracy", "best_C", "train", "test")},
            "few_shot": {"shots": shots, "draws": draws, "top1": float(np.mean(accs)), "top1_per_draw": accs}}
