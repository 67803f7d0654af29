"""Named :class:`~diffmm.models.lm.LMConfig` presets: tiny ones for tests/CPU and the DIFF paper's sizes.

Every size comes as a pair, ``diff-<size>`` and ``transformer-<size>``, identical except for
``attn_type``. ``heads`` always counts the heads of the *standard* Transformer at that width; a
differential layer gets ``heads // 2`` heads of the same head dim (the paper keeps the width and halves the heads).

Paper sizes (DIFF Transformer, arXiv 2410.05258, App. D scaling table). The widths, depths and
DIFF head counts below are as we recall that table; we could not fetch the paper from this
machine. They are cross-checked by arithmetic instead: with SwiGLU hidden 8/3*E, no biases and
one 100288 x E embedding matrix (tiktoken cl100k_base, padded), ``12*E^2*L + 100288*E`` gives
833M / 1.41B / 2.77B / 6.85B / 13.1B, matching the advertised 830M / 1.4B / 2.8B / 6.8B / 13.1B
(``tests/models/test_lm.py`` checks ``param_report()`` of these presets against that). Appendix D
states the Transformer baseline has twice the DIFF heads, which is how ``heads`` is defined here.
The "3B" entry (width 3072, 28 layers, 12 DIFF heads of dim 128, FFN 8192, context 4096) is the
paper's 1T-token model as we recall its description; it is NOT verified (its parameter count comes
out at 3.48B with a tied head, 3.17B without embeddings), so treat it as approximate.
Vocabulary and context of the paper sizes: 100288 and 2048 (section 3.2 trains with 2048 tokens).
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
# Not verified against the paper (see the module docstring).
_3B = dict(vocab_size=_PAPER_VOCAB, context_length=4096, layers=28, width=3072, heads=24, intermediate_size=8192)
LM_CONFIGS["diff-3b"] = dict(_3B, attn_type="diff")
LM_CONFIGS["transformer-3b"] = dict(_3B, attn_type="standard")


def list_lm_configs() -> list[str]:
    """Names accepted by :meth:`LMConfig.from_name`."""
    return sorted(LM_CONFIGS)
