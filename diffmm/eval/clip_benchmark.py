"""CLIP_benchmark (LAION's zero-shot / retrieval evaluator, the ``clip-benchmark`` pip package) on diffmm models, and
diffmm results written in its JSON schema.

``diffmm eval clip-benchmark`` (:func:`clip_benchmark`) adds ``diffmm`` to CLIP_benchmark's model types
(:func:`register`: ``clip_benchmark.models.TYPE2FUNC``, loader :func:`diffmm.eval.loading.load_clip`) and calls
CLIP_benchmark's own ``clip_benchmark.cli.run`` once per model x dataset x language, with CLIP_benchmark's own flags
parsed by its own parser: the datasets (``wds/<name>`` with ``--dataset_root``), metrics and JSON are its own::

    diffmm eval clip-benchmark --model runs/clip/checkpoints/last.ckpt --dataset wds/fmnist \
        --dataset_root wds_root/fmnist --output '{dataset}_{model}_{task}.json'

From Python, after :func:`register`, ``clip_benchmark.cli.run`` / ``main_eval`` take ``model_type="diffmm"``.

``diffmm eval zeroshot|retrieval --format clip_benchmark`` write the same JSON from diffmm's own evaluation
(:func:`zeroshot_record`, :func:`retrieval_record`); both read a CLIP_benchmark ``wds/`` folder
(:func:`read_wds_folder`).
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
from dataclasses import dataclass
from itertools import product
from typing import Any, Literal, Optional, Sequence, Union
from unittest import mock

import numpy as np
import torch

from diffmm.eval.common import EvalError, markdown_table
from diffmm.eval.loading import load_clip
from diffmm.eval.zeroshot import ZeroShotResult

#: the model type diffmm registers in CLIP_benchmark
MODEL_TYPE = "diffmm"
#: CLIP_benchmark's default ``--output`` template
DEFAULT_OUTPUT = "{dataset}_{pretrained}_{model}_{language}_{task}.json"
#: ``--pretrained`` values that mean "no separate weights" (a checkpoint or export given as the model, or random)
NO_WEIGHTS = ("", "none")
MISSING = "CLIP_benchmark is not installed; pip install 'clip-benchmark==1.6.2' (or the diffmm 'eval' extra)"


# ------------------------------------------------------------------------------------------- CLIP_benchmark side
def _accuracy_numpy2(output: torch.Tensor, target: torch.Tensor, topk: Sequence[int] = (1,)) -> list[float]:
    """CLIP_benchmark 1.6.2's ``metrics.zeroshot_classification.accuracy`` (top-k accuracy of logits (N, C) against
    labels (N,)) with its one NumPy 2 failure removed. Its last line ends in ``float(<array of shape (1,)>)`` (a
    ``sum(0, keepdim=True)`` turned ``.numpy()``), deprecated since NumPy 1.25 and refused by NumPy 2.4 ("only
    0-dimensional arrays can be converted to Python scalars"); here the count is a 0-d tensor. Same ranking
    (``topk``, sorted), same values."""
    pred = output.topk(max(topk), 1, True, True)[1].t()  # (kmax, N)
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [float(correct[:k].sum()) / len(target) for k in topk]


def _needs_numpy2_shim() -> bool:
    """Whether this NumPy refuses ``float`` of a 1-element 1-d array (what CLIP_benchmark's ``accuracy`` does)."""
    try:
        float(np.zeros(1))  # type: ignore[arg-type]
    except TypeError:
        return True
    return False


def _load_for_clip_benchmark(model_name: str, pretrained: str, cache_dir: Optional[str] = None,
                             device: Union[str, torch.device] = "cpu", *, trust_pickle: bool = False,
                             seed: int = 0) -> tuple[torch.nn.Module, Any, Any]:
    """CLIP_benchmark's loader contract (``TYPE2FUNC`` entries): ``(model, eval transform, tokenizer)``."""
    weights = None if pretrained in NO_WEIGHTS else pretrained
    return load_clip(model_name, weights, device=device, trust_pickle=trust_pickle, seed=seed)


def register(*, trust_pickle: bool = False, seed: int = 0):
    """Add ``diffmm`` to CLIP_benchmark's model types (any model :func:`diffmm.eval.loading.load_clip` reads; a
    ``--pretrained`` of ``none`` means none) and, where NumPy refuses the float in its ``accuracy``, swap in
    :func:`_accuracy_numpy2`; returns ``clip_benchmark.cli``.

    Args:
        trust_pickle: allow pickled checkpoints that need full unpickling (official DiffCLIP; files you trust).
        seed: torch seed before a model with random weights is built.
    """
    try:  # CLIP_benchmark is optional (the 'eval' extra) and imports its metrics and datasets (~0.5 s): load on use
        from clip_benchmark import cli
        from clip_benchmark.metrics import zeroshot_classification
        from clip_benchmark.models import MODEL_TYPES, TYPE2FUNC
    except ImportError:
        raise EvalError(MISSING) from None

    def load(model_name: str, pretrained: str, cache_dir: Optional[str] = None, device="cpu"):
        return _load_for_clip_benchmark(model_name, pretrained, cache_dir, device, trust_pickle=trust_pickle,
                                        seed=seed)

    TYPE2FUNC[MODEL_TYPE] = load
    if MODEL_TYPE not in MODEL_TYPES:  # the list the CLI's --model_type choices and load_clip's check read
        MODEL_TYPES.append(MODEL_TYPE)
    if _needs_numpy2_shim():
        zeroshot_classification.accuracy = _accuracy_numpy2
    return cli


def _as_list(value: Union[Any, Sequence[Any]]) -> list:
    return [value] if isinstance(value, (str, int)) else list(value)


def _file_slug(name: str) -> str:
    """``{model}`` / ``{pretrained}`` in an output file name: a path's last part (a file or an export folder;
    CLIP_benchmark's own rule for a pretrained file), otherwise the name with its slashes as ``_``
    (``hf-hub:org/repo``)."""
    if os.path.exists(name):
        return os.path.basename(os.path.normpath(name))
    return name.replace("/", "_")


def _output_path(template: str, *, model: str, pretrained: str, dataset: str, language: str, task: str) -> str:
    """The file CLIP_benchmark writes for one run: its template filled as its ``run`` fills it, except that a path
    given as ``--model`` / ``--pretrained`` enters as :func:`_file_slug` (a path would name folders)."""
    return template.format(model=_file_slug(model), pretrained=_file_slug(pretrained),
                           pretrained_full_path=pretrained.replace("/", "_"), task=task,
                           dataset=dataset.replace("/", "_"), language=language)


def _cli_args(cli, argv: list[str]):
    """CLIP_benchmark's own ``eval`` arguments (its parser: its defaults and checks) for ``argv``."""
    with mock.patch.object(sys, "argv", ["clip_benchmark", "eval", *argv]):
        try:
            return cli.get_parser_args()[1]
        except SystemExit as e:  # argparse printed the reason
            raise EvalError(f"CLIP_benchmark rejected the arguments {argv} (exit {e.code})") from None


def clip_benchmark(*, model: Union[str, list[str]], dataset: Union[str, list[str]],
                   pretrained: Union[str, list[str]] = "none", dataset_root: str = "root", split: str = "test",
                   task: Literal["auto", "zeroshot_classification", "zeroshot_retrieval"] = "auto",
                   no_amp: bool = False, batch_size: int = 64, num_workers: int = 4,
                   recall_k: Union[int, list[int]] = 5, seed: int = 0, language: Union[str, list[str]] = "en",
                   output: str = DEFAULT_OUTPUT, annotation_file: str = "",
                   custom_classname_file: Optional[str] = None, custom_template_file: Optional[str] = None,
                   dump_classnames: bool = False, dump_templates: bool = False, skip_existing: bool = False,
                   wds_cache_dir: Optional[str] = None, quiet: bool = False,
                   trust_pickle: bool = False) -> list[dict]:
    """CLIP_benchmark's own zero-shot classification / retrieval on diffmm models; writes its JSON per run.

    The flags are CLIP_benchmark's (clip_benchmark eval), with --model_type diffmm implied; several values as
    --model+ A --model+ B or '[A,B]'. Its own code loads the data, evaluates and writes the JSON.

    Args:
        model: what diffmm loads: a config name, open_clip:NAME, a Lightning .ckpt, an export folder, an open_clip or
            official DiffCLIP checkpoint.
        dataset: CLIP_benchmark dataset names, e.g. wds/NAME (a webdataset folder: --dataset_root), or a collection.
        pretrained: weights for a config name (none: a checkpoint or export given as model, or random weights).
        dataset_root: the dataset folder; may hold {dataset} (the name without wds/).
        split: the dataset split.
        task: zeroshot_classification, zeroshot_retrieval, or auto (told by the dataset).
        no_amp: no mixed precision (CLIP_benchmark autocasts by default, bf16 on CPU).
        batch_size: images per batch.
        num_workers: DataLoader workers.
        recall_k: the k of retrieval recall@k.
        seed: torch seed of each run (and of random weights).
        language: language(s) of the class names and prompts of CLIP_benchmark's built-in datasets.
        output: the JSON file per run; may hold {dataset} {model} {pretrained} {pretrained_full_path} {language} {task}
            (a model or weights path enters as its last part).
        annotation_file: text annotations of a retrieval dataset that needs them.
        custom_classname_file: a JSON file of class names per dataset.
        custom_template_file: a JSON file of prompt templates per dataset.
        dump_classnames: add the class names to the JSON.
        dump_templates: add the templates to the JSON.
        skip_existing: skip a run whose output file exists.
        wds_cache_dir: cache folder for webdataset shards.
        quiet: no CLIP_benchmark messages.
        trust_pickle: allow pickled checkpoints that need full unpickling (official DiffCLIP; files you trust).
    """
    cli = register(trust_pickle=trust_pickle, seed=seed)
    from clip_benchmark.datasets.builder import (  # installed: register() checked
        dataset_collection,
        get_dataset_collection_from_file,
        get_dataset_default_task,
    )

    argv = ["--model_type", MODEL_TYPE, "--dataset_root", dataset_root, "--split", split, "--task", task,
            "--batch_size", str(batch_size), "--num_workers", str(num_workers), "--seed", str(seed),
            "--annotation_file", annotation_file, "--recall_k", *map(str, _as_list(recall_k))]
    argv += ["--no_amp"] * no_amp + ["--quiet"] * quiet + ["--skip_existing"] * skip_existing
    argv += ["--dump_classnames"] * dump_classnames + ["--dump_templates"] * dump_templates
    for flag, value in (("--custom_classname_file", custom_classname_file),
                        ("--custom_template_file", custom_template_file), ("--wds_cache_dir", wds_cache_dir)):
        argv += [flag, value] if value else []
    base = _cli_args(cli, argv)
    datasets = []  # CLIP_benchmark's rule: a file lists names, a collection name expands, else a dataset name
    for name in _as_list(dataset):
        if os.path.isfile(name):
            datasets += get_dataset_collection_from_file(name)
        else:
            datasets += dataset_collection.get(name, [name])
    records = []
    for (model_name, weights), dataset_name, lang in product(product(_as_list(model), _as_list(pretrained)),
                                                             datasets, _as_list(language)):
        run_task = task if task != "auto" else get_dataset_default_task(dataset_name.removeprefix("wds/"))
        path = _output_path(output, model=model_name, pretrained=weights, dataset=dataset_name.removeprefix("wds/"),
                            language=lang, task=run_task)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        args = copy.copy(base)
        args.model, args.pretrained, args.dataset, args.language = model_name, weights, dataset_name, lang
        args.output = path.replace("{", "{{").replace("}", "}}")  # run() formats it again
        try:
            cli.run(args)
        except AssertionError as e:  # CLIP_benchmark checks its input with asserts
            raise EvalError(f"CLIP_benchmark, {dataset_name} ({run_task}): {e}") from None
        with open(path) as f:
            records.append(json.load(f))
        print(f"wrote {path}", file=sys.stderr)
    print(records_markdown(records))
    return records


def records_markdown(records: Sequence[dict]) -> str:
    """One row per CLIP_benchmark JSON record: model, weights, dataset, task and each metric in %."""
    metrics = sorted({m for r in records for m in r["metrics"]})
    rows = [[r["model"], r["pretrained"], r["dataset"], r["task"],
             *[100 * r["metrics"][m] if isinstance(r["metrics"].get(m), (int, float)) else math.nan for m in metrics]]
            for r in records]
    return markdown_table(["model", "pretrained", "dataset", "task", *[f"{m} (%)" for m in metrics]], rows)


# ------------------------------------------------------------------------------------------------- diffmm side
@dataclass
class WdsFolder:
    """A CLIP_benchmark webdataset folder (``ROOT/<split>/nshards.txt``, ``ROOT/<split>/0.tar`` ...)."""

    name: str  #: CLIP_benchmark's dataset name: ``wds/<folder name>``
    shards: str  #: the split's shard spec
    classnames: Optional[str]  #: ``classnames.txt`` when the folder has it
    templates: Optional[str]  #: ``zeroshot_classification_templates.txt`` when the folder has it


def read_wds_folder(path: str, split: str = "test") -> Optional[WdsFolder]:
    """The shards, class names and templates of a CLIP_benchmark ``wds/`` folder, or ``None`` when ``path`` is not
    one (no ``<split>/nshards.txt``)."""
    counts = os.path.join(path, split, "nshards.txt")
    if not os.path.isfile(counts):
        return None
    with open(counts) as f:
        text = f.read().strip()
    if not text.isdigit() or int(text) < 1:
        raise EvalError(f"{counts}: expected a positive number of shards; got {text!r}")

    def optional(name: str) -> Optional[str]:
        return os.path.join(path, name) if os.path.isfile(os.path.join(path, name)) else None

    return WdsFolder(f"wds/{os.path.basename(os.path.normpath(path))}",
                     os.path.join(path, split, f"{{0..{int(text) - 1}}}.tar"),
                     optional("classnames.txt"), optional("zeroshot_classification_templates.txt"))


def _record(task: str, metrics: dict, *, dataset: str, model: str, pretrained: Optional[str],
            language: str) -> dict:
    return {"dataset": dataset, "model": model, "pretrained": pretrained or "none", "task": task, "metrics": metrics,
            "language": language}


def zeroshot_record(res: ZeroShotResult, *, dataset: str, model: str, pretrained: Optional[str] = None,
                    language: str = "en") -> dict:
    """A zero-shot result as CLIP_benchmark's JSON: ``acc1``, ``acc5`` (NaN below 5 classes, as there) and
    ``mean_per_class_recall`` (its ``balanced_accuracy_score``: the mean recall of the classes that have images)."""
    if 1 not in res.topk_correct or (len(res.classnames) >= 5 and 5 not in res.topk_correct):
        raise EvalError("a CLIP_benchmark record needs the top-1 and top-5 counts")
    metrics = {"acc1": res.topk(1), "acc5": res.topk(5) if len(res.classnames) >= 5 else math.nan,
               "mean_per_class_recall": res.mean_per_class_accuracy}
    return _record("zeroshot_classification", metrics, dataset=dataset, model=model, pretrained=pretrained,
                   language=language)


def retrieval_record(res: dict, recall_k: Sequence[int], *, dataset: str, model: str,
                     pretrained: Optional[str] = None, language: str = "en") -> dict:
    """A retrieval result (:func:`diffmm.eval.retrieval.evaluate_retrieval`) as CLIP_benchmark's JSON: its
    ``image_retrieval_recall@k`` is text->image (per caption: its image among the k nearest), its
    ``text_retrieval_recall@k`` image->text (per image: any of its captions among the k nearest)."""
    metrics = {}
    for k in recall_k:
        metrics[f"image_retrieval_recall@{k}"] = res[f"text_to_image_R@{k}"]
        metrics[f"text_retrieval_recall@{k}"] = res[f"image_to_text_R@{k}"]
    return _record("zeroshot_retrieval", metrics, dataset=dataset, model=model, pretrained=pretrained,
                   language=language)
