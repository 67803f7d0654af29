"""What the demo runs: one flat config, with the ``full`` and ``quick`` presets.

Budgets were chosen by measuring single-thread CPU time per training step on the 2-core
development machine (see ``docs/results.md``): tiny CLIP ~0.48 s, tiny DiffCLIP ~0.60 s per
batch of 64 at 64 px; the 4-layer, 128-wide LMs ~0.45 s per 16 x 128 tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

#: the parts of the demo
PARTS = ("clip", "lm", "recall")


@dataclass
class DemoConfig:
    """Flat settings of a demo run (``diffmm demo --help`` lists the ones exposed on the command line).

    Attributes:
        out: report folder (``report.md``, ``results.json``, plots, ``runs/`` with the training logs).
        data: demo data folder (built by the :mod:`diffmm.demo.datasets` builders when missing).
        parts: which parts run: ``clip`` (CLIP vs DiffCLIP), ``lm`` (DIFF vs Transformer LM), ``recall``
            (associative recall: Transformer vs DIFF V1 vs DIFF V2 at equal parameters).
        seeds: one training run per model per seed; both models of a pair share seed, data order and budget.
        threads: torch CPU threads; 0 = all cores, or 1 when the machine is already busy (load >= cores).
        num_workers: DataLoader workers of the training streams.
        clip_models: (baseline, differential) model configs of ``diffmm.create_model``.
        clip_model_kwargs: config overrides applied to both CLIP models (tests shrink them).
        train_styles, holdout_style: emoji art styles trained on / held out for zero-shot and retrieval.
        clip_steps, clip_batch, clip_lr, clip_min_lr, clip_warmup, clip_weight_decay: the CLIP training budget.
        zs_batch: evaluation batch size.
        fmnist_images: Fashion-MNIST test images for zero-shot (None = all 10,000).
        holdout_images: held-out emoji images for zero-shot and retrieval (None = all).
        attention_images: held-out images whose CLS attention maps are drawn.
        lm_models: (baseline, differential) LM presets of ``LMConfig.from_name``.
        lm_model_kwargs: ``LMConfig`` overrides applied to both LMs.
        lm_steps, lm_batch, lm_lr, lm_min_lr, lm_warmup, lm_weight_decay: the LM training budget.
        lm_val_batches: validation batches (None = the whole validation split).
        needle_context, needle_needles, needle_queried, needle_depths, needle_trials, needle_digits:
            multi-needle retrieval settings (``diffmm.eval.NeedleConfig``).
        outlier_batches: validation batches for the activation-outlier statistics.
        log_every: training log interval (steps) of the CSV logs behind the loss curves.
        recall_variants, recall_width, recall_heads, recall_layers, recall_vocab, recall_train_seq_lens,
            recall_train_pairs, recall_eval_seq_lens, recall_eval_pairs, recall_noise, recall_steps,
            recall_batch_tokens, recall_lr, recall_examples: the recall section
            (``diffmm.demo.recall.RecallStudy``; the seeds are ``seeds``).
    """

    out: str = "report"
    data: str = "data"
    parts: tuple[str, ...] = PARTS
    seeds: tuple[int, ...] = (0, 1, 2)
    threads: int = 0
    num_workers: int = 1
    # CLIP vs DiffCLIP
    clip_models: tuple[str, str] = ("CLIP-Tiny", "DiffCLIP-Tiny")
    clip_model_kwargs: dict[str, Any] = field(default_factory=dict)
    train_styles: tuple[str, ...] = ("noto", "google", "openmoji")
    holdout_style: str = "twitter"
    clip_steps: int = 200
    clip_batch: int = 64
    clip_lr: float = 1e-3
    clip_min_lr: float = 1e-5
    clip_warmup: int = 20
    clip_weight_decay: float = 0.1
    zs_batch: int = 128
    fmnist_images: Optional[int] = 2000
    holdout_images: Optional[int] = None
    attention_images: int = 4
    # DIFF vs Transformer LM
    lm_models: tuple[str, str] = ("transformer-tiny", "diff-tiny")
    lm_model_kwargs: dict[str, Any] = field(default_factory=lambda: dict(n_layer=4, n_embd=128, n_head=4,
                                                                          block_size=128))
    lm_steps: int = 200
    lm_batch: int = 16
    lm_lr: float = 3e-3
    lm_min_lr: float = 3e-4
    lm_warmup: int = 20
    lm_weight_decay: float = 0.05
    lm_val_batches: Optional[int] = None
    needle_context: int = 128
    needle_needles: int = 2
    needle_queried: int = 1
    needle_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    needle_trials: int = 4
    needle_digits: int = 4
    outlier_batches: int = 8
    log_every: int = 5
    # associative recall (MQAR): Transformer vs DIFF V1 vs DIFF V2, parameter-matched
    recall_variants: tuple[str, ...] = ("standard", "diff", "diff_v2")
    recall_width: int = 64
    recall_heads: int = 4
    recall_layers: int = 2
    recall_vocab: int = 64
    recall_train_seq_lens: tuple[int, ...] = (16,)
    recall_train_pairs: tuple[int, ...] = (2, 4)
    recall_eval_seq_lens: tuple[int, ...] = (16, 64)
    recall_eval_pairs: tuple[int, ...] = (2, 4)
    recall_noise: float = 0.25
    recall_steps: int = 150
    recall_batch_tokens: int = 2048
    recall_lr: float = 3e-3
    recall_examples: int = 128

    def __post_init__(self) -> None:
        bad = [p for p in self.parts if p not in PARTS]
        if bad or not self.parts:
            raise ValueError(f"demo parts {list(self.parts)}: expected a non-empty subset of {list(PARTS)}")
        if not self.seeds:
            raise ValueError("demo: give at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"demo: seeds repeat: {list(self.seeds)}")
        for name in ("clip_steps", "clip_batch", "lm_steps", "lm_batch", "zs_batch", "log_every", "recall_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"demo: {name} must be >= 1, got {getattr(self, name)}")
        if self.holdout_style in self.train_styles:
            raise ValueError(f"demo: the held-out style {self.holdout_style!r} is also a training style")

    def replace(self, **changes: Any) -> "DemoConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: the 30-minute run (3 seeds).
FULL = DemoConfig()

#: the 5-minute run: one seed, fewer steps, smaller evaluation sets.
QUICK = DemoConfig(seeds=(0,), clip_steps=60, lm_steps=60, clip_warmup=6, lm_warmup=6, fmnist_images=512,
                   holdout_images=512, attention_images=2, lm_val_batches=16, needle_trials=2, outlier_batches=2,
                   recall_steps=80, recall_examples=64)

PRESETS = {"full": FULL, "quick": QUICK}
