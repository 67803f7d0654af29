"""Building blocks: attention layers (differential and standard), norms, MLPs, RoPE, KV cache."""
from diffmm.nn.attention import Attention
from diffmm.nn.attention_layer import ATTENTION_LAYERS, UPCYCLE_TYPES, AttentionLayer, QKMaps, StdAttnWeights
from diffmm.nn.diff_attention import DiffAttention
from diffmm.nn.diff_v2_attention import DiffV2Attention
from diffmm.nn.factory import create_attention, get_attention_class
from diffmm.nn.kv_cache import KVCache
from diffmm.nn.lambdas import lambda_init_depth, resolve_lambda_init
from diffmm.nn.mlp import QuickGELU, SwiGLU, create_act
from diffmm.nn.norm import LayerNorm, RMSNorm
from diffmm.nn.param_count import attention_param_report
from diffmm.nn.rope import RotaryEmbedding, apply_rope, rotate_half
from diffmm.nn.upcycled_diff_attention import UpcycledDiffAttention
from diffmm.nn import ablations  # noqa: E402,F401  (registers the ablation attention types: docs/attention.md)

__all__ = ["Attention", "AttentionLayer", "DiffAttention", "DiffV2Attention", "UpcycledDiffAttention",
           "ATTENTION_LAYERS", "UPCYCLE_TYPES", "QKMaps", "StdAttnWeights", "create_attention",
           "get_attention_class", "KVCache", "attention_param_report", "lambda_init_depth", "resolve_lambda_init",
           "QuickGELU", "SwiGLU", "create_act", "LayerNorm", "RMSNorm", "RotaryEmbedding", "apply_rope",
           "rotate_half"]
