"""The DIFF decoder language model (DIFF Transformer, arXiv 2410.05258) and its standard-attention twin.

nanoGPT-style: one flat config, pre-RMSNorm blocks ``x += attn(norm(x)); x += SwiGLU(norm(x))``,
no biases, RoPE on every d-wide query/key component, final RMSNorm, tied or untied LM head.
``LMConfig.attn_type`` picks the attention layer (``'diff'``, ``'standard'`` or any key of
``diffmm.nn.ATTENTION_LAYERS``); every other line is shared by the DIFF model and its baseline. The config
speaks the CLIP configs' (open_clip's) vocabulary: ``width``, ``heads``, ``layers``, ``context_length``,
``attn_type``; nanoGPT's old keys (:data:`RENAMED_KEYS`) are still read, with a ``FutureWarning``.

    >>> model = DiffLM(LMConfig.from_name("diff-tiny"))
    >>> logits, loss = model(idx, targets)                  # idx, targets: (B, T) long
    >>> out = model.generate(idx, 32, top_k=50, generator=torch.Generator().manual_seed(0))
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffmm.models.hub_mixin import DiffmmHubMixin, save_tokenizer_object
from diffmm.models.lm_configs import LM_CONFIGS
from diffmm.nn import KVCache, RMSNorm, RotaryEmbedding, SwiGLU, create_attention, get_attention_class
from diffmm.ops.linear_cross_entropy import linear_cross_entropy

#: LMConfig keys before LM and CLIP configs shared one vocabulary (nanoGPT's) -> today's (open_clip's, as the CLIP
#: configs). The old keys are still read, with a FutureWarning; the old attribute names are read-only aliases.
RENAMED_KEYS = {"block_size": "context_length", "n_layer": "layers", "n_embd": "width", "n_head": "heads",
                "n_kv_head": "kv_heads", "attention": "attn_type"}


def rename_keys(d: dict[str, Any], *, source: str = "LMConfig") -> dict[str, Any]:
    """``d`` with the old keys of :data:`RENAMED_KEYS` renamed, each with a one-line ``FutureWarning``."""
    out = dict(d)
    for old, new in RENAMED_KEYS.items():
        if old in out:
            if new in out:
                raise ValueError(f"{source}: give {new!r} or its old name {old!r}, not both")
            warnings.warn(f"{source}: config key {old!r} is deprecated; use {new!r}", FutureWarning, stacklevel=3)
            out[new] = out.pop(old)
    return out


def swiglu_hidden(width: int, multiple_of: int) -> int:
    """SwiGLU hidden size: ``8/3 * width`` rounded up to a multiple of ``multiple_of``."""
    hidden = math.ceil(8 * width / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclass
class LMConfig:
    """Flat config of :class:`DiffLM`.

    Attributes:
        vocab_size: token vocabulary.
        context_length: maximum sequence length (prompt + generated tokens; RoPE positions).
        layers: decoder blocks.
        width: width E.
        heads: heads of the STANDARD Transformer at this width (head dim = E / heads). A
            differential layer gets ``heads // 2`` heads, each with two query/key components of that dim.
        kv_heads: kv heads of the standard Transformer (GQA); None = heads. Halved for diff layers.
        attn_type: ``'diff'`` | ``'standard'`` | any key of ``diffmm.nn.ATTENTION_LAYERS``.
        lambda_init: ``'depth'`` (paper: 0.8 - 0.6 exp(-0.3 l)), ``'constant'`` (0.8) or a number.
        lambda_std: std of the normal init of the lambda vectors.
        intermediate_size: SwiGLU hidden size; None = 8/3*E rounded up to a multiple of ``mlp_multiple_of``.
        mlp_multiple_of: rounding of the default SwiGLU hidden size (64: E=128 -> 384, E=2048 -> 5504).
        rope_theta: RoPE base.
        norm_eps: eps of every RMSNorm (block norms, final norm, per-head norm of diff layers).
        tie_embeddings: share the token embedding with the LM head.
        init_std: std of the normal init of every Linear/Embedding weight; the residual output
            projections (attention ``out_proj``, MLP ``down_proj``) use ``init_std / sqrt(2 * layers)`` (GPT-2).
        attn_backend: ``diffmm.ops`` backend of every attention layer; None = env / automatic.
    """

    vocab_size: int = 50304
    context_length: int = 1024
    layers: int = 12
    width: int = 768
    heads: int = 12
    kv_heads: Optional[int] = None
    attn_type: str = "diff"
    lambda_init: Union[str, float] = "depth"
    lambda_std: float = 0.1
    intermediate_size: Optional[int] = None
    mlp_multiple_of: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    attn_backend: Optional[str] = None

    def __post_init__(self):
        if self.kv_heads is None:
            self.kv_heads = self.heads
        for name in ("vocab_size", "context_length", "layers", "width", "heads", "kv_heads", "mlp_multiple_of"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LMConfig.{name} must be a positive int; got {value!r}")
        if self.intermediate_size is not None and (not isinstance(self.intermediate_size, int)
                                                   or self.intermediate_size <= 0):
            raise ValueError(f"LMConfig.intermediate_size must be a positive int or None; "
                             f"got {self.intermediate_size!r}")
        if self.width % self.heads:
            raise ValueError(f"LMConfig: width {self.width} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"LMConfig: heads {self.heads} is not divisible by kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LMConfig: RoPE needs an even head dim; width / heads = {self.head_dim}")
        r = get_attention_class(self.attn_type).head_ratio
        if r > 1 and (self.heads % r or self.kv_heads % r):
            raise ValueError(f"LMConfig: attn_type {self.attn_type!r} divides the heads by {r}; heads {self.heads} "
                             f"and kv_heads {self.kv_heads} must be divisible by {r}")
        if isinstance(self.lambda_init, str) and self.lambda_init not in ("depth", "constant"):
            raise ValueError(f"LMConfig.lambda_init {self.lambda_init!r} is unknown; expected 'depth', "
                             f"'constant' or a number")
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ValueError(f"LMConfig: norm_eps, init_std and rope_theta must be > 0; got {self.norm_eps}, "
                             f"{self.init_std}, {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        """Head dim of the standard Transformer = component dim d of the differential layer."""
        return self.width // self.heads

    @property
    def mlp_hidden(self) -> int:
        return self.intermediate_size or swiglu_hidden(self.width, self.mlp_multiple_of)

    @classmethod
    def from_name(cls, name: str, **overrides) -> "LMConfig":
        """A named preset (``diffmm.models.lm_configs.list_lm_configs()``), optionally overridden."""
        if name not in LM_CONFIGS:
            raise ValueError(f"unknown LM config {name!r}; expected one of {', '.join(sorted(LM_CONFIGS))}")
        return cls.from_dict({**LM_CONFIGS[name], **rename_keys(overrides, source=f"LMConfig {name!r}")})

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "LMConfig") -> "LMConfig":
        """Build from a dict (old keys renamed with a warning); unknown keys are an error naming them."""
        d = rename_keys(d, source=source)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{source}: unknown LMConfig field(s) {', '.join(unknown)}; expected some of "
                             f"{', '.join(sorted(known))}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.wraps(LMConfig.__init__)
def _init_renaming_old_keys(self, *args, **kwargs):
    _dataclass_init(self, *args, **rename_keys(kwargs))


_dataclass_init = LMConfig.__init__
LMConfig.__init__ = _init_renaming_old_keys
for _old, _new in RENAMED_KEYS.items():
    setattr(LMConfig, _old, property(lambda self, _n=_new: getattr(self, _n), doc=f"Deprecated: ``{_new}``."))


class Block(nn.Module):
    """Pre-norm decoder block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, cfg: LMConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.attn = create_attention(cfg.attn_type, cfg.width, cfg.heads, num_kv_heads=cfg.kv_heads,
                                     layer_idx=layer_idx, lambda_init=cfg.lambda_init, lambda_std=cfg.lambda_std,
                                     causal=True, use_rope=True, norm_eps=cfg.norm_eps, backend=cfg.attn_backend)
        self.mlp_norm = RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.width, cfg.mlp_hidden)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn_mask: Optional[torch.Tensor],
                kv_cache: Optional[KVCache]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope=rope, attn_mask=attn_mask, kv_cache=kv_cache)
        return x + self.mlp(self.mlp_norm(x))


