"""Throwaway wrapper around scripts/compare_lm_variants.py for ablations that need a monkeypatch.

    python results/lm_v1_study/tools/ablate.py --no-subnorm [compare_lm_variants args...]

--std-subnorm: standard attention gets V1's head epilogue (parameter-free per-head RMSNorm * (1 - lambda_init)).
--epilogue-scale S: replace the (1 - lambda_init) factor after the per-head norm by S ('depth' = 1 - lambda_init_depth(l),
    or a number), without changing lambda itself (applies to V1 and to --std-subnorm).
--subnorm-eps X: eps of V1's per-head RMSNorm (default 1e-5).
--no-subnorm: DIFF V1 layers skip the per-head RMSNorm and the (1 - lambda_init) factor, i.e. the head
output is the raw (A1 - lambda A2) V (what standard attention's A V is to it). Library code is untouched;
the patch lives in this process only.
"""
import importlib.util, json, sys
sys.path.insert(0, "/work/main")
import torch
from diffmm.nn.diff_attention import DiffAttention
from diffmm.nn.rope import apply_rope
from diffmm.ops import diff_attention

def forward_no_subnorm(self, x, *, attn_mask=None, rope=None, kv_cache=None, causal=None):
    B, N, _ = x.shape
    h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
    q = self.q_proj(x).view(B, N, 2 * h, d)
    k = self.k_proj(x).view(B, N, 2 * hk, d)
    v = self.v_proj(x).view(B, N, hk, 2 * d)
    if self.use_rope:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out = diff_attention(q, k, v, self.lambda_full(), causal=self.causal if causal is None else causal,
                         attn_mask=attn_mask, backend=self.backend)
    return self.out_proj(out.reshape(B, N, 2 * h * d))

from diffmm.nn.attention import Attention
from diffmm.nn.lambdas import lambda_init_depth
from diffmm.ops import attention as std_attention
import torch.nn.functional as F

def forward_std_subnorm(self, x, *, attn_mask=None, rope=None, kv_cache=None, causal=None):
    """Standard attention + V1's head epilogue: parameter-free per-head RMSNorm * (1 - lambda_init(depth))."""
    B, N, _ = x.shape
    H, Hk, d = self.num_heads, self.num_kv_heads, self.head_dim
    q = self.q_proj(x).view(B, N, H, d)
    k = self.k_proj(x).view(B, N, Hk, d)
    v = self.v_proj(x).view(B, N, Hk, d)
    if self.use_rope:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out = std_attention(q, k, v, causal=self.causal if causal is None else causal, attn_mask=attn_mask,
                        backend=self.backend)
    out = F.rms_norm(out.float(), (d,), eps=1e-5) * epi_scale(self.layer_idx, 1 - lambda_init_depth(self.layer_idx))
    return self.out_proj(out.to(x.dtype).reshape(B, N, H * d))

EPI = None  # None: each layer's own (1 - lambda_init); 'depth': 1 - lambda_init_depth(l); a number: that number

def epi_scale(layer_idx, own):
    if EPI is None:
        return own
    return 1 - lambda_init_depth(layer_idx) if EPI == "depth" else float(EPI)

def forward_epilogue(self, x, *, attn_mask=None, rope=None, kv_cache=None, causal=None):
    """DiffAttention.forward with the (1 - lambda_init) factor of the head epilogue replaced by epi_scale."""
    B, N, _ = x.shape
    h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
    q = self.q_proj(x).view(B, N, 2 * h, d)
    k = self.k_proj(x).view(B, N, 2 * hk, d)
    v = self.v_proj(x).view(B, N, hk, 2 * d)
    if self.use_rope:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out = diff_attention(q, k, v, self.lambda_full(), causal=self.causal if causal is None else causal,
                         attn_mask=attn_mask, norm_weight=self.diff_norm.weight, lambda_init=self.lambda_init,
                         eps=self.diff_norm.eps, backend=self.backend)
    out = out * (epi_scale(self.layer_idx, 1 - self.lambda_init) / (1 - self.lambda_init))
    return self.out_proj(out.reshape(B, N, 2 * h * d))

argv = sys.argv[1:]
tag = []
if "--epilogue-scale" in argv:
    i = argv.index("--epilogue-scale"); EPI = argv[i + 1]; del argv[i:i + 2]
    if EPI != "depth":
        float(EPI)
    DiffAttention.forward = forward_epilogue
    tag.append(f"epilogue_scale={EPI}")
if "--std-subnorm" in argv:
    argv.remove("--std-subnorm")
    Attention.forward = forward_std_subnorm
    tag.append("std_subnorm")
if "--subnorm-eps" in argv:
    i = argv.index("--subnorm-eps"); eps = float(argv[i + 1]); del argv[i:i + 2]
    _init = DiffAttention.__init__
    def _init_eps(self, *a, **k):
        _init(self, *a, **k)
        self.diff_norm.eps = eps
    DiffAttention.__init__ = _init_eps
    tag.append(f"subnorm_eps={eps}")
if "--no-subnorm" in argv:
    argv.remove("--no-subnorm")
    DiffAttention.forward = forward_no_subnorm
    tag.append("no_subnorm")
spec = importlib.util.spec_from_file_location("clv", "/work/main/scripts/compare_lm_variants.py")
clv = importlib.util.module_from_spec(spec); spec.loader.exec_module(clv)
rc = clv.main(argv)
if "--json" in argv:
    p = argv[argv.index("--json") + 1]
    d = json.load(open(p)); d["ablation"] = tag; json.dump(d, open(p, "w"), indent=1)
sys.exit(rc)
