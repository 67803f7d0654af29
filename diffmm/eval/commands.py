"""The task functions behind ``diffmm eval <task>`` and ``diffmm classify``.

Each loads the model (:mod:`diffmm.eval.loading`, through ``diffmm.hub.factory``), builds its data source, calls
the library function of its module (the same one the demo calls), prints a markdown table and writes the JSON
(``out``) and markdown (``md``) files when asked. ``diffmm.cli`` builds each command's flags and ``--help`` from
the signature and docstring, so a task is run from Python with the same arguments::

    from diffmm.eval.commands import zeroshot
    zeroshot(model="runs/clip/checkpoints/last.ckpt", data="imgs/", templates=["a photo of a {}."], out="zs.json")
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import random
import sys
from typing import Literal, Optional, Sequence

from PIL import Image

from diffmm.data.files import write_json_atomic
from diffmm.data.stream import ShardLoader
from diffmm.data.text import TextDataset
from diffmm.eval.classify import classify_images
from diffmm.eval.classnames import get_classnames, get_templates, parse_labels
from diffmm.eval.clip_benchmark import read_wds_folder, retrieval_record, zeroshot_record
from diffmm.eval.common import EvalError, markdown_table
from diffmm.eval.icl import ICLConfig, icl_order_robustness, load_jsonl_examples
from diffmm.eval.image_sources import IdxSource, expand_image_inputs, open_image_source
from diffmm.eval.linear_probe import extract_features, linear_probe_markdown
from diffmm.eval.linear_probe import linear_probe as fit_linear_probe
from diffmm.eval.loading import lm_tokenizer, load_clip, load_lm
from diffmm.eval.needle import PYTHON_DOCS, NeedleConfig, load_haystack, multi_needle
from diffmm.eval.outliers import activation_outliers, outliers_markdown
from diffmm.eval.perplexity import perplexity_markdown, perplexity_on_shards
from diffmm.eval.plots import cls_attention, plot_attention_maps, plot_loss_curves, plot_needle_attention
from diffmm.eval.recall import evaluate_recall, plot_recall, tasks_from_grid
from diffmm.eval.retrieval import retrieval_markdown, retrieval_on_shards
from diffmm.eval.zeroshot import zero_shot

log = logging.getLogger("diffmm.eval")

#: the options several commands share, documented once: :func:`shared_docs` adds the entries of the ones a command
#: takes to the ``Args:`` of its docstring (which ``--help`` shows)
SHARED_ARGS = {
    "model": "a diffmm config name (diffmm.list_models()), open_clip:NAME, local-dir:FOLDER, or a path to weights: "
             "a Lightning .ckpt from diffmm fit, an export folder, an open_clip / official DiffCLIP checkpoint.",
    "pretrained": "weights for a config name or open_clip:NAME (any format diffmm loads); without them such a "
                  "model has random weights (a warning says so).",
    "lm": "an LM: a Lightning .ckpt from diffmm fit, a diffmm export or DiffLlama folder, or config:NAME for random "
          "weights of a named LMConfig.",
    "tokenizer": "clip or a tokenizer.json (default: the LM folder's tokenizer.json, else clip).",
    "label_field": "the label of a shard sample: cls or json:NAME (a class index, or a class name).",
    "trust_pickle": "allow pickled checkpoints that need full unpickling (official DiffCLIP; files you trust).",
    "batch_size": "samples per batch.",
    "workers": "DataLoader workers.",
    "max_batches": "stop after this many batches (smoke runs).",
    "seed": "torch seed before a model with random weights is built.",
    "device": "cpu, cuda, cuda:1 or auto (cuda when there is one).",
    "precision": "auto (AMP on CUDA, fp32 elsewhere), amp, bf16, fp16 or fp32.",
    "out": "write the result as JSON here.",
    "md": "write the markdown table here.",
    "progress": "show a progress bar.",
    "format": "the JSON written to out: diffmm's own, or clip_benchmark (CLIP_benchmark's schema, to compare rows).",
}


def shared_docs(fn):
    """Add the :data:`SHARED_ARGS` entries of the parameters ``fn`` takes but does not document to the ``Args:``
    section that ends its docstring."""
    missing = [n for n in inspect.signature(fn).parameters if n in SHARED_ARGS and f"\n        {n}:" not in fn.__doc__]
    fn.__doc__ = fn.__doc__.rstrip() + "".join(f"\n        {n}: {SHARED_ARGS[n]}" for n in missing) + "\n    "
    return fn


def report(result: dict, markdown: str, out: Optional[str] = None, md: Optional[str] = None) -> dict:
    """Write ``result`` as JSON to ``out`` and ``markdown`` to ``md`` (files first: a closed stdout such as
    ``| head`` must not lose them), print the markdown and return ``result``."""
    written = [write_json_atomic(out, result)] if out else []
    if md:
        os.makedirs(os.path.dirname(os.path.abspath(md)), exist_ok=True)
        with open(md, "w") as f:
            f.write(markdown)
        written.append(md)
    print(markdown)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return result


# ------------------------------------------------------------------------------------------------ CLIP tasks
@shared_docs
def zeroshot(*, model: str, data: str, pretrained: Optional[str] = None, classnames: Optional[str] = None,
             templates: str | list[str] | None = None, split: str = "test", label_field: str = "cls",
             batch_size: int = 64, workers: int = 2, max_batches: Optional[int] = None, seed: int = 0,
             trust_pickle: bool = False, device: str = "auto", precision: str = "auto", out: Optional[str] = None,
             md: Optional[str] = None, progress: bool = True,
             format: Literal["diffmm", "clip_benchmark"] = "diffmm") -> dict:
    """Zero-shot image classification: top-1/5, per-class accuracy and the confusion matrix.

    Args:
        data: labelled images: ROOT/<class>/<image> folders, an IDX folder (or idx:FOLDER), shards such as
            'dir/x-{000000..000009}.tar', or a CLIP_benchmark wds folder (unlabelled images: diffmm classify).
        classnames: imagenet, fashion-mnist, or a .txt/.json file (FILE.json:KEY); default: the class folder names
            (a wds folder: its classnames.txt).
        templates: a prompt template with {} such as 'a photo of a {}.', a built-in list (openai, simple, plain) or
            a .txt/.json file; several with --templates+ (default: simple; a wds folder: its templates).
        split: the IDX or wds split: train or test.
    """
    net, preprocess, tokenizer = load_clip(model, pretrained, device=device, trust_pickle=trust_pickle, seed=seed)
    wds = read_wds_folder(data, split)  # a CLIP_benchmark wds/ folder: its shards, class names and templates
    classnames, templates = classnames or (wds and wds.classnames), templates or (wds and wds.templates)
    names = get_classnames(classnames) if classnames else None
    source = open_image_source(wds.shards if wds else data, preprocess, classnames=names, label_field=label_field,
                               split=split, batch_size=batch_size, num_workers=workers)
    names = names or source.classnames
    if names is None:
        raise EvalError(f"{data}: give --classnames (a built-in list such as fashion-mnist or imagenet, or a file)")
    res = zero_shot(net, tokenizer, source, names, get_templates(templates or "simple"), precision=precision,
                    show_progress=progress, max_batches=max_batches)
    result = {"task": "zeroshot", "model": model, "pretrained": pretrained, "data": data, **res.to_dict()}
    if format == "clip_benchmark":
        result = zeroshot_record(res, dataset=wds.name if wds else data, model=model, pretrained=pretrained)
    return report(result, res.to_markdown(f"Zero-shot: {model} on {data}"), out, md)


@shared_docs
def retrieval(*, model: str, data: str, pretrained: Optional[str] = None, caption_field: str = "txt",
              recall_k: int | Sequence[int] = (1, 5, 10), split: str = "test", batch_size: int = 64, workers: int = 2,
              max_batches: Optional[int] = None, seed: int = 0, trust_pickle: bool = False, device: str = "auto",
              precision: str = "auto", out: Optional[str] = None, md: Optional[str] = None, progress: bool = True,
              format: Literal["diffmm", "clip_benchmark"] = "diffmm") -> dict:
    """Image->text and text->image recall@k (default 1, 5, 10) on image-text shards.

    Args:
        data: image-text shards, or a CLIP_benchmark wds retrieval folder.
        caption_field: txt (one caption a line) or json:NAME (a string or a list).
        recall_k: the k of recall@k.
        split: the split of a wds folder.
    """
    ks = [recall_k] if isinstance(recall_k, int) else list(recall_k)
    net, preprocess, tokenizer = load_clip(model, pretrained, device=device, trust_pickle=trust_pickle, seed=seed)
    wds = read_wds_folder(data, split)
    res = retrieval_on_shards(net, tokenizer, wds.shards if wds else data, preprocess, caption_field=caption_field,
                              batch_size=batch_size, num_workers=workers, ks=ks, precision=precision,
                              show_progress=progress, max_batches=max_batches)
    result = {"task": "retrieval", "model": model, "data": data, **res}
    if format == "clip_benchmark":
        result = retrieval_record(res, ks, dataset=wds.name if wds else data, model=model, pretrained=pretrained)
    return report(result, retrieval_markdown({model: res}, ks), out, md)


@shared_docs
def linear_probe(*, model: str, train: str, pretrained: Optional[str] = None, test: Optional[str] = None,
                 val: Optional[str] = None, label_field: str = "cls", max_iter: int = 1000, batch_size: int = 64,
                 workers: int = 2, max_batches: Optional[int] = None, seed: int = 0, trust_pickle: bool = False,
                 device: str = "auto", precision: str = "auto", out: Optional[str] = None, md: Optional[str] = None,
                 progress: bool = True) -> dict:
    """Logistic regression on frozen image features, with a sweep of the regularisation (CLIP's protocol).

    Args:
        train: labelled images (as zeroshot's data); an IDX folder gives its train split.
        test: labelled test images (default: the test split of the IDX folder given as train).
        val: validation images (default: a stratified 20% of train).
        max_iter: L-BFGS iterations per fit.
    """
    net, preprocess, _ = load_clip(model, pretrained, device=device, trust_pickle=trust_pickle, seed=seed)

    def source(spec: str, split: str):
        return open_image_source(spec, preprocess, label_field=label_field, split=split, batch_size=batch_size,
                                 num_workers=workers)

    splits = {"train": source(train, "train"), "test": source(test or train, "test")}
    if test is None and not isinstance(splits["train"], IdxSource):
        raise EvalError(f"give --test; only an IDX folder ({train}) holds both splits")
    if val:
        splits["val"] = source(val, "train")
    feats = {name: extract_features(net, src, precision=precision, show_progress=progress, desc=f"{name} features",
                                    max_batches=max_batches) for name, src in splits.items()}
    val_x, val_y = feats.get("val", (None, None))
    res = fit_linear_probe(*feats["train"], *feats["test"], val_x=val_x, val_y=val_y, max_iter=max_iter,
                           show_progress=progress)
    return report({"task": "linear_probe", "model": model, "train": train, "test": test, **res},
                  linear_probe_markdown({model: res}), out, md)


@shared_docs
def classify(images: list[str], *, model: str, pretrained: Optional[str] = None, labels: Optional[str] = None,
             classnames: Optional[str] = None, templates: str | list[str] | None = None, top_k: int = 5,
             batch_size: int = 64, workers: int = 2, max_batches: Optional[int] = None, seed: int = 0,
             trust_pickle: bool = False, device: str = "auto", precision: str = "auto", out: Optional[str] = None,
             progress: bool = True) -> dict:
    """Zero-shot labels for your own images: one row per image (top-k labels and their probabilities).

    Args:
        images: image files, folders (searched recursively) or glob patterns such as 'photos/*.jpg'.
        labels: class names, comma-separated: 'cat,dog,red car' (or give classnames).
        classnames: class names from a built-in list (imagenet, fashion-mnist) or a .txt/.json file (FILE.json:KEY).
        templates: prompt templates, as zeroshot's (default: 'a photo of a {}.').
        top_k: labels per image (at most the number of labels).
        out: write every row here: .csv or .json.
    """
    if (labels is None) == (classnames is None):
        raise EvalError("give one of --labels or --classnames")
    if top_k < 1:
        raise EvalError(f"--top_k {top_k}: expected a positive number")
    if out and not out.lower().endswith((".csv", ".json")):
        raise EvalError(f"--out {out}: expected a .csv or .json file name")
    names = parse_labels(labels) if labels is not None else get_classnames(classnames)
    prompts = get_templates(templates or "a photo of a {}.")
    files = expand_image_inputs(images)  # before loading the model: bad paths fail fast
    net, preprocess, tokenizer = load_clip(model, pretrained, device=device, trust_pickle=trust_pickle, seed=seed)
    preds = classify_images(net, tokenizer, preprocess, files, names, prompts, top_k=top_k, batch_size=batch_size,
                            num_workers=workers, precision=precision, show_progress=progress, max_batches=max_batches)
    if preds.skipped:
        reasons = ", ".join(f"{v} {k}" for k, v in preds.skipped.items())
        log.warning(f"skipped {sum(preds.skipped.values())} of {len(files)} images ({reasons})")
    if out and out.lower().endswith(".csv"):  # before printing: a closed stdout (`| head`) must not lose the rows
        print(f"wrote {preds.write_csv(out)}", file=sys.stderr)
    result = report({"task": "classify", "model": model, "pretrained": pretrained,
                     "templates": [t if isinstance(t, str) else t("{}") for t in prompts], **preds.to_dict()},
                    preds.to_markdown(), out if out and out.lower().endswith(".json") else None)
    if not preds.files:
        raise EvalError(f"none of the {len(files)} images could be read")
    return result


# -------------------------------------------------------------------------------------------------- LM tasks
@shared_docs
def perplexity(*, lm: str, data: str, tokenizer: Optional[str] = None, seq_len: int = 512, batch_size: int = 8,
               workers: int = 1, max_batches: Optional[int] = None, seed: int = 0, device: str = "auto",
               precision: str = "auto", out: Optional[str] = None, md: Optional[str] = None,
               progress: bool = True) -> dict:
    """LM perplexity (token-weighted NLL, bits per token) on text shards.

    Args:
        data: text shards (KEY.txt documents).
        seq_len: tokens per row.
    """
    tok = lm_tokenizer(lm, tokenizer)
    net = load_lm(lm, vocab_size=tok.vocab_size, device=device, seed=seed)
    res = perplexity_on_shards(net, data, tok, seq_len, batch_size=batch_size, num_workers=workers,
                               precision=precision, max_batches=max_batches, show_progress=progress)
    return report({"task": "perplexity", "lm": lm, **res}, perplexity_markdown({lm: res}), out, md)


@shared_docs
def needle(*, lm: str, tokenizer: Optional[str] = None, haystack: Sequence[str] = (PYTHON_DOCS,),
           haystack_chars: int = 2_000_000, context_length: Sequence[int] = (4096,), needles: int = 6, queried: int = 2,
           depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), trials: int = 10, max_new_tokens: int = 8,
           attention: bool = False, plot: Optional[str] = None, seed: int = 0, device: str = "auto",
           out: Optional[str] = None, md: Optional[str] = None, progress: bool = True) -> dict:
    """Multi-needle retrieval: N needles in real text, R of them queried at each depth (DIFF paper section 3.4).

    Args:
        haystack: text files or folders of *.txt files.
        haystack_chars: read this many characters of the haystack.
        context_length: prompt lengths in tokens (one run each).
        needles: N, needles in the haystack.
        queried: R, needles asked for (together at the depth).
        depths: where the queried needles sit, 0 (start) .. 1 (end).
        trials: haystacks per depth.
        max_new_tokens: tokens generated for an answer.
        attention: also measure the attention share on the queried needle.
        plot: PNG of the accuracy (and attention share) per depth.
    """
    tok = lm_tokenizer(lm, tokenizer)
    net = load_lm(lm, vocab_size=tok.vocab_size, device=device, seed=seed)
    sentences = load_haystack(haystack, max_chars=haystack_chars)
    runs = {}
    for L in context_length:
        cfg = NeedleConfig(context_length=L, num_needles=needles, num_queried=queried, depths=tuple(depths),
                           trials=trials, seed=seed, max_new_tokens=max_new_tokens)
        runs[L] = multi_needle(net, tok, sentences, cfg, measure_attention=attention, show_progress=progress)
    if plot:
        plot_needle_attention({f"{lm} @ {L}": {"attention": r.attention_by_depth, "accuracy": r.accuracy_by_depth}
                               for L, r in runs.items()}, plot)
        print(f"wrote {plot}", file=sys.stderr)
    return report({"task": "needle", "lm": lm, "runs": {str(L): r.to_dict() for L, r in runs.items()}},
                  "\n".join(r.to_markdown(f"{lm} @ {L}") for L, r in runs.items()), out, md)


@shared_docs
def recall(*, lm: str, vocab: Optional[int] = None, seq_len: Sequence[int] = (64, 128, 256, 512),
           pairs: Sequence[int] = (4, 8, 16, 32), queries: Optional[int] = None, noise: float = 1.0,
           query_power: float = 0.01, sampler: Literal["diffmm", "zoology"] = "diffmm", examples: int = 256,
           batch_size: int = 32, attention: bool = True, attention_examples: int = 64, label: Optional[str] = None,
           plot: Optional[str] = None, seed: int = 0, trust_pickle: bool = False, device: str = "auto",
           out: Optional[str] = None, md: Optional[str] = None, progress: bool = True) -> dict:
    """Associative recall (MQAR): accuracy per sequence length x pairs, attention share on the answer, net mass.

    Args:
        vocab: task vocabulary (default: the model's vocab_size; 256 for config:NAME).
        seq_len: sequence lengths.
        pairs: key-value pairs per sequence.
        queries: queries per sequence (default: every pair).
        noise: probability of a random key/value filler token.
        query_power: query offset law p(i) ~ i^(a-1); 1 = uniform.
        sampler: diffmm (queried pairs in random order) or zoology (Zoology's multiquery_ar as published: every
            pair queried, pair j at the j-th slot drawn, so early pairs are asked first more often).
        examples: sequences per setting.
        attention: also measure the attention shares.
        attention_examples: sequences per setting for the attention shares.
        label: the model's name in the table and plot.
        plot: PNG of the accuracy per setting and the attention shares.
        seed: evaluation-set seed (and random-weight seed).
    """
    net = load_lm(lm, vocab_size=vocab or 256, block_size=max(seq_len), device=device, trust_pickle=trust_pickle,
                  seed=seed)
    vocab = vocab or getattr(getattr(net, "config", None), "vocab_size", None)
    if vocab is None:
        raise EvalError(f"{lm}: the model has no config.vocab_size; give --vocab")
    tasks = tasks_from_grid(vocab, seq_len, pairs, noise=noise, num_queries=queries, query_power=query_power,
                            sampler=sampler)
    res = evaluate_recall(net, tasks, examples=examples, batch_size=batch_size, seed=seed,
                          measure_attention=attention, attention_examples=attention_examples, show_progress=progress)
    if plot:
        plot_recall({label or lm: res.to_dict()}, plot)
        print(f"wrote {plot}", file=sys.stderr)
    return report({"task": "recall", "lm": lm, **res.to_dict()}, res.to_markdown(label or lm), out, md)


@shared_docs
def outliers(*, lm: str, data: str, tokenizer: Optional[str] = None, seq_len: int = 512, batch_size: int = 4,
             workers: int = 1, max_batches: Optional[int] = 8, seed: int = 0, device: str = "auto",
             out: Optional[str] = None, md: Optional[str] = None, progress: bool = True) -> dict:
    """The largest attention logits and hidden states, and their medians (DIFF paper Table 5).

    Args:
        data: text shards (KEY.txt documents).
        seq_len: tokens per row.
    """
    tok = lm_tokenizer(lm, tokenizer)
    net = load_lm(lm, vocab_size=tok.vocab_size, device=device, seed=seed)
    ds = TextDataset(data, batch_size, seq_len, tokenizer=tok, train=False, shuffle=False, equalize=False)
    res = activation_outliers(net, (b[:, :-1] for b in ShardLoader(ds, num_workers=workers)),
                              max_batches=max_batches, show_progress=progress)
    return report({"task": "outliers", "lm": lm, **res}, outliers_markdown({lm: res}), out, md)


@shared_docs
def icl(*, lm: str, train: str, tokenizer: Optional[str] = None, test: Optional[str] = None,
        test_fraction: float = 0.3, max_test: Optional[int] = None, text_key: str = "text", label_key: str = "label",
        shots: int = 8, orders: int = 10, arrangement: Literal["random", "grouped"] = "random", seed: int = 0,
        device: str = "auto", out: Optional[str] = None, md: Optional[str] = None, progress: bool = True) -> dict:
    """In-context-learning accuracy over orders of the same demonstrations (DIFF paper section 3.5).

    Args:
        train: jsonl with text and label (the demonstration pool).
        test: jsonl test set (default: test_fraction of train, held out).
        test_fraction: the share of train held out as the test set when there is no test file.
        max_test: use at most this many test examples.
        text_key: the text field of a jsonl line.
        label_key: the label field of a jsonl line.
        shots: demonstrations per prompt.
        orders: orders of the demonstrations.
        arrangement: random permutations, or grouped by class with the class order permuted.
    """
    tok = lm_tokenizer(lm, tokenizer)
    net = load_lm(lm, vocab_size=tok.vocab_size, device=device, seed=seed)
    pool = load_jsonl_examples(train, text_key, label_key)
    if test:
        held_out = load_jsonl_examples(test, text_key, label_key)
    else:
        random.Random(seed).shuffle(pool)
        n = max(1, int(len(pool) * test_fraction))
        held_out, pool = pool[:n], pool[n:]
    res = icl_order_robustness(net, tok, pool, held_out[:max_test], ICLConfig(shots=shots, orders=orders,
                               arrangement=arrangement, seed=seed), show_progress=progress)
    return report({"task": "icl", "lm": lm, **res.to_dict()}, res.to_markdown(lm), out, md)


@shared_docs
def lm_eval(*, lm: str, tasks: str, tokenizer: Optional[str] = None, include_path: Optional[str] = None,
            with_default_tasks: bool = False, num_fewshot: Optional[int] = None, limit: Optional[float] = None,
            batch_size: str = "8", max_batch_size: int = 64, bootstrap_iters: int = 100000, seed: int = 0,
            device: str = "auto", out: Optional[str] = None, md: Optional[str] = None) -> dict:
    """lm-evaluation-harness 0.4.x tasks on a diffmm LM (local YAML tasks included); ARGS are lm-eval's own.

    On the command line, ``diffmm eval lm-eval ARGS`` runs lm-eval's own CLI with lm-eval's arguments
    (``--model_args pretrained=LM``, ``--tasks``, ``--include_path``, ``--batch_size``, ``--output_path``, ...;
    ``--model diffmm`` by default; see ``diffmm eval lm-eval --help``). This function is the Python form.

    Args:
        tasks: task names, comma-separated.
        include_path: a folder of task YAML files (local tasks).
        with_default_tasks: also index lm-eval's own tasks (with include_path).
        num_fewshot: few-shot examples per prompt (default: the task's).
        limit: examples per task (or a fraction below 1).
        batch_size: sequences per forward, or auto / auto:N (lm-eval's: the largest that fits; see DiffmmLM).
        max_batch_size: the largest batch auto tries.
        bootstrap_iters: lm-eval's resamples for stderr (0: no stderr).
    """
    from diffmm.eval.harness import DiffmmLM, run_lm_eval  # lm-eval: optional, and seconds to import

    tok = lm_tokenizer(lm, tokenizer)
    net = load_lm(lm, vocab_size=tok.vocab_size, device=device, seed=seed)
    res = run_lm_eval(DiffmmLM(net, tok, batch_size=batch_size, max_batch_size=max_batch_size), tasks.split(","),
                      include_path=include_path, num_fewshot=num_fewshot, limit=limit, seed=seed,
                      include_defaults=True if with_default_tasks else None, bootstrap_iters=bootstrap_iters)
    rows = [[task, metric.split(",")[0], value, metrics.get(metric.replace(",", "_stderr,", 1), float("nan"))]
            for task, metrics in res["results"].items() for metric, value in metrics.items()
            if isinstance(value, (int, float)) and "stderr" not in metric and not metric.startswith("sample_len")]
    return report({"task": "lm_eval", "lm": lm, **res},
                  markdown_table(["task", "metric", "value", "stderr"], rows, ".4f"), out, md)


# ---------------------------------------------------------------------------------------------------- pictures
@shared_docs
def plot_attention(*, model: list[str], image: str, out: str, pretrained: Optional[list[str]] = None,
                   label: Optional[list[str]] = None, layer: int = -1, max_heads: int = 8, trust_pickle: bool = False,
                   device: str = "auto") -> str:
    """CLS attention maps of CLIP / DiffCLIP models on one image (PNG): per head and their mean, in one layer.

    Args:
        model: the models (see zeroshot's model), one row each.
        image: the image.
        out: the PNG to write.
        pretrained: weights for each model ('none': random weights).
        label: a name for each model (default: the model).
        layer: the vision attention layer (a python index: -1 is the last).
        max_heads: heads drawn per model.
    """
    with Image.open(image) as img:
        img.load()
    entries, shown = {}, None
    for i, name in enumerate(model):
        weights = pretrained[i] if pretrained and i < len(pretrained) and pretrained[i] not in ("", "none") else None
        net, preprocess, _ = load_clip(name, weights, device=device, trust_pickle=trust_pickle)
        x = preprocess(img)
        shown = x if shown is None else shown
        entries[label[i] if label and i < len(label) else name] = cls_attention(net, x, layer=layer)
    print(f"wrote {plot_attention_maps(shown, entries, out, max_heads=max_heads)}")
    return out


@shared_docs
def plot_needle(*, result: list[str], out: str) -> str:
    """Needle accuracy and attention share per depth (PNG) from the JSON results of diffmm eval needle.

    Args:
        result: LABEL=needle.json for each run.
        out: the PNG to write.
    """
    results = {}
    for spec in result:
        name, _, path = spec.rpartition("=")
        with open(path) as f:
            data = json.load(f)
        for L, r in data.get("runs", {"": data}).items():  # depth keys are strings in JSON; the plot reads floats
            results[f"{name or path}{' @ ' + L if L else ''}"] = {"attention": r.get("attention_by_depth", {}),
                                                                  "accuracy": r.get("accuracy_by_depth", {})}
    print(f"wrote {plot_needle_attention(results, out)}")
    return out


@shared_docs
def plot_loss(*, run: list[str], out: str, metrics: Optional[list[str]] = None, log_y: bool = False) -> str:
    """Loss curves (PNG) from Lightning CSVLogger metrics.csv files.

    Args:
        run: LABEL=path/to/metrics.csv (or its folder) for each run.
        out: the PNG to write.
        metrics: the columns to draw (default: every column with 'loss' in its name).
        log_y: a logarithmic y axis.
    """
    runs = {name or path: path for name, _, path in (spec.rpartition("=") for spec in run)}
    print(f"wrote {plot_loss_curves(runs, out, metrics=metrics, log_y=log_y)}")
    return out