class DiffLM(nn.Module, DiffmmHubMixin, paper_url="https://arxiv.org/abs/2410.05258", pipeline_tag="text-generation"):
    """Decoder-only LM with differential (or standard) attention.

    Parameters: ``wte`` (token embedding), ``blocks.{i}.{attn_norm, attn, mlp_norm, mlp}``, ``norm``
    (final RMSNorm), ``lm_head`` (shares ``wte.weight`` when ``tie_embeddings``).

    ``save_pretrained(folder, tokenizer=...)`` / ``from_pretrained`` / ``push_to_hub``: diffmm's export folder
    (:mod:`diffmm.models.hub_mixin`); the tokenizer is written only when given.
    """

    export_kind = "lm"
    card_description = "a decoder-only language model with differential or standard attention"

    @classmethod
    def config_from_dict(cls, config: dict[str, Any], *, source: str) -> LMConfig:
        return LMConfig.from_dict(config, source=source)

    def write_tokenizer(self, folder: Path, tokenizer: Any) -> None:
        """``tokenizer`` (diffmm's ``ClipBPE`` / ``TokenizerFile``, or a transformers tokenizer), if given;
        ``model_max_length`` = ``context_length`` for diffmm's."""
        if tokenizer is not None:
            save_tokenizer_object(tokenizer, folder, model_max_length=self.config.context_length)

    def __init__(self, config: LMConfig):
        super().__init__()
        if not isinstance(config, LMConfig):
            raise TypeError(f"DiffLM needs an LMConfig; got {type(config).__name__}")
        self.config = cfg = config
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.layers)])
        self.norm = RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, theta=cfg.rope_theta)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for Linear/Embedding weights, init_std/sqrt(2L) for residual outputs.

        Norm weights stay 1 and lambda vectors keep their N(0, lambda_std) draw from the attention layer.
        """
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        resid_std = std / math.sqrt(2 * self.config.layers)
        for block in self.blocks:
            for proj in (getattr(block.attn, "out_proj", None), block.mlp.down_proj):
                if proj is not None:
                    nn.init.normal_(proj.weight, mean=0.0, std=resid_std)

    # ----------------------------------------------------------------------------------- forward
    def new_kv_caches(self, max_len: Optional[int] = None) -> list[KVCache]:
        """One preallocated (on first use) :class:`~diffmm.nn.KVCache` per layer, ``max_len`` positions."""
        max_len = max_len or self.config.context_length
        if max_len > self.config.context_length:
            raise ValueError(f"KV cache of {max_len} positions exceeds context_length {self.config.context_length}")
        return [KVCache(max_len) for _ in self.blocks]

    def forward_hidden(self, idx: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                       kv_caches: Optional[list[KVCache]] = None, start_pos: int = 0) -> torch.Tensor:
        """Final-norm hidden states (B, T, E); arguments as in :meth:`forward`."""
        if idx.dim() != 2 or idx.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
            raise ValueError(f"idx has shape {tuple(idx.shape)} and dtype {idx.dtype}; expected (B, T) integer ids")
        B, T = idx.shape
        if start_pos + T > self.config.context_length:
            raise ValueError(f"positions {start_pos}..{start_pos + T - 1} exceed context_length "
                             f"{self.config.context_length}")
        if kv_caches is not None:
            if len(kv_caches) != len(self.blocks):
                raise ValueError(f"kv_caches has {len(kv_caches)} entries; expected one per layer ({len(self.blocks)})")
            if kv_caches[0].length != start_pos:
                raise ValueError(f"start_pos {start_pos} != {kv_caches[0].length} positions already in the KV cache")
        elif start_pos:
            raise ValueError(f"start_pos={start_pos} needs kv_caches holding the earlier positions")
        if attn_mask is not None and (attn_mask.dtype != torch.bool or tuple(attn_mask.shape) != (B, start_pos + T)):
            raise ValueError(f"attn_mask has shape {tuple(attn_mask.shape)} and dtype {attn_mask.dtype}; expected "
                             f"bool key padding (B, start_pos + T) = ({B}, {start_pos + T})")
        rope = self.rope.range(start_pos, T)  # cos, sin: (T, 1, head_dim) fp32
        x = self.wte(idx)  # (B, T, E)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, attn_mask, kv_caches[i] if kv_caches is not None else None)
        return self.norm(x)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                attn_mask: Optional[torch.Tensor] = None, kv_caches: Optional[list[KVCache]] = None,
                start_pos: int = 0, return_logits: bool = True):
        """Next-token logits, and the loss when ``targets`` is given.

        Args:
            idx: (B, T) token ids at positions ``start_pos .. start_pos + T - 1``.
            targets: (B, T) next-token ids; -100 = ignore.
            attn_mask: bool key padding (B, start_pos + T), True where the token takes part (causal
                masking is always applied on top).
            kv_caches: one :class:`~diffmm.nn.KVCache` per layer (see :meth:`new_kv_caches`); this
                call appends its keys/values and attends over everything cached.
            start_pos: position of ``idx[:, 0]``; must equal the number of cached positions.
            return_logits: with ``targets``, False skips the (B, T, vocab) logits: the head and the loss run fused
                by chunks (:func:`diffmm.ops.linear_cross_entropy`, the fast training path) and logits is None.

        Returns:
            logits (B, T, vocab) when ``targets`` is None, else ``(logits, loss)`` (mean cross entropy, fp32).
        """
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets has shape {tuple(targets.shape)}; expected {tuple(idx.shape)} like idx")
        hidden = self.forward_hidden(idx, attn_mask=attn_mask, kv_caches=kv_caches, start_pos=start_pos)  # (B, T, E)
        if targets is not None and not return_logits:
            return None, linear_cross_entropy(hidden, self.lm_head.weight, targets, ignore_index=-100)
        logits = self.lm_head(hidden)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        return logits, loss

    # --------------------------------------------------------------------------------- generate
    @torch.inference_mode()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, *, greedy: bool = False,
                 generator: Optional[torch.Generator] = None, eos_id: Optional[int] = None) -> torch.Tensor:
        """Continue ``idx`` (B, T) by ``max_new_tokens`` tokens using a KV cache per layer.

        Args:
            temperature: logits are divided by it; 0 means greedy.
            top_k: sample among the k most likely tokens.
            top_p: nucleus sampling: the smallest set of tokens whose probability reaches top_p.
            greedy: take the argmax (ignores temperature, top_k, top_p).
            generator: a seeded ``torch.Generator`` (on idx's device) for reproducible sampling.
            eos_id: stop once every row has produced it (rows that finished keep emitting eos_id).

        Returns:
            (B, T + n) ids, n <= max_new_tokens.
        """
        B, T = idx.shape
        if max_new_tokens <= 0:
            return idx
        if T + max_new_tokens > self.config.context_length:
            raise ValueError(f"prompt {T} + max_new_tokens {max_new_tokens} exceeds context_length "
                             f"{self.config.context_length}")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k must be positive; got {top_k}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {top_p}")
        caches = self.new_kv_caches(T + max_new_tokens)
        out, pos, step = idx, 0, idx
        done = torch.zeros(B, dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            hidden = self.forward_hidden(step, kv_caches=caches, start_pos=pos)  # (B, t, E)
            logits = self.lm_head(hidden[:, -1]).float()  # (B, vocab)
            pos += step.shape[1]
            nxt = sample_next(logits, temperature=0.0 if greedy else temperature, top_k=top_k, top_p=top_p,
                              generator=generator)  # (B, 1)
            if eos_id is not None:
                nxt = torch.where(done[:, None], torch.full_like(nxt, eos_id), nxt)
                done |= nxt[:, 0] == eos_id
            out = torch.cat([out, nxt], dim=1)
            step = nxt
            if eos_id is not None and bool(done.all()):
                break
        return out

    # ---------------------------------------------------------------------------------- report
    def param_report(self) -> dict[str, int]:
        """Parameter counts: embedding (token embedding + untied head), attention, mlp, norm, total, non_embedding.

        Tied weights count once. Works on a model built on the ``meta`` device.
        """
        seen: set[int] = set()

        def count(params) -> int:
            n = 0
            for p in params:
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
            return n

        rep = {"embedding": count([self.wte.weight, self.lm_head.weight])}
        rep["attention"] = count(p for b in self.blocks for p in b.attn.parameters())
        rep["mlp"] = count(p for b in self.blocks for p in b.mlp.parameters())
        rep["norm"] = count(p for m in self.modules() if isinstance(m, RMSNorm) for p in m.parameters())
        rep["other"] = count(self.parameters())
        rep["total"] = sum(rep.values())
        rep["non_embedding"] = rep["total"] - rep["embedding"]
        if not rep["other"]:
            del rep["other"]
        return rep

    def format_param_report(self) -> str:
        """:meth:`param_report` as an aligned two-column table."""
        rep = self.param_report()
        return "\n".join(f"{k:<14}{v:>16,}" for k, v in rep.items())


def sample_next(logits: torch.Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids (B, 1) from logits (B, vocab): argmax if temperature == 0, else filtered sampling."""
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) >= top_p  # tokens after the nucleus is already full
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)
