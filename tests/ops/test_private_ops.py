"""The private torch operators diffmm uses (only inside ``diffmm/ops``), and the torch behaviour they rely on.

- ``torch.ops.aten._softmax_backward_data.out`` (``diffmm/ops/combined.py``): ATen's fused softmax backward.
- ``torch.ops.aten.silu_backward`` (``diffmm/ops/activations.py``): the fused SiLU derivative behind QuickGELU.

docs/attention.md (section "Private torch operators") has the measured gain that pays for each. These tests fail
when torch changes a schema or a meaning, so the next torch upgrade says what to fix.
"""
import torch
import torch.nn.functional as F

from diffmm.ops.activations import _silu_backward, quick_gelu
from diffmm.ops.combined import _softmax_bwd_out


def test_softmax_backward_schema_is_the_one_combined_calls():
    schema = str(torch.ops.aten._softmax_backward_data.out._schema)
    assert schema.startswith("aten::_softmax_backward_data.out(Tensor grad_output, Tensor output, int dim, "
                             "ScalarType input_dtype, *, Tensor(a!) grad_input)"), schema


def test_softmax_backward_equals_autograd_and_runs_in_place():
    """``grad_input = p * (dp - rowsum(p * dp))`` = autograd's gradient of ``torch.softmax``, also when
    ``grad_input`` is ``p`` itself (the chunked backward overwrites the recomputed maps)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(3, 5, 17, generator=g, dtype=dtype, requires_grad=True)
        dp = torch.randn(3, 5, 17, generator=g, dtype=dtype)
        p = torch.softmax(x, -1)
        (want,) = torch.autograd.grad(p, x, dp)
        p = p.detach()
        out = _softmax_bwd_out(dp, p, -1, dtype, grad_input=torch.empty_like(p))
        torch.testing.assert_close(out, want)
        in_place = p.clone()
        _softmax_bwd_out(dp, in_place, -1, dtype, grad_input=in_place)
        torch.testing.assert_close(in_place, want)


def test_public_softmax_runs_in_place_through_out():
    """``combined`` computes the maps with ``torch.softmax(s, -1, out=s)`` (public), in place over the scores."""
    s = torch.randn(4, 33, 65, generator=torch.Generator().manual_seed(1))
    want = torch.softmax(s, -1)
    torch.softmax(s, -1, out=s)
    torch.testing.assert_close(s, want)


def test_silu_backward_schema_and_meaning():
    assert str(torch.ops.aten.silu_backward.default._schema) == \
        "aten::silu_backward(Tensor grad_output, Tensor self) -> Tensor"
    g = torch.Generator().manual_seed(2)
    z = torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, 9, generator=g, dtype=torch.float64)
    (want,) = torch.autograd.grad(F.silu(z), z, dy)
    torch.testing.assert_close(_silu_backward(dy, z.detach()), want)


def test_quick_gelu_equals_the_plain_formula():
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = (torch.randn(5, 33, generator=torch.Generator().manual_seed(3)) * 3).to(dtype).requires_grad_()
        dy = torch.randn(5, 33, generator=torch.Generator().manual_seed(4)).to(dtype)
        ours, plain = quick_gelu(x), x * torch.sigmoid(1.702 * x)
        torch.testing.assert_close(ours, plain, atol=tol, rtol=tol)
        torch.testing.assert_close(torch.autograd.grad(ours, x, dy)[0], torch.autograd.grad(plain, x, dy)[0],
                                   atol=tol, rtol=tol)
