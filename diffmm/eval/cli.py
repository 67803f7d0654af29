"""``diffmm eval <task>``: zero-shot, retrieval, linear probe, language tasks, lm-eval and pictures.

Every task prints a markdown table, and writes JSON (``--out``) and markdown (``--md``) when asked.
Run ``diffmm eval <task> --help`` for the options of a task.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Callable

from diffmm.data.system_data import PYTHON_DOCS
from diffmm.eval.common import EvalError, write_json, write_text


# ----------------------------------------------------------------------------------- shared options
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, auto (default)")
    p.add_argument("--precision", default="auto", help="auto (AMP on CUDA), amp, bf16, fp16, fp32")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


MODEL_HELP = ("a diffmm config name (diffmm.list_models()), open_clip:NAME, local-dir:FOLDER, or a path to weights: "
              "a Lightning .ckpt from diffmm fit, an export folder, an open_clip / official DiffCLIP checkpoint")
TEMPLATES_HELP = ("prompt templates: a built-in list (openai, simple, plain), a .txt/.json file, or a template with {} "
                  "such as 'a photo of a {}.'; repeat the option for several")


def add_clip_options(p: argparse.ArgumentParser) -> None:
    """The model options every CLIP task shares (``diffmm eval``, ``diffmm classify``)."""
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--pretrained", help="weights for a config name or open_clip:NAME (any format diffmm loads); "
                                        "without it such a model has random weights (a warning says so)")
    p.add_argument("--trust-pickle", action="store_true", help="allow pickled checkpoints (official DiffCLIP)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-batches", type=int, help="stop early (smoke runs)")
    p.add_argument("--seed", type=int, default=0, help="torch seed before building the model (random-init runs)")


def _lm_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lm", required=True, help="LM folder (diffmm export or DiffLlama), or config:NAME for "
                                               "random weights of a named LMConfig")
    p.add_argument("--tokenizer", help="clip or a tokenizer.json (default: the LM folder's, else clip)")
    p.add_argument("--seed", type=int, default=0)


def load_clip_from_args(a):
    """``(model, preprocess, tokenizer)`` of the parsed :func:`add_clip_options` (seeded before building)."""
    import torch

    from diffmm.eval.loading import load_clip

    torch.manual_seed(a.seed)
    return load_clip(a.model, a.pretrained, device=a.device, trust_pickle=a.trust_pickle)


def _load_lm(a):
    import torch

    from diffmm.eval.common import resolve_device

    if a.lm.startswith("config:"):
        from diffmm.data.tokenizers import load_lm_tokenizer
        from diffmm.models.lm import DiffLM, LMConfig

        tok = load_lm_tokenizer(a.tokenizer or "clip")
        torch.manual_seed(a.seed)
        try:
            model = DiffLM(LMConfig.from_name(a.lm[len("config:"):], vocab_size=tok.vocab_size))
        except ValueError as e:
            raise EvalError(str(e)) from None
        return model.to(resolve_device(a.device)).eval(), tok
    from diffmm.eval.loading import load_lm

    return load_lm(a.lm, a.tokenizer, device=a.device)


def _finish(a, result: dict, markdown: str) -> int:
    written = []  # files first: a closed stdout (`| head`) must not lose the results
    if a.out:
        written.append(write_json(a.out, result))
    if a.md:
        written.append(write_text(a.md, markdown))
    print(markdown)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _source(a, spec: str, preprocess, classnames=None, split: str = "test"):
    from diffmm.eval.image_sources import open_image_source

    return open_image_source(spec, preprocess, classnames=classnames, label_field=a.label_field, split=split,
                             batch_size=a.batch_size, num_workers=a.workers)


# ------------------------------------------------------------------------------------------- tasks
def cmd_zeroshot(a) -> int:
    from diffmm.eval.classnames import get_classnames, get_templates
    from diffmm.eval.zeroshot import zero_shot

    model, preprocess, tokenizer = load_clip_from_args(a)
    names = get_classnames(a.classnames) if a.classnames else None
    templates = get_templates(a.templates or ["simple"])
    source = _source(a, a.data, preprocess, names, a.split)
    names = names or source.classnames
    if names is None:
        raise EvalError(f"{a.data}: give --classnames (a built-in list such as fashion-mnist or imagenet, or a file)")
    res = zero_shot(model, tokenizer, source, names, templates, precision=a.precision,
                    show_progress=not a.no_progress, max_batches=a.max_batches)
    out = {"task": "zeroshot", "model": a.model, "pretrained": a.pretrained, "data": a.data, **res.to_dict()}
    return _finish(a, out, res.to_markdown(f"Zero-shot: {a.model} on {a.data}"))


def cmd_retrieval(a) -> int:
    from diffmm.eval.retrieval import retrieval_markdown, retrieval_on_shards

    model, preprocess, tokenizer = load_clip_from_args(a)
    res = retrieval_on_shards(model, tokenizer, a.data, preprocess, caption_field=a.caption_field,
                              batch_size=a.batch_size, num_workers=a.workers, precision=a.precision,
                              show_progress=not a.no_progress, max_batches=a.max_batches)
    return _finish(a, {"task": "retrieval", "model": a.model, "data": a.data, **res},
                   retrieval_markdown({a.model: res}))


def cmd_linear_probe(a) -> int:
    from diffmm.eval.linear_probe import extract_features, linear_probe, linear_probe_markdown

    from diffmm.eval.image_sources import IdxSource

    model, preprocess, _ = load_clip_from_args(a)
    if a.test is None and not isinstance(_source(a, a.train, preprocess, split="test"), IdxSource):
        raise EvalError(f"give --test; only an IDX folder ({a.train}) holds both splits")
    feats = {}
    for name, spec, split in (("train", a.train, "train"), ("test", a.test or a.train, "test"),
                              ("val", a.val, "train")):
        if spec:
            feats[name] = extract_features(model, _source(a, spec, preprocess, split=split), precision=a.precision,
                                           show_progress=not a.no_progress, desc=f"{name} features",
                                           max_batches=a.max_batches)
    val = feats.get("val", (None, None))
    res = linear_probe(*feats["train"], *feats["test"], val_x=val[0], val_y=val[1], max_iter=a.max_iter,
                       show_progress=not a.no_progress)
    return _finish(a, {"task": "linear_probe", "model": a.model, "train": a.train, "test": a.test, **res},
                   linear_probe_markdown({a.model: res}))


def cmd_perplexity(a) -> int:
    from diffmm.eval.perplexity import perplexity_markdown, perplexity_on_shards

    model, tok = _load_lm(a)
    res = perplexity_on_shards(model, a.data, tok, a.seq_len, batch_size=a.batch_size, num_workers=a.workers,
                               precision=a.precision, max_batches=a.max_batches, show_progress=not a.no_progress)
    return _finish(a, {"task": "perplexity", "lm": a.lm, **res}, perplexity_markdown({a.lm: res}))


def cmd_needle(a) -> int:
    from diffmm.eval.needle import NeedleConfig, load_haystack, needle_sweep

    model, tok = _load_lm(a)
    hay = load_haystack(a.haystack, max_chars=a.haystack_chars)
    base = NeedleConfig(num_needles=a.needles, num_queried=a.queried, depths=tuple(a.depths), trials=a.trials,
                        seed=a.seed, max_new_tokens=a.max_new_tokens)
    res = needle_sweep(model, tok, hay, a.context_length, base, measure_attention=a.attention,
                       show_progress=not a.no_progress)
    md = "\n".join(r.to_markdown(f"{a.lm} @ {L}") for L, r in res.items())
    if a.plot:
        from diffmm.eval.plots import needle_plot_input, plot_needle_attention

        plot_needle_attention({f"{a.lm} @ {L}": needle_plot_input(r) for L, r in res.items()}, a.plot)
        print(f"wrote {a.plot}", file=sys.stderr)
    return _finish(a, {"task": "needle", "lm": a.lm, "runs": {str(L): r.to_dict() for L, r in res.items()}}, md)


def cmd_recall(a) -> int:
    from diffmm.eval.recall import evaluate_recall, load_recall_lm, plot_recall, tasks_from_grid

    model = load_recall_lm(a.lm, vocab_size=a.vocab, block_size=max(a.seq_len), device=a.device, seed=a.seed,
                           trust_pickle=a.trust_pickle)
    vocab = a.vocab or getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise EvalError(f"{a.lm}: the model has no config.vocab_size; give --vocab")
    tasks = tasks_from_grid(vocab, a.seq_len, a.pairs, noise=a.noise, num_queries=a.queries,
                            query_power=a.query_power)
    res = evaluate_recall(model, tasks, examples=a.examples, batch_size=a.batch_size, seed=a.seed,
                          measure_attention=not a.no_attention, attention_examples=a.attention_examples,
                          show_progress=not a.no_progress)
    if a.plot:
        plot_recall({a.label or a.lm: res.to_dict()}, a.plot)
        print(f"wrote {a.plot}", file=sys.stderr)
    return _finish(a, {"task": "recall", "lm": a.lm, **res.to_dict()}, res.to_markdown(a.label or a.lm))


def cmd_outliers(a) -> int:
    from diffmm.data.stream import ShardLoader
    from diffmm.data.text import TextDataset
    from diffmm.eval.outliers import activation_outliers, outliers_markdown

    model, tok = _load_lm(a)
    ds = TextDataset(a.data, a.batch_size, a.seq_len, tokenizer=tok, train=False, shuffle=False, equalize=False)
    res = activation_outliers(model, (b[:, :-1] for b in ShardLoader(ds, num_workers=a.workers)),
                              max_batches=a.max_batches, show_progress=not a.no_progress)
    return _finish(a, {"task": "outliers", "lm": a.lm, **res}, outliers_markdown({a.lm: res}))


def cmd_icl(a) -> int:
    import random

    from diffmm.eval.icl import ICLConfig, icl_order_robustness, load_jsonl_examples

    model, tok = _load_lm(a)
    train = load_jsonl_examples(a.train, a.text_key, a.label_key)
    if a.test:
        test = load_jsonl_examples(a.test, a.text_key, a.label_key)
    else:  # hold out part of the one file
        rng = random.Random(a.seed)
        items = list(train)
        rng.shuffle(items)
        n = max(1, int(len(items) * a.test_fraction))
        test, train = items[:n], items[n:]
    cfg = ICLConfig(shots=a.shots, orders=a.orders, arrangement=a.arrangement, seed=a.seed)
    res = icl_order_robustness(model, tok, train, test[:a.max_test] if a.max_test else test, cfg,
                               show_progress=not a.no_progress)
    return _finish(a, {"task": "icl", "lm": a.lm, **res.to_dict()}, res.to_markdown(a.lm))


def cmd_lm_eval(a) -> int:
    from diffmm.eval.harness import DiffmmLM, run_lm_eval

    model, tok = _load_lm(a)
    res = run_lm_eval(DiffmmLM(model, tok, batch_size=a.batch_size), a.tasks.split(","),
                      include_path=a.include_path, num_fewshot=a.num_fewshot, limit=a.limit,
                      include_defaults=True if a.with_default_tasks else None)
    from diffmm.eval.common import markdown_table

    rows = [[task, metric.split(",")[0], value] for task, metrics in res["results"].items()
            for metric, value in metrics.items() if isinstance(value, (int, float)) and "stderr" not in metric
            and not metric.startswith("sample_len")]
    return _finish(a, {"task": "lm_eval", "lm": a.lm, **res},
                   markdown_table(["task", "metric", "value"], rows, floatfmt=".4f"))


def cmd_plot_attention(a) -> int:
    from PIL import Image

    from diffmm.eval.loading import load_clip
    from diffmm.eval.plots import cls_attention, plot_attention_maps

    img = Image.open(a.image)
    img.load()
    entries, shown = {}, None
    pretrained = a.pretrained or []
    labels = a.label or []
    for i, name in enumerate(a.model):
        pre = pretrained[i] if i < len(pretrained) and pretrained[i] not in ("", "none") else None
        model, preprocess, _ = load_clip(name, pre, device=a.device, trust_pickle=a.trust_pickle)
        x = preprocess(img)
        shown = x if shown is None else shown
        label = labels[i] if i < len(labels) else name
        entries[label] = cls_attention(model, x, layer=a.layer)
    plot_attention_maps(shown, entries, a.out, max_heads=a.max_heads)
    print(f"wrote {a.out}")
    return 0


def cmd_plot_needle(a) -> int:
    from diffmm.eval.plots import plot_needle_attention

    results = {}
    for spec in a.result:
        label, _, path = spec.rpartition("=")
        with open(path) as f:
            data = json.load(f)
        for L, r in data.get("runs", {"": data}).items():
            key = f"{label or path}{' @ ' + L if L else ''}"
            results[key] = {"attention": {float(k): v for k, v in r.get("attention_by_depth", {}).items()},
                            "accuracy": {float(k): v for k, v in r.get("accuracy_by_depth", {}).items()}}
    plot_needle_attention(results, a.out)
    print(f"wrote {a.out}")
    return 0


def cmd_plot_loss(a) -> int:
    from diffmm.eval.plots import plot_loss_curves

    runs = {}
    for spec in a.run:
        label, _, path = spec.rpartition("=")
        runs[label or path] = path
    plot_loss_curves(runs, a.out, metrics=a.metrics.split(",") if a.metrics else None, log_y=a.log_y)
    print(f"wrote {a.out}")
    return 0


# ------------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="diffmm eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="task", required=True, metavar="TASK")

    def add(name: str, fn: Callable, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        return p

    p = add("zeroshot", cmd_zeroshot, "zero-shot image classification (top-1/5, per class, confusion matrix)")
    add_clip_options(p)
    p.add_argument("--data", required=True, help="labelled images: a folder ROOT/<class>/img, idx:FOLDER / a folder of "
                                                 "IDX files, or shards 'dir/x-{000000..000009}.tar' (unlabelled "
                                                 "images: diffmm classify)")
    p.add_argument("--split", default="test", help="IDX split: train or test")
    p.add_argument("--label-field", default="cls", help="shards: cls or json:NAME")
    p.add_argument("--classnames", help="imagenet, fashion-mnist, or a .txt/.json file (FILE.json:KEY)")
    p.add_argument("--templates", action="append", help=TEMPLATES_HELP + " (default: simple)")
    _common(p)

    p = add("retrieval", cmd_retrieval, "image<->text recall@1/5/10 on image-text shards")
    add_clip_options(p)
    p.add_argument("--data", required=True, help="image-text shards")
    p.add_argument("--caption-field", default="txt", help="txt (one caption a line) or json:NAME (str or list)")
    _common(p)

    p = add("linear-probe", cmd_linear_probe, "logistic regression on frozen image features (C sweep)")
    add_clip_options(p)
    p.add_argument("--train", required=True, help="labelled images (as zeroshot --data); IDX uses the train split")
    p.add_argument("--test", help="labelled test images (IDX folder: the test split; default: --train's folder)")
    p.add_argument("--val", help="validation images (default: 20%% of --train, stratified)")
    p.add_argument("--label-field", default="cls")
    p.add_argument("--max-iter", type=int, default=1000)
    _common(p)

    p = add("perplexity", cmd_perplexity, "LM perplexity on text shards")
    _lm_opts(p)
    p.add_argument("--data", required=True, help="text shards (KEY.txt documents)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--max-batches", type=int)
    _common(p)

    p = add("needle", cmd_needle, "multi-needle retrieval (N needles, R queried, depth sweep)")
    _lm_opts(p)
    p.add_argument("--haystack", nargs="+", default=[PYTHON_DOCS], help=f"text files/folders (default {PYTHON_DOCS})")
    p.add_argument("--haystack-chars", type=int, default=2_000_000)
    p.add_argument("--context-length", type=int, nargs="+", default=[4096])
    p.add_argument("--needles", type=int, default=6, help="N")
    p.add_argument("--queried", type=int, default=2, help="R")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--attention", action="store_true", help="also measure the attention share on the needle")
    p.add_argument("--plot", help="PNG of accuracy (and attention) per depth")
    _common(p)

    p = add("recall", cmd_recall, "associative recall (MQAR): accuracy per sequence length / pairs, attention shares")
    p.add_argument("--lm", required=True, help="Lightning .ckpt (diffmm fit --config configs/recall_*.yaml), LM "
                                               "folder, or config:NAME for random weights")
    p.add_argument("--vocab", type=int, help="task vocabulary (default: the model's vocab_size)")
    p.add_argument("--seq-len", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--pairs", type=int, nargs="+", default=[4, 8, 16, 32], help="key-value pairs per sequence")
    p.add_argument("--queries", type=int, help="queries per sequence (default: every pair)")
    p.add_argument("--noise", type=float, default=1.0, help="probability of a random key/value filler token")
    p.add_argument("--query-power", type=float, default=0.01, help="query offset law p(i) ~ i^(a-1); 1 = uniform")
    p.add_argument("--examples", type=int, default=256, help="sequences per setting")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--attention-examples", type=int, default=64, help="sequences per setting for attention shares")
    p.add_argument("--no-attention", action="store_true", help="skip the attention shares")
    p.add_argument("--seed", type=int, default=0, help="evaluation-set seed (and random-weight seed)")
    p.add_argument("--label", help="model name in the table and plot")
    p.add_argument("--plot", help="PNG: accuracy per setting and attention shares")
    p.add_argument("--trust-pickle", action="store_true")
    _common(p)

    p = add("outliers", cmd_outliers, "top-1/10/median attention logits and hidden states (DIFF paper Table 5)")
    _lm_opts(p)
    p.add_argument("--data", required=True, help="text shards")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--max-batches", type=int, default=8)
    _common(p)

    p = add("icl", cmd_icl, "in-context-learning accuracy spread over demonstration orders")
    _lm_opts(p)
    p.add_argument("--train", required=True, help="jsonl with text and label (demonstration pool)")
    p.add_argument("--test", help="jsonl test set (default: --test-fraction of --train)")
    p.add_argument("--test-fraction", type=float, default=0.3)
    p.add_argument("--max-test", type=int, help="use at most this many test examples")
    p.add_argument("--text-key", default="text")
    p.add_argument("--label-key", default="label")
    p.add_argument("--shots", type=int, default=8)
    p.add_argument("--orders", type=int, default=10)
    p.add_argument("--arrangement", default="random", choices=["random", "grouped"])
    _common(p)

    p = add("lm-eval", cmd_lm_eval, "run lm-evaluation-harness 0.4.x tasks on a diffmm LM")
    _lm_opts(p)
    p.add_argument("--tasks", required=True, help="comma-separated task names")
    p.add_argument("--include-path", help="folder of task YAML files (local tasks)")
    p.add_argument("--with-default-tasks", action="store_true", help="also index lm-eval's own tasks")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--limit", type=float, help="examples per task (or a fraction < 1)")
    p.add_argument("--batch-size", type=int, default=8)
    _common(p)

    p = add("plot-attention", cmd_plot_attention, "CLS attention maps of CLIP/DiffCLIP models on one image (PNG)")
    p.add_argument("--model", action="append", required=True, help="repeat for each model")
    p.add_argument("--pretrained", action="append", help="one per --model ('none' for random weights)")
    p.add_argument("--label", action="append", help="one per --model")
    p.add_argument("--image", required=True)
    p.add_argument("--layer", type=int, default=-1, help="vision attention layer (python index)")
    p.add_argument("--max-heads", type=int, default=8)
    p.add_argument("--trust-pickle", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True, help="PNG path")

    p = add("plot-needle", cmd_plot_needle, "needle accuracy / attention share per depth from needle JSON results")
    p.add_argument("--result", action="append", required=True, help="LABEL=needle.json (repeat)")
    p.add_argument("--out", required=True)

    p = add("plot-loss", cmd_plot_loss, "loss curves from Lightning CSVLogger metrics.csv files")
    p.add_argument("--run", action="append", required=True, help="LABEL=path/to/metrics.csv or its folder (repeat)")
    p.add_argument("--metrics", help="comma-separated columns (default: every column with 'loss')")
    p.add_argument("--log-y", action="store_true")
    p.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args) or 0)
    except (EvalError, FileNotFoundError) as e:
        print(f"diffmm eval {args.task}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
