"""The demo's evaluations, all through ``diffmm.eval``; each returns a flat dict of numbers.

CLIP / DiffCLIP: zero-shot classification of the held-out emoji art style by emoji group (9
classes) and subgroup (99 classes), zero-shot Fashion-MNIST (10 classes), image<->text retrieval
on the held-out style. LMs: validation loss, multi-needle retrieval (accuracy and the attention
share on the answer needle), activation outliers (DIFF paper Table 5).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from diffmm.demo.config import DemoConfig
from diffmm.demo.data import DemoData, read_documents

#: prompt template of the emoji captions the models were trained on ("an emoji of NAME, keywords")
EMOJI_TEMPLATE = "an emoji of {}."


def _batches(n: Optional[int], batch: int) -> Optional[int]:
    return None if n is None else max(1, math.ceil(n / batch))


def clip_tools(model: torch.nn.Module):
    """(eval transform, CLIP BPE tokenizer) at the model's image size and context length."""
    from diffmm.data.tokenizers import clip_tokenizer
    from diffmm.data.transforms import image_transform

    size = model.config.vision_cfg.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    return image_transform(int(size), train=False), clip_tokenizer(int(model.config.text_cfg.context_length))


def emoji_classnames(classes: dict, level: str) -> list[str]:
    """Prompt names of the emoji groups (``level='group'``) or subgroups: lower case, ``-`` -> space."""
    names = classes["groups" if level == "group" else "subgroups"]
    return [n.replace("-", " ").lower() for n in names]


def _zs_metrics(result) -> dict[str, Any]:
    return {"top1": result.top1, "top5": result.top5, "mean_per_class_accuracy": result.mean_per_class_accuracy,
            "images": result.n, "classes": len(result.classnames), "chance_top1": 1.0 / len(result.classnames),
            "skipped": int(sum(result.skipped.values()))}


def zeroshot_emoji(model, cfg: DemoConfig, data: DemoData, level: str) -> dict[str, Any]:
    """Zero-shot top-1/top-5 on the held-out style with emoji groups or subgroups as classes."""
    from diffmm.eval.image_sources import ShardLabelSource
    from diffmm.eval.zeroshot import zero_shot

    transform, tokenizer = clip_tools(model)
    names = emoji_classnames(data.emoji_classes, level)
    source = ShardLabelSource(data.holdout_shards, transform, f"json:{level}_id", batch_size=cfg.zs_batch,
                              num_workers=0)
    result = zero_shot(model, tokenizer, source, names, [EMOJI_TEMPLATE], precision="fp32",
                       max_batches=_batches(cfg.holdout_images, cfg.zs_batch))
    return _zs_metrics(result)


def zeroshot_fashion(model, cfg: DemoConfig, data: DemoData) -> dict[str, Any]:
    """Zero-shot top-1 on Fashion-MNIST test images (grey 28 px photos: far from the emoji training data)."""
    from diffmm.eval.image_sources import ShardLabelSource
    from diffmm.eval.zeroshot import zero_shot

    transform, tokenizer = clip_tools(model)
    classes = data.fashion_classes
    templates = list(classes.get("templates") or ["a photo of a {}."]) + [EMOJI_TEMPLATE]
    source = ShardLabelSource(data.fashion_shards, transform, "cls", batch_size=cfg.zs_batch, num_workers=0)
    result = zero_shot(model, tokenizer, source, list(classes["classes"]), templates, precision="fp32",
                       max_batches=_batches(cfg.fmnist_images, cfg.zs_batch))
    return _zs_metrics(result)


def retrieval(model, cfg: DemoConfig, data: DemoData) -> dict[str, Any]:
    """Image->text and text->image recall@1/5/10 on the held-out style (one caption per image)."""
    from diffmm.eval.retrieval import retrieval_on_shards

    transform, tokenizer = clip_tools(model)
    r = retrieval_on_shards(model, tokenizer, data.holdout_shards, transform, batch_size=cfg.zs_batch,
                            num_workers=0, precision="fp32", max_batches=_batches(cfg.holdout_images, cfg.zs_batch))
    out = {k: v for k, v in r.items() if "@" in k}
    out.update(images=r["images"], captions=r["texts"], chance_R1=1.0 / max(1, r["images"]))
    return out


