"""Named :class:`~diffmm.models.lm.LMConfig` presets (:data:`LM_CONFIGS`, :func:`list_lm_configs`).

Every size comes as a pair, ``diff-<size>`` and ``transformer-<size>``, identical except for ``attn_type``. ``heads``
counts the heads of the *standard* Transformer at that width; a differential layer gets ``heads // 2`` heads of the
same head dim (the width stays, the heads halve). ``tiny``, ``tiny-gqa`` and ``cpu-small`` are for tests and CPUs;
``830m``, ``1.4b``, ``2.8b``, ``6.8b``, ``13.1b`` and ``3b`` are sized after the DIFF Transformer paper's models
(arXiv 2410.05258), with a 100288-token vocabulary and 2048-token context (``3b``: 4096, SwiGLU hidden 8192);
docs/lm.md lists them with their parameter counts and says where the sizes come from and how far they are checked.
"""
from __future__ import annotations

from typing import Any

# Tiny/CPU presets. Vocab sizes: 'tiny' fits byte-level tests, 'cpu-small' a local 4k BPE.
_SMALL: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, context_length=64, layers=2, width=64, heads=4),
    "tiny-gqa": dict(vocab_size=256, context_length=64, layers=2, width=64, heads=4, kv_heads=2),
    "cpu-small": dict(vocab_size=4096, context_length=128, layers=4, width=192, heads=6),
}

# DIFF paper sizes: (width E, layers L, DIFF heads h). heads (standard) = 2h; head dim = E / (2h).
_PAPER: dict[str, tuple[int, int, int]] = {
    "830m": (1536, 24, 8),
    "1.4b": (2048, 24, 8),
    "2.8b": (2560, 32, 10),
    "6.8b": (4096, 32, 16),
    "13.1b": (5120, 40, 20),
}
_PAPER_VOCAB = 100288
_PAPER_CONTEXT = 2048

LM_CONFIGS: dict[str, dict[str, Any]] = {}
for _size, _kw in _SMALL.items():
    LM_CONFIGS[f"diff-{_size}"] = dict(_kw, attn_type="diff")
    LM_CONFIGS[f"transformer-{_size}"] = dict(_kw, attn_type="standard")
for _size, (_E, _L, _h) in _PAPER.items():
    _kw = dict(vocab_size=_PAPER_VOCAB, context_length=_PAPER_CONTEXT, layers=_L, width=_E, heads=2 * _h)
    LM_CONFIGS[f"diff-{_size}"] = dict(_kw, attn_type="diff")
    LM_CONFIGS[f"transformer-{_size}"] = dict(_kw, attn_type="standard")
# the paper's 3B model (docs/lm.md: its sizes are not verified)
_3B = dict(vocab_size=_PAPER_VOCAB, context_length=4096, layers=28, width=3072, heads=24, intermediate_size=8192)
LM_CONFIGS["diff-3b"] = dict(_3B, attn_type="diff")
LM_CONFIGS["transformer-3b"] = dict(_3B, attn_type="standard")


def list_lm_configs() -> list[str]:
    """Names accepted by :meth:`LMConfig.from_name`."""
    return sorted(LM_CONFIGS)
