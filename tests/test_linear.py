"""ops.linear: nn.Linear's computation with the column-sum kernel's bias gradient, the
block's grouped casts, and under autocast a weight cast inside the op whose gradient leaves
in the weight's dtype."""

from contextlib import nullcontext

import pytest
import torch

from fusedtrain import eager, ops
from fusedtrain.casts import grouped_casts
from fusedtrain.gradcheck import gradcheck

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


@pytest.mark.parametrize("grouped", [False, True])
def test_autocast_matches_f_linear_bit_for_bit(grouped):
    """A weight cast inside the op (the tied head's case) or taken from grouped_casts: the
    values and gradients of F.linear under autocast (on CPU, where the weight gradient is
    the bf16 GEMM's, widened; on CUDA it comes from the GEMM in fp32, test below)."""
    x = torch.randn(3, 7, 24)
    w, b = torch.randn(40, 24), torch.randn(40)
    results = []
    for fn in (ops.linear, torch.nn.functional.linear):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        group = grouped_casts(*leaves[1:]) if grouped and fn is ops.linear else nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16), group:
            y = fn(*leaves)
        y.float().square().sum().backward()
        results.append((y, *(t.grad for t in leaves)))
    (y, gx, gw, gb), (y_ref, gx_ref, gw_ref, gb_ref) = results
    for a, r in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        assert a.dtype == r.dtype and torch.equal(a, r)
    # The bias gradient: fp32 sums where autocast's bf16 sum rounds once more.
    assert gb.dtype == torch.float32
    torch.testing.assert_close(gb, gb_ref, rtol=2 ** -7, atol=0)


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
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the weight cast inside the op
        with pytest.raises(ValueError, match="weight"):
            ops.linear(x, torch.randn(5, 7))
        with pytest.raises(TypeError, match="weight"):
            ops.linear(x, w.long())


@pytest.mark.gpu
def test_gpu_fp32_weight_gradient_from_the_gemm():
    """The tied head's shape class: bf16 activations, fp32 weight cast inside; the weight's
    fp32 gradient (from the GEMM) within twice F.linear's (bf16, widened) error against
    fp64, and the output identical."""
    x = torch.randn(4096, 768, device="cuda")
    w = (torch.randn(50304, 768, device="cuda") * 0.02).requires_grad_()
    dy = torch.randn(4096, 50304, device="cuda").bfloat16()
    grads, outs = [], []
    for fn in (ops.linear, torch.nn.functional.linear):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, w)
        outs.append(y)
        grads.append(torch.autograd.grad(y, w, dy)[0])
    ref = dy.double().t() @ x.bfloat16().double()
    assert grads[0].dtype == torch.float32
    assert torch.equal(outs[0], outs[1])
    err, err_eager = ((g.double() - ref).abs().max().item() for g in grads)
    assert err <= 2 * err_eager, (err, err_eager)
