"""``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` of ``DiffCLIP`` and ``DiffLM``
(``huggingface_hub.PyTorchModelHubMixin``), writing and reading diffmm's export folder, the one folder format that
``diffmm export`` writes and ``diffmm.load_pretrained`` reads (its files: docs/models.md, "Hugging Face hub"):
``config.json`` (:func:`model_record` plus a ``model_type`` sentence that transformers' error shows),
``model.safetensors`` (tied weights once), the tokenizer when one is known, and ``README.md`` (the model card).
Loading checks every key and shape in one error (no partial loads).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, ClassVar, Iterator, Optional, Union

import huggingface_hub
import torch
import torch.nn as nn
from huggingface_hub import PyTorchModelHubMixin
from safetensors.torch import load_file, save_file

from diffmm.models.weights import DamagedFileError, load_strict, safetensors_damage, unique_state_dict

#: what huggingface_hub raises for a repository it cannot give (no network, no such repository, a bad name)
HUB_ERRORS = (huggingface_hub.errors.HfHubHTTPError, huggingface_hub.errors.LocalEntryNotFoundError,
              huggingface_hub.errors.HFValidationError, huggingface_hub.errors.EntryNotFoundError)
MARKER = "diffmm_export"
VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
#: ``config.json``'s ``model_type`` per kind: transformers prints it in its "does not recognize this architecture" error
MODEL_TYPES = {
    "lm": "diffmm_lm (a diffmm export, not a transformers model: load it with diffmm.load_pretrained or "
          "DiffLM.from_pretrained; for transformers write the DiffLlama folder: diffmm export CHECKPOINT OUT "
          "--format difflama)",
    "clip": "diffmm_clip (a diffmm export, not a transformers model: load it with diffmm.load_pretrained or "
            "DiffCLIP.from_pretrained)",
}

MODEL_CARD = """---
{{ card_data }}
---

A diffmm `{{ model_class }}` ({{ description }}){% if paper_url %}; paper: {{ paper_url }}{% endif %}.

Files: `config.json` (the diffmm model config under `config`), `model.safetensors`{% if tokenizer %}, the tokenizer
(`tokenizer.json`, `tokenizer_config.json`, loaded by `transformers.AutoTokenizer.from_pretrained`){% endif %}.

