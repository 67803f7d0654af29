"""linear_cross_entropy (the LM head and its loss fused by chunks) against F.cross_entropy of the full logits."""
import pytest
import torch
import torch.nn.functional as F

from diffmm.ops import linear_cross_entropy


def inputs(dtype=torch.float64, n=(3, 37), e=16, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n, e, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, e, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, v, n, generator=g)
    targets[0, :5] = -100  # ignored rows
    targets[2, -1] = -100
    return hidden, weight, targets


def reference(hidden, weight, targets):
    """Loss and gradients of the full logits in float64, with an upstream gradient of 1.7."""
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    loss = F.cross_entropy((h @ w.T).flatten(0, 1), targets.flatten(), ignore_index=-100)
    return (loss, *torch.autograd.grad(loss * 1.7, (h, w)))


@pytest.mark.parametrize("chunk_size", [1, 7, 37, 500, None])  # one row, uneven chunks, one chunk, the default
def test_equals_the_float64_reference(chunk_size):
    hidden, weight, targets = inputs()
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size)
    grads = torch.autograd.grad(loss * 1.7, (hidden, weight))
    for got, want in zip((loss, *grads), reference(hidden, weight, targets)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_float32_and_the_same_weight_used_twice():
    """fp32 against the fp64 reference; a weight that also feeds something else accumulates both gradients."""
    hidden, weight, targets = inputs(torch.float32)
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=16)
    assert loss.dtype == torch.float32
    (loss * 1.7 + weight.square().sum()).backward()
    ref_loss, ref_h, ref_w = reference(hidden, weight, targets)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), ref_h, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(weight.grad.double(), ref_w + 2 * weight.detach().double(), atol=1e-5, rtol=1e-4)


def test_without_gradients_and_when_nothing_is_scored():
    hidden, weight, targets = inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=5)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, reference(hidden, weight, targets)[0])
    nothing = torch.full_like(targets, -100)  # as F.cross_entropy: nan loss, zero gradients
    loss = linear_cross_entropy(hidden, weight, nothing)
    loss.backward()
    assert loss.isnan() and not hidden.grad.any() and not weight.grad.any()


def test_bf16_autocast_runs_the_matmuls_in_bf16():
    hidden, weight, targets = inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=16)
        want = F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), targets.flatten())
    loss.backward()
    assert loss.dtype == torch.float32 and (hidden.grad.dtype, weight.grad.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-4)  # same bf16 logits, fp32 softmax
    ref_h = reference(hidden, weight, targets)[1]
    torch.testing.assert_close(hidden.grad.double(), ref_h, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("weight_shape, target_shape, match", [
    ((101, 8), (3, 37), r"weight has shape \(101, 8\); expected \(vocab, 16\)"),
    ((101, 16), (3, 36), r"targets has shape \(3, 36\); expected \(3, 37\) like hidden"),
])
def test_bad_shapes_get_one_line(weight_shape, target_shape, match):
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(torch.randn(3, 37, 16), torch.randn(weight_shape),
                             torch.zeros(target_shape, dtype=torch.long))
