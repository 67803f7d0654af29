"""Evaluation: zero-shot classification (``classify`` for unlabelled images), retrieval, linear probe, language
tasks, lm-eval adapter, pictures.

Names are imported lazily, so ``import diffmm.eval`` stays light. See ``docs/evaluation.md``.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "build_zero_shot_classifier": "zeroshot", "evaluate_zero_shot": "zeroshot", "zero_shot": "zeroshot",
    "ZeroShotResult": "zeroshot", "get_classnames": "classnames", "get_templates": "classnames",
    "ImageFolderSource": "image_sources", "IdxSource": "image_sources", "ShardLabelSource": "image_sources",
    "open_image_source": "image_sources", "evaluate_retrieval": "retrieval", "retrieval_on_shards": "retrieval",
    "recall_at_k": "retrieval", "extract_features": "linear_probe", "linear_probe": "linear_probe",
    "evaluate_perplexity": "perplexity", "perplexity_on_shards": "perplexity", "NeedleConfig": "needle",
    "multi_needle": "needle", "answer_attention": "needle", "load_haystack": "needle",
    "activation_outliers": "outliers", "ICLConfig": "icl", "icl_order_robustness": "icl",
    "AttentionRecorder": "attention_capture", "DiffmmLM": "harness", "run_lm_eval": "harness",
    "cls_attention": "plots", "plot_attention_maps": "plots", "plot_needle_attention": "plots",
    "plot_loss_curves": "plots", "load_clip": "loading", "load_lm": "loading", "EvalError": "common",
    "classify_images": "classify", "Predictions": "classify", "ImageListSource": "image_sources",
    "expand_image_inputs": "image_sources",
    "evaluate_recall": "recall", "plot_recall": "recall",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"diffmm.eval.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'diffmm.eval' has no attribute {name!r}")