```python
from {{ module }} import {{ model_class }}
model = {{ model_class }}.from_pretrained("THIS_FOLDER_OR_REPO")   # or diffmm.load_pretrained("THIS_FOLDER")
```
"""


def model_record(model: nn.Module) -> dict[str, Any]:
    """What rebuilds ``model`` without its weights: ``{"diffmm_export": {"kind", "version"}, "config": {...}}`` (an
    export's ``config.json`` and a Lightning checkpoint's ``diffmm_model`` entry)."""
    return {MARKER: {"kind": model.export_kind, "version": VERSION}, "config": model.config.to_dict()}


def read_record(record: Any, *, source: str, **overrides: Any) -> tuple[type, Any]:
    """``(model class, config)`` of a :func:`model_record` (``overrides``: config fields), one-line errors for a
    missing or newer entry and an unknown kind."""
    info = record.get(MARKER) if isinstance(record, dict) else None
    if not isinstance(info, dict) or "kind" not in info:
        raise ValueError(f"{source}: no '{MARKER}': {{'kind': ...}} entry; not a diffmm export")
    if info.get("version", VERSION) > VERSION:
        raise ValueError(f"{source}: export version {info['version']} is newer than this diffmm reads ({VERSION})")
    cls = DiffmmHubMixin.kinds.get(info["kind"])
    if cls is None:
        raise ValueError(f"{source}: unknown export kind {info['kind']!r}; expected one of "
                         f"{', '.join(DiffmmHubMixin.kinds)}")
    return cls, cls.config_from_dict({**record.get("config", {}), **overrides}, source=source)


def read_export(folder: Union[str, os.PathLike], **overrides: Any) -> tuple[type, Any, dict[str, torch.Tensor]]:
    """``(model class, config, state dict)`` of an export folder (``overrides``: config fields); a missing file, a
    bad ``config.json`` or a damaged weights file is one error naming it."""
    folder = Path(folder)
    cfg_path, w_path = folder / CONFIG, folder / WEIGHTS
    if not cfg_path.is_file() or not w_path.is_file():
        raise FileNotFoundError(f"{folder}: a diffmm export folder needs {CONFIG} and {WEIGHTS}")
    cls, config = read_record(json.loads(cfg_path.read_text()), source=str(cfg_path), **overrides)
    damage = safetensors_damage(w_path)
    if damage is not None:
        raise DamagedFileError(f"{w_path}: {damage}")
    return cls, config, load_file(str(w_path))


def save_tokenizer_object(tokenizer: Any, folder: Path, model_max_length: Optional[int] = None) -> None:
    """Write a tokenizer that saves itself: ``save_pretrained(folder)`` (transformers tokenizers; diffmm's
    ``ClipBPE``, ``TokenizerFile``, ``CLIPTokenizer`` and ``HFTokenizer``, which also take ``model_max_length``)."""
    save = getattr(tokenizer, "save_pretrained", None)
    if not callable(save):
        raise TypeError(f"tokenizer: a {type(tokenizer).__name__} cannot be written to {folder}; pass a tokenizer "
                        f"with save_pretrained(folder): diffmm's (diffmm.data.load_lm_tokenizer, "
                        f"diffmm.get_tokenizer) or a transformers tokenizer")
    if model_max_length is not None and "model_max_length" in inspect.signature(save).parameters:
        save(str(folder), model_max_length=model_max_length)
    else:
        save(str(folder))


class DiffmmHubMixin(PyTorchModelHubMixin, library_name="diffmm", model_card_template=MODEL_CARD,
                     tags=["diffmm", "differential-attention"]):
    """The hub methods of diffmm's models; a model class sets :attr:`export_kind`, :meth:`config_from_dict` and
    optionally :meth:`write_tokenizer`."""

    #: ``'lm'`` or ``'clip'`` (``config.json``'s ``diffmm_export.kind``)
    export_kind: ClassVar[str]
    #: one line for the model card
    card_description: ClassVar[str] = ""
    #: export kind -> model class (filled as the classes are defined)
    kinds: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "export_kind" in cls.__dict__:
            DiffmmHubMixin.kinds[cls.export_kind] = cls

    @classmethod
    def config_from_dict(cls, config: dict[str, Any], *, source: str) -> Any:
        """The model's config object from ``config.json``'s ``config`` entry."""
        raise NotImplementedError

    def write_tokenizer(self, folder: Path, tokenizer: Any) -> None:
        """Write ``tokenizer`` (None: the model's own, if it knows one) into ``folder``."""
        if tokenizer is not None:
            save_tokenizer_object(tokenizer, folder)

    def save_pretrained(self, save_directory: Union[str, os.PathLike], *, tokenizer: Any = None,
                        **kwargs: Any) -> Optional[str]:
        """Write the diffmm export folder (see :mod:`diffmm.models.hub_mixin`); ``tokenizer`` goes into it too.

        Other keyword arguments are ``huggingface_hub``'s (``push_to_hub``, ``repo_id``, ``model_card_kwargs``,
        ...); the config written is always the model's own (``config=`` is refused).
        """
        if kwargs.get("config") is not None:
            raise ValueError("save_pretrained: config.json holds the model's own config; config= is not accepted")
        with self._saving_tokenizer(tokenizer):
            return super().save_pretrained(save_directory, **kwargs)

    def push_to_hub(self, repo_id: str, *, tokenizer: Any = None, **kwargs: Any) -> str:
        """``huggingface_hub``'s ``push_to_hub`` (needs the network and a token) of the :meth:`save_pretrained`
        folder, ``tokenizer`` included."""
        kwargs.pop("config", None)  # save_pretrained(push_to_hub=True) passes the mixin's; config.json is ours
        with self._saving_tokenizer(tokenizer):
            return super().push_to_hub(repo_id, **kwargs)

    @contextlib.contextmanager
    def _saving_tokenizer(self, tokenizer: Any) -> Iterator[None]:
        """Hold the tokenizer to write while the mixin saves (an outer call's tokenizer stays when None)."""
        outer = self.__dict__.get("_hub_tokenizer")
        self.__dict__["_hub_tokenizer"] = tokenizer if tokenizer is not None else outer
        try:
            yield
        finally:
            self.__dict__["_hub_tokenizer"] = outer

    def _save_pretrained(self, save_directory: Path) -> None:
        """``config.json``, ``model.safetensors`` and the tokenizer in ``save_directory``."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        sd, _ = unique_state_dict(self)
        save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, str(folder / WEIGHTS),
                  metadata={"format": "pt", MARKER: self.export_kind})
        meta = {**model_record(self), "model_type": MODEL_TYPES[self.export_kind],
                "architectures": [type(self).__name__]}
        (folder / CONFIG).write_text(json.dumps(meta, indent=2))
        self.write_tokenizer(folder, self.__dict__.get("_hub_tokenizer"))

    def generate_model_card(self, *args: Any, **kwargs: Any) -> huggingface_hub.ModelCard:
        has_tokenizer = self.__dict__.get("_hub_tokenizer") is not None or self.export_kind == "clip"
        return super().generate_model_card(*args, model_class=type(self).__name__, module=type(self).__module__,
                                           description=self.card_description, tokenizer=has_tokenizer, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], **kwargs: Any):
        """A model from a diffmm export folder, or from ``ORG/REPO`` on the Hugging Face Hub (``huggingface_hub``
        downloads it; its ``revision``, ``token``, ``cache_dir``, ``local_files_only`` ... apply). Other keyword
        arguments: ``map_location``, ``dtype`` and config fields to override (see :meth:`_from_pretrained`).

        A missing local path, or a repository the Hub cannot give, is one ``FileNotFoundError`` naming it.
        """
        name = str(pretrained_model_name_or_path)
        if not os.path.isdir(name) and (os.path.exists(name) or os.path.isabs(name) or name.startswith((".", "~"))
                                        or name.count("/") != 1):
            raise FileNotFoundError(f"{name}: no such folder; expected a diffmm export folder or ORG/REPO on the "
                                    f"Hugging Face Hub")
        try:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        except HUB_ERRORS as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise FileNotFoundError(f"{name}: not a local folder, and the Hugging Face Hub gave none "
                                    f"({type(e).__name__}: {first})") from None

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision: Optional[str], cache_dir: Optional[Union[str, Path]],
                         force_download: bool, local_files_only: bool, token: Union[str, bool, None],
                         config: Any = None, map_location: Union[str, torch.device] = "cpu",
                         dtype: Optional[torch.dtype] = None, **overrides: Any):
        """A model from an export folder or a Hub repository holding one (downloaded by ``huggingface_hub``).

        Args:
            config: what ``huggingface_hub`` read from ``config.json`` (unused: the folder is read here).
            map_location: device of the weights.
            dtype: cast the model after loading.
            overrides: config fields merged into the stored config before building (e.g. ``attn_backend='sdpa'``).
        """
        for older_hub_arg in ("proxies", "resume_download"):  # passed by huggingface_hub < 1.0
            overrides.pop(older_hub_arg, None)
        folder = Path(model_id)
        if not folder.is_dir():
            folder = Path(huggingface_hub.snapshot_download(
                repo_id=model_id, revision=revision, cache_dir=cache_dir, force_download=force_download,
                local_files_only=local_files_only, token=token))
        cls_of_folder, config, state_dict = read_export(folder, **overrides)
        if cls_of_folder is not cls:
            raise ValueError(f"{folder / CONFIG}: a diffmm {cls_of_folder.export_kind!r} export, not a {cls.__name__}; "
                             f"load it with diffmm.load_pretrained")
        model = load_strict(cls(config), state_dict, source=str(folder / WEIGHTS))
        model.to(device=map_location)
        if dtype is not None:
            model.to(dtype)
        return model.eval()
