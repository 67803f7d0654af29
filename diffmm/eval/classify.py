"""``diffmm classify``: zero-shot labels for your own images, one row per image.

    diffmm classify --model runs/upcycle-tiny-emoji/checkpoints/last.ckpt --labels "cat,dog,bird" \\
        --templates "a photo of a {}." --top-k 3 --out preds.csv photos/ extra/*.jpg

The model resolution is ``diffmm eval``'s (:func:`diffmm.eval.loading.load_clip`): a config name with
``--pretrained``, ``open_clip:NAME``, an export folder, a Lightning ``.ckpt``, ... The classifier is the zero-shot
one of :func:`diffmm.eval.zeroshot.build_zero_shot_classifier` (prompt ensembling over the templates);
probabilities are ``softmax(logit_scale * cosine)`` over the given labels, with the model's own (clamped) logit
scale. Images are files, folders (searched recursively) or glob patterns; unreadable images are skipped, counted
and reported. ``--out`` writes ``.csv`` (``path, label_1, prob_1, ..., label_k, prob_k``) or ``.json``.
"""
from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from diffmm.eval.common import EvalError, markdown_table, model_device, progress, write_json

log = logging.getLogger("diffmm.eval")
SHOW_ROWS = 20  # rows printed to the terminal (all of them go to --out)


