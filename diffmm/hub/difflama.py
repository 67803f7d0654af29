"""HF transformers ``DiffLlamaForCausalLM`` <-> :class:`diffmm.models.lm.DiffLM`.

Both implement the differential attention of the DIFF Transformer (arXiv 2410.05258) in a Llama decoder.

Layout differences handled here (E width, h differential heads, h_kv kv heads, d component dim):

- DiffLlama counts component heads: ``num_attention_heads = 2h``, ``num_key_value_heads = 2h_kv``,
  ``head_dim = d``; that is exactly diffmm's ``n_head`` / ``n_kv_head`` (standard-Transformer heads).
- Block vs interleaved components: DiffLlama's head i uses query components i and i+h (keys g and
  g+h_kv); diffmm's uses 2i and 2i+1 (keys 2g, 2g+1). Rows of q/k are permuted by
  ``W.view(n, 2, d, E).transpose(0, 1)``. The value of kv group g is diffmm's ``v_proj`` rows
  ``[g*2d, (g+1)*2d)``; DiffLlama keeps its halves as value heads g and g+h_kv: the same permutation.
- Both use NeoX ``rotate_half`` RoPE on each d-wide component, so no RoPE permutation is needed.
- DiffLlama's per-head RMSNorm has no weight: diffmm's weight g is folded into the ``o_proj``
  columns, ``o_proj = out_proj * g.repeat(h)[None, :]``. Importing gives ``g = 1`` and
  ``out_proj = o_proj``, so DiffLlama -> diffmm -> DiffLlama is bit-exact; diffmm -> DiffLlama ->
  diffmm is exact as a function (g moves into ``out_proj``; bit-exact when g is all ones).
- lambda: same formula; transformers' ``lambda_init = 0.8 - 0.6 * exp(-0.3 * layer_idx)`` (0-based) is diffmm's
  ``lambda_init='depth'``. Models with another lambda_init cannot be exported (one-line error).
- Unsupported in both directions (one-line errors): biases, a non-SiLU MLP, RoPE scaling, standard attention.

Files: a DiffLlama folder is ``config.json`` (``model_type: diffllama``) plus ``model.safetensors`` or shards listed
by ``model.safetensors.index.json`` (``diffmm.load_pretrained(folder)`` reads it); an export with a tokenizer also
holds its files, so ``AutoTokenizer.from_pretrained(folder)`` and lm-eval's ``--model hf`` work on it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from diffmm.hub.checkpoint import load_state_file
from diffmm.models.weights import check_state_dict
from diffmm.models.hub_mixin import save_tokenizer_object
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.nn.lambdas import lambda_init_depth, resolve_lambda_init

MODEL_TYPE = "diffllama"
INDEX_FILE = "model.safetensors.index.json"
# Keys some older Llama-family checkpoints persist; they carry no weights (recomputed) and are ignored.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ------------------------------------------------------------------------------------------ layout
def interleaved_to_blocks(w: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """Rows (n, 2, d) -> (2, n, d): diffmm's component order -> DiffLlama's. w: (2*n*d, ...)."""
    return w.reshape(n, 2, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def blocks_to_interleaved(w: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_blocks`."""
    return w.reshape(2, n, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _check_exportable(cfg) -> None:
    if cfg.attention != "diff":
        raise ValueError(f"DiffLlama holds differential attention only; this LM has attention={cfg.attention!r}")
    for i in range(cfg.n_layer):
        ours = resolve_lambda_init(cfg.lambda_init, i)
        if abs(ours - lambda_init_depth(i)) > 1e-12:
            raise ValueError(f"DiffLlama fixes lambda_init to 0.8 - 0.6*exp(-0.3*layer); this LM has "
                             f"lambda_init={cfg.lambda_init!r} (layer {i}: {ours:.4g})")


# ------------------------------------------------------------------------------------------ config
def lm_config_to_hf(cfg) -> dict[str, Any]:
    """``config.json`` contents of a ``DiffLlamaForCausalLM`` equivalent to ``cfg`` (an LMConfig)."""
    _check_exportable(cfg)
    return {
        "architectures": ["DiffLlamaForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "lambda_std_dev": cfg.lambda_std,
        "dtype": "float32",
    }


def hf_to_lm_config(hf: dict[str, Any], *, source: str = "config.json", **overrides):
    """An LMConfig from a DiffLlama ``config.json`` dict; unsupported settings are one-line errors."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{source}: model_type {hf.get('model_type')!r}; expected {MODEL_TYPE!r}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise ValueError(f"{source}: missing field {key!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r} is unsupported; expected 'silu' (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{source}: {key}=true is unsupported; diffmm LMs have no biases")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(f"{source}: rope_type {rope_type!r} is unsupported; expected 'default'")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise ValueError(f"{source}: head_dim {head_dim} * num_attention_heads {heads} != hidden_size "
                         f"{hf['hidden_size']}; diffmm needs them equal")
    kw = dict(vocab_size=hf["vocab_size"], context_length=hf.get("max_position_embeddings", 2048),
              layers=hf["num_hidden_layers"], width=hf["hidden_size"], heads=heads,
              kv_heads=hf.get("num_key_value_heads") or heads, attn_type="diff", lambda_init="depth",
              intermediate_size=hf["intermediate_size"], rope_theta=float(theta),
              norm_eps=float(hf.get("rms_norm_eps", 1e-5)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
              init_std=float(hf.get("initializer_range", 0.02)), lambda_std=float(hf.get("lambda_std_dev", 0.1)))
    kw.update(overrides)
    try:
        return LMConfig(**kw)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


# ------------------------------------------------------------------------------------- state dicts
#: per-layer keys (diffmm, DiffLlama) and the q/k/v rows permuted between them (``'q'``: h heads, ``'kv'``: h_kv)
_LAYER_KEYS = [("attn_norm.weight", "input_layernorm.weight", None),
               ("mlp_norm.weight", "post_attention_layernorm.weight", None),
               ("attn.q_proj.weight", "self_attn.q_proj.weight", "q"),
               ("attn.k_proj.weight", "self_attn.k_proj.weight", "kv"),
               ("attn.v_proj.weight", "self_attn.v_proj.weight", "kv"),
               ("attn.out_proj.weight", "self_attn.o_proj.weight", None)]
_LAYER_KEYS += [(f"mlp.{n}.weight", f"mlp.{n}.weight", None) for n in ("gate_proj", "up_proj", "down_proj")]
_LAYER_KEYS += [(f"attn.{n}", f"self_attn.{n}", None) for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")]


def _convert(sd: dict[str, torch.Tensor], cfg, to_hf: bool) -> dict[str, torch.Tensor]:
    """The per-layer keys of :data:`_LAYER_KEYS` renamed (and q/k/v rows permuted) one way or the other."""
    heads = {"q": cfg.n_head // 2, "kv": cfg.n_kv_head // 2}
    permute = interleaved_to_blocks if to_hf else blocks_to_interleaved
    out = {}
    for i in range(cfg.n_layer):
        for ours, theirs, rows in _LAYER_KEYS:
            src, dst = (f"blocks.{i}.{ours}", f"model.layers.{i}.{theirs}")[::1 if to_hf else -1]
            out[dst] = permute(sd[src], heads[rows], cfg.head_dim) if rows else sd[src]
    return out


def to_difflama(state_dict: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """diffmm DiffLM state dict -> DiffLlama state dict (see the module docstring for the mapping)."""
    _check_exportable(cfg)
    sd = state_dict
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["norm.weight"],
           **_convert(sd, cfg, to_hf=True)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layer):  # the per-head norm's weight g goes into o_proj's columns
        g = sd[f"blocks.{i}.attn.diff_norm.weight"]
        out[f"model.layers.{i}.self_attn.o_proj.weight"] = out[f"model.layers.{i}.self_attn.o_proj.weight"] * \
            g.repeat(cfg.n_head // 2)[None, :]
    return {k: v.contiguous() for k, v in out.items()}


def from_difflama(state_dict: dict[str, torch.Tensor], cfg, *, source: str = "DiffLlama state dict"
                  ) -> dict[str, torch.Tensor]:
    """DiffLlama state dict -> diffmm DiffLM state dict (per-head norm weight 1, ``o_proj`` kept as ``out_proj``).

    Missing, unexpected or mis-shaped keys raise one ``KeyError`` naming them (no partial loads).
    """
    sd = {k: v for k, v in state_dict.items() if not k.endswith(_IGNORED_SUFFIXES)}
    with torch.device("meta"):  # the keys, shapes and dtype kinds a DiffLlama of cfg has, without its memory
        expected = to_difflama(DiffLM(cfg).state_dict(), cfg)
    if cfg.tie_embeddings and "lm_head.weight" in sd:  # some exporters store the tied head as well
        head = sd.pop("lm_head.weight")
        emb = sd.get("model.embed_tokens.weight")
        if emb is not None and (head.shape != emb.shape or not torch.equal(head, emb)):
            raise KeyError(f"{source}: lm_head.weight differs from model.embed_tokens.weight but "
                           f"tie_word_embeddings is true")
    check_state_dict(sd, expected, source=source)
    emb = sd["model.embed_tokens.weight"]
    out = {"wte.weight": emb, "norm.weight": sd["model.norm.weight"],
           "lm_head.weight": emb if cfg.tie_embeddings else sd["lm_head.weight"], **_convert(sd, cfg, to_hf=False)}
    for i in range(cfg.n_layer):
        out[f"blocks.{i}.attn.diff_norm.weight"] = torch.ones(2 * cfg.head_dim, dtype=emb.dtype, device=emb.device)
    return out


# ------------------------------------------------------------------------------------------- files
def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def load_state_file_folder(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a folder: the shards ``model.safetensors.index.json`` lists, else all ``*.safetensors``."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: shard listed in {INDEX_FILE} does not exist")
        part = load_state_file(path)
        dup = sorted(set(part) & set(sd))
        if dup:
            raise KeyError(f"{path}: keys already in another shard: {', '.join(dup[:8])}")
        sd.update(part)
    return sd


def save_difflama(model, folder: str | os.PathLike, *, dtype: Optional[torch.dtype] = None,
                  tokenizer=None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``DiffLlamaForCausalLM.from_pretrained(folder)`` loads.

    Args:
        model: a :class:`~diffmm.models.lm.DiffLM` with ``attention='diff'`` and depth lambda_init.
        dtype: cast floating tensors (default: keep).
        tokenizer: the LM's tokenizer (an object with ``save_pretrained(folder)``, ``vocab_size`` and ``eos_id``:
            ``ClipBPE``, ``TokenizerFile``; :func:`~diffmm.data.tokenizers.load_lm_tokenizer` reads one from
            ``clip`` or a path); its files are written too, and its eos id goes into ``config.json``.
    """
    cfg = model.config
    hf_config = lm_config_to_hf(cfg)
    n_tokens = getattr(tokenizer, "vocab_size", None)
    if n_tokens is not None and n_tokens > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {n_tokens} tokens, more than the model's vocab_size {cfg.vocab_size}")
    sd = to_difflama({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    hf_config["dtype"] = str(next(iter(sd.values())).dtype).replace("torch.", "")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:  # first: a tokenizer that cannot write itself is an error before any weights are written
        save_tokenizer_object(tokenizer, folder, model_max_length=cfg.block_size)
        hf_config["eos_token_id"] = tokenizer.eos_id
    save_file({k: v.cpu().contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with open(folder / "config.json", "w") as f:
        json.dump(hf_config, f, indent=2)
    return folder
