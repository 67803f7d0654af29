"""Class names and prompt templates for zero-shot classification.

Built in: ``imagenet`` class names and the ``openai`` (80) / ``simple`` (2) ImageNet templates of
``open_clip.zero_shot_metadata`` (callables); ``fashion-mnist`` class names; the ``plain`` template ``"{}"``.
A string template marks the class name with ``{}`` or ``{c}`` and may be written inline (``"a photo of a {}."``).
Custom lists come from a file: ``.txt`` (one entry a line; blank lines and ``#`` comments skipped) or ``.json``
(a list, an ``{index: name}`` dict, or ``FILE.json:KEY`` for a list stored under ``KEY``, e.g.
``data/emoji/classes.json:groups``).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Callable, Sequence, Union

from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

from diffmm.eval.common import EvalError

log = logging.getLogger("diffmm.eval")

Template = Union[str, Callable[[str], str]]

#: Fashion-MNIST labels 0..9, worded for prompts.
FASHION_MNIST_CLASSNAMES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                            "ankle boot")
BUILTIN_CLASSNAMES = {"imagenet": tuple(IMAGENET_CLASSNAMES), "fashion-mnist": FASHION_MNIST_CLASSNAMES,
                      "fashion_mnist": FASHION_MNIST_CLASSNAMES, "fmnist": FASHION_MNIST_CLASSNAMES}
BUILTIN_TEMPLATES = {"openai": tuple(OPENAI_IMAGENET_TEMPLATES), "simple": tuple(SIMPLE_IMAGENET_TEMPLATES),
                     "plain": ("{}",)}


def read_list(spec: str, what: str) -> list[str]:
    """Entries of a ``.txt`` / ``.json`` / ``FILE.json:KEY`` list (see the module docstring)."""
    path, key = spec, None
    if not os.path.exists(path) and ".json:" in spec:
        path, key = spec.rsplit(":", 1)
    if not os.path.isfile(path):
        raise EvalError(f"{what} file not found: {path}")
    if not path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}: not valid JSON ({e})") from None
    if key is not None:
        if not isinstance(data, dict) or key not in data:
            raise EvalError(f"{path}: no key {key!r}; keys are {sorted(data) if isinstance(data, dict) else []}")
        data = data[key]
    if isinstance(data, dict):  # {"0": name, "1": name, ...}
        if set(data) != {str(i) for i in range(len(data))}:
            raise EvalError(f"{path}: a {what} dict must map the indices 0..{len(data) - 1} to names; use "
                            f"FILE.json:KEY to pick a list out of {sorted(data)}")
        data = [data[str(i)] for i in range(len(data))]
    if not isinstance(data, list) or not all(isinstance(v, str) for v in data):
        raise EvalError(f"{spec}: expected a list of strings for the {what}")
    return data


def get_classnames(spec: str | Sequence[str]) -> list[str]:
    """Class names from a built-in name (``imagenet``, ``fashion-mnist``), a file, or a list."""
    if isinstance(spec, str):
        names = list(BUILTIN_CLASSNAMES[spec]) if spec in BUILTIN_CLASSNAMES else read_list(spec, "class names")
    else:
        names = list(spec)
    if not names:
        raise EvalError(f"class name list {spec if isinstance(spec, str) else ''} is empty")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:  # ImageNet's list has two ("missile", "sunglasses"): legal, but such classes get equal classifiers
        log.warning(f"class names repeat: {dup[:5]}; those classes get identical zero-shot classifiers")
    return names


def _is_template(text: str) -> bool:
    return "{}" in text or "{c}" in text


def _expand(spec: str) -> list[Template]:
    """A template list entry without ``{}``: a built-in list or a file."""
    if spec in BUILTIN_TEMPLATES:
        return list(BUILTIN_TEMPLATES[spec])
    if os.path.isfile(spec) or spec.endswith((".txt", ".json")) or ".json:" in spec or os.sep in spec:
        return read_list(spec, "templates")  # a missing file: "templates file not found: ..."
    raise EvalError(f"{spec}: template {spec!r} has no {{}} (or {{c}}) where the class name goes; give a built-in "
                    f"list (openai, simple, plain), a .txt/.json file, or a template such as 'a photo of a {{}}.'")


def get_templates(spec: str | Sequence[Template]) -> list[Template]:
    """Templates from a built-in name (``openai``, ``simple``, ``plain``), a file, an inline template, or a list
    mixing them (each entry expanded, as repeated ``--templates`` options are).

    A string template holds ``{}`` or ``{c}`` where the class name goes (``"a photo of a {}."``); callables take
    the name.
    """
    templates: list[Template] = []
    for item in [spec] if isinstance(spec, str) else spec:
        templates += _expand(item) if isinstance(item, str) and not _is_template(item) else [item]
    where = spec if isinstance(spec, str) else "the template list"
    if not templates:
        prefix = f"{spec}: " if isinstance(spec, str) else ""
        raise EvalError(f"{prefix}the template list is empty; give at least one template such as 'a photo of a {{}}.'")
    for i, t in enumerate(templates):
        if isinstance(t, str) and not _is_template(t):
            raise EvalError(f"{where}: template {i} {t!r} has no {{}} (or {{c}}) where the class name goes")
        if not isinstance(t, str) and not callable(t):
            raise EvalError(f"{where}: template {i} is a {type(t).__name__}; expected a string or a callable")
    return templates


def parse_labels(text: str) -> list[str]:
    """Class names from an inline comma-separated list (``"cat,dog,red car"``); spaces around names are dropped."""
    names = [n.strip() for n in text.split(",")]
    if not any(names):
        raise EvalError(f"--labels {text!r}: no class names; give them comma-separated, e.g. 'cat,dog,bird'")
    if "" in names:
        raise EvalError(f"--labels {text!r}: an empty name (two commas in a row, or a trailing comma)")
    return get_classnames(names)


def fill_template(template: Template, classname: str) -> str:
    """The prompt of ``template`` for ``classname``."""
    if callable(template):
        return template(classname)
    return template.replace("{c}", classname) if "{c}" in template else template.format(classname)
