"""Evaluation: zero-shot classification (``classify`` for unlabelled images), retrieval, linear probe, language
tasks, associative recall, the lm-eval adapter (:mod:`diffmm.eval.harness`, optional), pictures.

The task functions behind ``diffmm eval <task>`` are in :mod:`diffmm.eval.commands`. See ``docs/evaluation.md``.
"""
from diffmm.eval.attention_capture import AttentionRecorder
from diffmm.eval.classify import Predictions, classify_images
from diffmm.eval.classnames import get_classnames, get_templates
from diffmm.eval.common import EvalError
from diffmm.eval.icl import ICLConfig, icl_order_robustness
from diffmm.eval.image_sources import (IdxSource, ImageFolderSource, ShardLabelSource, expand_image_inputs,
                                       open_image_source)
from diffmm.eval.linear_probe import extract_features
from diffmm.eval.loading import load_clip, load_lm
from diffmm.eval.needle import NeedleConfig, answer_attention, load_haystack, multi_needle
from diffmm.eval.outliers import activation_outliers
from diffmm.eval.perplexity import evaluate_perplexity, perplexity_on_shards
from diffmm.eval.plots import cls_attention, plot_attention_maps, plot_loss_curves, plot_needle_attention
from diffmm.eval.recall import evaluate_recall, plot_recall
from diffmm.eval.retrieval import evaluate_retrieval, recall_at_k, retrieval_on_shards
from diffmm.eval.zeroshot import ZeroShotResult, build_zero_shot_classifier, evaluate_zero_shot, zero_shot

__all__ = ["AttentionRecorder", "EvalError", "ICLConfig", "IdxSource", "ImageFolderSource", "NeedleConfig",
           "Predictions", "ShardLabelSource", "ZeroShotResult", "activation_outliers", "answer_attention",
           "build_zero_shot_classifier", "classify_images", "cls_attention", "evaluate_perplexity",
           "evaluate_recall", "evaluate_retrieval", "evaluate_zero_shot", "expand_image_inputs", "extract_features",
           "get_classnames", "get_templates", "icl_order_robustness", "load_clip", "load_haystack",
           "load_lm", "multi_needle", "open_image_source", "perplexity_on_shards", "plot_attention_maps",
           "plot_loss_curves", "plot_needle_attention", "plot_recall", "recall_at_k", "retrieval_on_shards",
           "zero_shot"]