@dataclass
class Predictions:
    """Top-k labels and probabilities of each readable image (``files[i]`` <-> ``labels[i]``, ``probs[i]``)."""

    classnames: list[str]
    files: list[str] = field(default_factory=list)
    labels: list[list[str]] = field(default_factory=list)
    probs: list[list[float]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def top_k(self) -> int:
        return len(self.labels[0]) if self.labels else 0

    def rows(self) -> list[list]:
        """``[path, label_1, prob_1, ..., label_k, prob_k]`` per image."""
        return [[f, *[x for pair in zip(lab, pr) for x in pair]]
                for f, lab, pr in zip(self.files, self.labels, self.probs)]

    def header(self) -> list[str]:
        return ["path", *[x for i in range(1, self.top_k + 1) for x in (f"label_{i}", f"prob_{i}")]]

    def to_dict(self) -> dict:
        return {"n": len(self.files), "classnames": list(self.classnames), "top_k": self.top_k,
                "predictions": [{"path": f, "labels": lab, "probs": pr}
                                for f, lab, pr in zip(self.files, self.labels, self.probs)],
                "skipped": dict(self.skipped), "seconds": self.seconds}

    def write(self, path: str, meta: Optional[dict] = None) -> str:
        """Write ``.csv`` or ``.json`` (by the suffix; other suffixes are an error)."""
        if path.lower().endswith(".json"):
            return write_json(path, {**(meta or {}), **self.to_dict()})
        if not path.lower().endswith(".csv"):
            raise EvalError(f"--out {path}: expected a .csv or .json file name")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(self.header())
            for row in self.rows():
                w.writerow([f"{v:.6f}" if isinstance(v, float) else v for v in row])
        os.replace(tmp, path)
        return path

    def to_markdown(self, limit: int = SHOW_ROWS) -> str:
        rows = [[os.path.basename(r[0]) if len(r[0]) > 60 else r[0],
                 *[f"{v:.3f}" if isinstance(v, float) else v for v in r[1:]]] for r in self.rows()[:limit]]
        out = markdown_table(self.header(), rows)
        if len(self.files) > limit:
            out += f"\n... {len(self.files) - limit} more rows (all in --out)\n"
        return out


def _logit_scale(model) -> float:
    """The model's clamped ``exp(logit_scale)`` (100 when it has none)."""
    if callable(getattr(model, "logit_scale_value", None)):
        return float(model.logit_scale_value())
    scale = getattr(model, "logit_scale", None)
    return min(float(torch.as_tensor(scale).float().exp()), 100.0) if scale is not None else 100.0


@torch.no_grad()
def classify_images(model, tokenizer, preprocess, files: Sequence[str], classnames: Sequence[str], templates,
                    *, top_k: int = 5, batch_size: int = 64, num_workers: int = 2, precision: str = "auto",
                    show_progress: bool = True, max_batches: Optional[int] = None) -> Predictions:
    """Top-k zero-shot labels of each image in ``files`` (see the module docstring)."""
    from diffmm.eval.image_sources import ImageListSource
    from diffmm.eval.zeroshot import build_zero_shot_classifier, encode_images

    device = model_device(model)
    classifier = build_zero_shot_classifier(model, tokenizer, list(classnames), templates,
                                            precision="fp32" if precision == "auto" and device.type != "cuda"
                                            else precision).to(device)  # (D, C)
    k = max(1, min(top_k, len(classnames)))
    scale = _logit_scale(model)
    source = ImageListSource(files, preprocess, batch_size=batch_size, num_workers=num_workers)
    preds = Predictions(list(classnames))
    bar = progress(None, total=len(source.files), desc="classify", enable=show_progress, unit="img") \
        if show_progress else None
    t0 = time.perf_counter()
    for b, (images, idx) in enumerate(source):
        if max_batches is not None and b >= max_batches:
            break
        feats = encode_images(model, images, precision=precision)  # (B, D) normalised, fp32
        probs = (scale * feats @ classifier).softmax(dim=-1)  # (B, C)
        top = probs.topk(k, dim=-1)
        for i, vals, inds in zip(idx.tolist(), top.values.tolist(), top.indices.tolist()):
            preds.files.append(source.files[i])
            preds.labels.append([classnames[j] for j in inds])
            preds.probs.append([float(v) for v in vals])
        if bar is not None:
            bar.update(len(idx))
    if bar is not None:
        bar.update(sum(source.skipped.values()))
        bar.close()
    preds.skipped = dict(source.skipped)
    preds.seconds = time.perf_counter() - t0
    return preds


def build_parser() -> argparse.ArgumentParser:
    from diffmm.eval.cli import TEMPLATES_HELP, add_clip_options

    p = argparse.ArgumentParser(prog="diffmm classify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("images", nargs="+", metavar="IMAGES_OR_FOLDERS",
                   help="image files, folders (searched recursively) or glob patterns such as 'photos/*.jpg'")
    add_clip_options(p)
    names = p.add_mutually_exclusive_group(required=True)
    names.add_argument("--labels", help="class names, comma-separated: 'cat,dog,red car'")
    names.add_argument("--classnames", help="class names from a built-in list (imagenet, fashion-mnist) or a "
                                            ".txt/.json file (FILE.json:KEY)")
    p.add_argument("--templates", action="append", help=TEMPLATES_HELP + " (default: 'a photo of a {}.')")
    p.add_argument("--top-k", type=int, default=5, help="labels per image (at most the number of labels)")
    p.add_argument("--out", help="write every row here: .csv or .json")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, auto (default)")
    p.add_argument("--precision", default="auto", help="auto (AMP on CUDA), amp, bf16, fp16, fp32")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except (EvalError, FileNotFoundError) as e:
        print(f"diffmm classify: error: {e}", file=sys.stderr)
        return 2


def _run(a) -> int:
    from diffmm.eval.classnames import get_classnames, get_templates, parse_labels
    from diffmm.eval.cli import load_clip_from_args
    from diffmm.eval.image_sources import expand_image_inputs

    if a.top_k < 1:
        raise EvalError(f"--top-k {a.top_k}: expected a positive number")
    if a.out and not a.out.lower().endswith((".csv", ".json")):
        raise EvalError(f"--out {a.out}: expected a .csv or .json file name")
    classnames = parse_labels(a.labels) if a.labels is not None else get_classnames(a.classnames)
    templates = get_templates(a.templates or ["a photo of a {}."])
    files = expand_image_inputs(a.images)  # before loading the model: bad paths fail fast
    model, preprocess, tokenizer = load_clip_from_args(a)
    preds = classify_images(model, tokenizer, preprocess, files, classnames, templates, top_k=a.top_k,
                            batch_size=a.batch_size, num_workers=a.workers, precision=a.precision,
                            show_progress=not a.no_progress, max_batches=a.max_batches)
    n_skipped = sum(preds.skipped.values())
    if n_skipped:
        reasons = ", ".join(f"{v} {k}" for k, v in preds.skipped.items())
        log.warning(f"skipped {n_skipped} of {len(files)} images ({reasons})")
    if a.out:  # before printing: a closed stdout (`| head`) must not lose the rows
        preds.write(a.out, {"task": "classify", "model": a.model, "pretrained": a.pretrained,
                            "templates": [t if isinstance(t, str) else t("{}") for t in templates]})
    print(preds.to_markdown())
    if a.out:
        print(f"wrote {a.out} ({len(preds.files)} rows)", file=sys.stderr)
    if not preds.files:
        raise EvalError(f"none of the {len(files)} images could be read")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
