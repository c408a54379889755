"""ops.linear: nn.Linear's computation with the column-sum kernel's bias gradient and the
block's grouped casts."""

import pytest
import torch
from torch.autograd import gradcheck

from fusedtrain import eager, ops

F64 = torch.float64


@pytest.mark.parametrize("with_bias", [True, False])
def test_gradcheck(with_bias):
    x = torch.randn(2, 5, 6, dtype=F64, requires_grad=True)
    w = torch.randn(7, 6, dtype=F64, requires_grad=True)
    b = torch.randn(7, dtype=F64, requires_grad=True) if with_bias else None
    assert gradcheck(ops.linear, (x, w, b))


def test_matches_the_twin_at_odd_shapes():
    x = torch.randn(3, 113, 72).transpose(0, 1)  # strided
    w, b = torch.randn(130, 72) / 9, torch.randn(130)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y, y_ref = ops.linear(*leaves), eager.linear(*ref_leaves)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g), y_ref.backward(g)
    for a, r in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-4)


def test_autocast_gradients_reach_fp32_parameters():
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ops.linear(x, lin.weight, lin.bias)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad.dtype == lin.bias.grad.dtype == torch.float32
    torch.testing.assert_close(lin.bias.grad, torch.full((8,), 4.0))


def test_compile_fullgraph_matches_eager():
    x = torch.randn(2, 3, 8, requires_grad=True)
    w, b = torch.randn(5, 8, requires_grad=True), torch.randn(5, requires_grad=True)
    compiled = torch.compile(ops.linear, fullgraph=True, backend="aot_eager")
    y = compiled(x, w, b)
    (gx, gw, gb) = torch.autograd.grad(y.square().sum(), (x, w, b))
    y_ref = eager.linear(x, w, b)
    ref = torch.autograd.grad(y_ref.square().sum(), (x, w, b))
    torch.testing.assert_close(y, y_ref)
    for a, r in zip((gx, gw, gb), ref):
        torch.testing.assert_close(a, r)


def test_bad_inputs():
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, torch.randn(5, 7))
    with pytest.raises(ValueError, match="bias"):
        ops.linear(x, w, torch.randn(4))
    with pytest.raises(TypeError, match="weight"):
        ops.linear(x, w.double())
    with pytest.raises(TypeError, match="x"):
        ops.linear(x.long(), w)
