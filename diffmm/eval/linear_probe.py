"""Linear probe on frozen image features: L2-regularised logistic regression with a sweep of the regularisation.

Protocol (as CLIP's and El Banani et al. 2023's, which DiffCLIP's Table 1 follows): extract
features of the train and test sets with the frozen image tower; hold out part of the train set
(or use a given validation set); sweep the inverse regularisation C on a log grid (coarse, then a
finer grid around the best); refit on train + validation with the best C; report test top-1 and
mean per-class accuracy. Solver: scikit-learn's L-BFGS logistic regression; the sweep runs from strong
to weak regularisation, warm-starting each fit from the previous one (the problem is convex, so only
fits stopped by ``max_iter`` can differ from cold starts).
"""
from __future__ import annotations

import itertools
import time
import warnings
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from diffmm.eval.common import EvalError, markdown_table
from diffmm.eval.zeroshot import encode_images


@torch.no_grad()
def extract_features(model, source: Iterable, *, precision: str = "auto", show_progress: bool = True,
                     desc: str = "features", max_batches: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """L2-normalised image features (N, D) float32 and labels (N,) of a labelled image source (first
    ``max_batches`` batches)."""
    feats, labels = [], []
    bar = tqdm(total=getattr(source, "num_samples", None), desc=desc, disable=not show_progress, unit="img")
    for images, y in itertools.islice(source, max_batches):
        feats.append(encode_images(model, images, precision=precision).cpu().numpy().astype(np.float32))
        labels.append(y.numpy())
        bar.update(len(y))
    bar.close()
    if not feats:
        raise EvalError("linear probe: the image source gave no images")
    return np.concatenate(feats), np.concatenate(labels)


def _fit(X, y, C: float, max_iter: int, seed: int, clf=None):
    """Fit an L-BFGS logistic regression; with ``clf`` (same data), warm-start from its solution."""
    try:  # scikit-learn is optional (the diffmm 'eval' extra)
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        raise EvalError("the linear probe needs scikit-learn: pip install scikit-learn (or the diffmm 'eval' "
                        "extra)") from None
    if clf is None:
        clf = LogisticRegression(C=C, max_iter=max_iter, random_state=seed, warm_start=True)
    clf.set_params(C=C)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(X, y)
    return clf


def _accuracy(clf, X, y) -> tuple[float, float]:
    pred = clf.predict(X)
    acc = float((pred == y).mean())
    per = [float((pred[y == c] == c).mean()) for c in np.unique(y)]
    return acc, float(np.mean(per))


def linear_probe(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, *,
                 val_x: Optional[np.ndarray] = None, val_y: Optional[np.ndarray] = None, val_fraction: float = 0.2,
                 coarse: Sequence[float] = tuple(10.0 ** np.arange(-6, 7)), refine: int = 7, max_iter: int = 1000,
                 seed: int = 0, show_progress: bool = False) -> dict:
    """Sweep C on validation accuracy, refit on train + validation, score the test set.

    Args:
        val_x, val_y: a validation set; default: a stratified ``val_fraction`` of the train set.
        coarse: first grid of C values.
        refine: points of the second grid, log-spaced over one decade each side of the best coarse C (0: none).
    """
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):
        raise EvalError("linear probe: features and labels differ in length")
    if len(np.unique(train_y)) < 2:
        raise EvalError("linear probe: the train set needs at least two classes")
    t0 = time.perf_counter()
    if val_x is None:
        rng = np.random.default_rng(seed)
        val_idx = []
        for c in np.unique(train_y):  # stratified hold-out
            idx = np.flatnonzero(train_y == c)
            rng.shuffle(idx)
            val_idx += list(idx[:max(1, int(round(val_fraction * len(idx))))] if len(idx) > 1 else [])
        mask = np.zeros(len(train_y), bool)
        mask[val_idx] = True
        fit_x, fit_y, val_x, val_y = train_x[~mask], train_y[~mask], train_x[mask], train_y[mask]
        all_x, all_y = train_x, train_y
    else:
        fit_x, fit_y = train_x, train_y
        all_x, all_y = np.concatenate([train_x, val_x]), np.concatenate([train_y, val_y])
    sweep: dict[float, float] = {}

    def run(grid):
        clf = None  # ascending C, each fit warm-started from the previous solution (same result, fewer iterations)
        for C in tqdm(sorted(float(c) for c in grid), desc="C sweep", disable=not show_progress):
            clf = _fit(fit_x, fit_y, C, max_iter, seed, clf)
            if C not in sweep:
                sweep[C] = _accuracy(clf, val_x, val_y)[0]

    run(coarse)
    best = max(sweep, key=lambda c: (sweep[c], -c))  # ties: the stronger regularisation
    if refine:
        run(best * 10.0 ** np.linspace(-1, 1, refine))
        best = max(sweep, key=lambda c: (sweep[c], -c))
    clf = _fit(all_x, all_y, best, max_iter, seed)
    top1, mean_per_class = _accuracy(clf, test_x, test_y)
    return {"top1": top1, "mean_per_class_accuracy": mean_per_class, "best_C": best, "val_accuracy": sweep[best],
            "sweep": {f"{c:.4g}": a for c, a in sorted(sweep.items())}, "train": int(len(all_y)),
            "test": int(len(test_y)), "dim": int(train_x.shape[1]), "seconds": time.perf_counter() - t0}


def linear_probe_markdown(results: dict[str, dict]) -> str:
    """One row per (model or dataset): test top-1, mean per-class accuracy, chosen C."""
    return markdown_table(["model", "top-1 (%)", "mean per-class (%)", "best C", "train", "test"],
                          [[n, 100 * r["top1"], 100 * r["mean_per_class_accuracy"], f"{r['best_C']:.3g}",
                            r["train"], r["test"]] for n, r in results.items()])