# ------------------------------------------------------------------------------------------ LMs
def load_tokenizer(data: DemoData):
    from diffmm.data.tokenizers import load_lm_tokenizer

    return load_lm_tokenizer(data.tokenizer)


def _val_rows(model, cfg: DemoConfig, data: DemoData, tokenizer, batch: int):
    """Validation rows (B, T+1) streamed in shard order, each document once."""
    from diffmm.data.stream import ShardLoader
    from diffmm.data.text import TextDataset

    T = model.config.block_size
    ds = TextDataset(data.lm_val_shards, batch, T, tokenizer=tokenizer, train=False, shuffle=False, equalize=False,
                     name="demo-val")
    return ShardLoader(ds, num_workers=0)


def validation_loss(model, cfg: DemoConfig, data: DemoData, tokenizer) -> dict[str, Any]:
    """Token-weighted validation NLL and perplexity on the held-out Python-docs pages."""
    from diffmm.eval.perplexity import evaluate_perplexity

    r = evaluate_perplexity(model, _val_rows(model, cfg, data, tokenizer, cfg.lm_batch), precision="fp32",
                            max_batches=cfg.lm_val_batches)
    return {"val_loss": r["nll"], "val_ppl": r["perplexity"], "bits_per_token": r["bits_per_token"],
            "tokens": r["tokens"]}


def needle(model, cfg: DemoConfig, data: DemoData, tokenizer, haystack: list[str]) -> dict[str, Any]:
    """Multi-needle retrieval in a context that fits the model, with the attention share on the answer."""
    from diffmm.eval.needle import NeedleConfig, multi_needle

    max_new = cfg.needle_digits + 2
    context = min(cfg.needle_context, model.config.block_size - max_new)
    ncfg = NeedleConfig(context_length=context, num_needles=cfg.needle_needles, num_queried=cfg.needle_queried,
                        depths=tuple(cfg.needle_depths), trials=cfg.needle_trials, digits=cfg.needle_digits,
                        max_new_tokens=max_new, seed=0)
    r = multi_needle(model, tokenizer, haystack, ncfg, measure_attention=True)
    return {"accuracy": r.accuracy, "answer_attention": float(sum(r.attention_by_depth.values())
                                                              / max(1, len(r.attention_by_depth))),
            "accuracy_by_depth": {str(k): v for k, v in r.accuracy_by_depth.items()},
            "attention_by_depth": {str(k): v for k, v in r.attention_by_depth.items()},
            "prompts": r.prompts, "context_length": context, "num_needles": ncfg.num_needles,
            "num_queried": ncfg.num_queried}


def haystack_sentences(data: DemoData, tokenizer, max_tokens: int) -> list[str]:
    """Sentences of the validation pages (text the LMs did not train on) of at most ``max_tokens`` tokens.

    Long "sentences" (code blocks, tables) are dropped: the needle prompt builder stops filling the
    haystack at the first sentence that does not fit, so one of them can leave no haystack at all.
    """
    from diffmm.eval.common import EvalError
    from diffmm.eval.needle import split_sentences

    sentences = split_sentences("\n\n".join(read_documents(data.lm_val_shards)))
    short = [s for s in sentences if len(tokenizer.encode(" " + s)) <= max_tokens]
    if not short:
        raise EvalError(f"needle haystack: no validation sentence of at most {max_tokens} tokens")
    return short


def outliers(model, cfg: DemoConfig, data: DemoData, tokenizer) -> dict[str, Any]:
    """Largest attention logits and hidden states over validation batches (DIFF paper Table 5)."""
    from diffmm.eval.outliers import activation_outliers

    rows = (b[:, :-1] for b in _val_rows(model, cfg, data, tokenizer, cfg.lm_batch))
    r = activation_outliers(model, rows, max_batches=cfg.outlier_batches)
    flat = {}
    for kind in ("attention_logits", "hidden_states"):
        for k, v in r[kind].items():
            if k.startswith("top") or k == "median":
                flat[f"{kind}_{k}"] = v
    flat["tokens"] = r["tokens"]
    return flat
