"""The ablation attention types (diffmm/nn/ablations.py) against the fp64 reference and their parent layers."""
import pytest
import torch

from diffmm import create_model
from diffmm.nn import UPCYCLE_TYPES, create_attention
from diffmm.nn.lambdas import lambda_init_depth
from diffmm.ops import attention_reference, diff_attention_reference
from diffmm.train.optim import param_groups

torch.manual_seed(0)


def _copy(dst, src):
    dst.load_state_dict(src.state_dict(), strict=False)
    return dst


def _diff_ref(m, x, lam, scale_lambda_init):
    B, N, _ = x.shape
    q, k, v = m._qkv(x, None, None)
    out = diff_attention_reference(q, k, v, lam, norm_weight=m.diff_norm.weight, lambda_init=scale_lambda_init,
                                   eps=m.diff_norm.eps)
    return m.out_proj(out.reshape(B, N, -1))


def test_nosub_is_diff_with_lambda_zero():
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    m = create_attention("diff_nosub", 64, 4, layer_idx=2, lambda_init=0.8).double()
    ref = _diff_ref(m, x, torch.zeros((), dtype=torch.float64), 0.8)
    torch.testing.assert_close(m(x), ref)
    m(x).sum().backward()
    assert m.lambda_q1.grad is None or m.lambda_q1.grad.abs().max() == 0  # no gradient reaches lambda
    assert m.q_proj.weight.grad.abs().max() > 0
    full = _copy(create_attention("diff", 64, 4, layer_idx=2, lambda_init=0.8).double(), m)
    assert not torch.allclose(full(x), m(x))  # the subtraction does change the output
    assert "diff_nosub" not in UPCYCLE_TYPES


@pytest.mark.parametrize("attn_type,scale", [("diff_scale_depth", 1 - lambda_init_depth(3)),
                                             ("diff_scale_fixed", 0.2), ("diff_scale_none", 1.0)])
def test_scale_variants_keep_lambda_change_scale(attn_type, scale):
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    m = create_attention(attn_type, 64, 4, layer_idx=3, lambda_init=0.8, causal=True).double()
    assert m.lambda_init == 0.8  # lambda keeps its init; only the epilogue's scale changes
    q, k, v = m._qkv(x, None, None)
    out = diff_attention_reference(q, k, v, m.lambda_full(), causal=True, norm_weight=m.diff_norm.weight,
                                   lambda_init=1 - scale, eps=m.diff_norm.eps)
    torch.testing.assert_close(m(x), m.out_proj(out.reshape(2, 7, -1)))


def test_standard_epilogue_against_reference():
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    m = create_attention("standard_epilogue", 64, 4, layer_idx=0, lambda_init="constant").double()
    with torch.no_grad():
        m.head_norm.weight.uniform_(0.5, 1.5)
    q, k = m.project_qk(x, None, 4, 4)
    a = attention_reference(q, k, m.v_proj(x).view(2, 9, 4, 16))  # (B, N, H, d)
    a = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + m.head_norm.eps) * m.head_norm.weight * (1 - 0.8)
    torch.testing.assert_close(m(x), m.out_proj(a.reshape(2, 9, 64)))
    assert m.num_heads == 4 and m.head_dim == 16  # standard heads, not halved
    assert "standard_epilogue" not in UPCYCLE_TYPES


@pytest.mark.parametrize("attn_type", ["diff_nosub", "standard_epilogue"])
def test_ablation_in_a_clip_config(attn_type):
    model = create_model("DiffCLIP-Tiny", vision_cfg={"attn_type": attn_type})
    assert type(model.visual.blocks[0].attn).attn_type == attn_type
    img = torch.randn(2, 3, 64, 64)
    assert model.encode_image(img).shape == (2, 128)


def test_param_groups_glob_patterns():
    m = create_attention("diff", 32, 2)
    groups = param_groups(m, 0.1, lrs={"*lambda_*": 1e-2, "q_proj.": 1e-4})
    by_name = {g["name"]: g for g in groups}
    assert by_name["no_decay *lambda_*"]["lr"] == 1e-2 and len(by_name["no_decay *lambda_*"]["params"]) == 4
    assert by_name["decay q_proj."]["lr"] == 1e-4
    assert "lr" not in by_name["decay"]
