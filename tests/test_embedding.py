"""ops.embedding: weight[idx], its backward an atomic scatter-add into fp32."""

import pytest
import torch
from torch.autograd import gradcheck

from fusedtrain import eager, ops

F64 = torch.float64


def test_gradcheck_with_repeated_ids():
    w = torch.randn(7, 5, dtype=F64, requires_grad=True)
    idx = torch.tensor([[0, 3, 3], [6, 3, 0]])  # ids repeated within and across rows
    assert gradcheck(lambda t: ops.embedding(idx, t), (w,))


@pytest.mark.parametrize("deterministic", [False, True])
def test_matches_the_twin_at_odd_shapes(deterministic):
    """Column tails (C = 300 across two 256-wide blocks), token tails, hot rows."""
    w = torch.randn(97, 300)
    idx = torch.randint(0, 97, (3, 45))
    idx[0, :20] = 5
    leaf, ref_leaf = w.clone().requires_grad_(), w.clone().requires_grad_()
    mode = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        y = ops.embedding(idx, leaf)
        g = torch.randn_like(y)
        y.backward(g)
    finally:
        torch.use_deterministic_algorithms(mode)
    y_ref = eager.embedding(idx, ref_leaf)
    y_ref.backward(g)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-5)


def test_strided_ids_and_gradient():
    w = torch.randn(9, 4, requires_grad=True)
    idx = torch.tensor([1, 0, 7, 0, 7, 3])[::2]  # a 1-D view with stride 2
    g = torch.randn(4, 3).t()  # (3, 4), columns strided
    ops.embedding(idx, w).backward(g)
    ref = torch.zeros(9, 4).index_add_(0, idx, g)
    torch.testing.assert_close(w.grad, ref)


def test_bf16_weight_gets_a_bf16_gradient():
    w = torch.randn(11, 8, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.tensor([1, 1, 4])
    ops.embedding(idx, w).float().sum().backward()
    assert w.grad.dtype == torch.bfloat16
    assert w.grad[1].eq(2).all() and w.grad[4].eq(1).all() and w.grad[0].eq(0).all()


def test_compile_fullgraph_matches_eager():
    w = torch.randn(10, 4, requires_grad=True)
    idx = torch.tensor([[1, 2, 1]])
    compiled = torch.compile(lambda t: ops.embedding(idx, t) * 2, fullgraph=True,
                             backend="aot_eager")
    (g,) = torch.autograd.grad(compiled(w).square().sum(), w)
    (ref,) = torch.autograd.grad((eager.embedding(idx, w) * 2).square().sum(), w)
    torch.testing.assert_close(g, ref)


def test_bad_inputs():
    w = torch.randn(5, 3)
    with pytest.raises(TypeError, match="idx"):
        ops.embedding(torch.zeros(2), w)
    with pytest.raises(ValueError, match="weight"):
        ops.embedding(torch.zeros(2, dtype=torch.long), torch.randn(5))
    with pytest.raises(TypeError, match="weight"):
        ops.embedding(torch.zeros(2, dtype=torch.long), w.long())


@pytest.mark.gpu
def test_gpu_backward_at_gpt2_shape_and_deterministic_mode():
    """16384 tokens with GPT-2-like repeats (the commonest id ~1500 times) into a 50304 x
    768 fp32 table: every entry of the atomic backward within the error bound of fp32
    summation in any order, (n - 1) 2^-24 sum |g| over its n rows (the fp64 sums as the
    reference; PyTorch's sorted backward meets the same bound), and deterministic mode's
    fallback gives the same bits twice."""
    torch.manual_seed(0)
    ranks = torch.arange(1, 50305, dtype=F64)
    idx = torch.multinomial(1.0 / ranks, 16384, replacement=True).view(16, 1024).cuda()
    w = (torch.randn(50304, 768, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(16, 1024, 768, device="cuda")

    def grad():
        w.grad = None
        ops.embedding(idx, w).backward(g)
        return w.grad.clone()

    flat = idx.view(-1)
    ref = torch.ops.aten.embedding_dense_backward(g.view(-1, 768).double(), flat, 50304, -1,
                                                  False)
    abs_sums = torch.ops.aten.embedding_dense_backward(g.view(-1, 768).double().abs(), flat,
                                                       50304, -1, False)
    count = torch.bincount(flat, minlength=50304).double()[:, None]
    bound = (count - 1).clamp(min=0) * 2.0 ** -24 * abs_sums + 1e-12
    for got in (grad(), torch.ops.aten.embedding_dense_backward(g.view(-1, 768), flat, 50304,
                                                                -1, False)):
        assert ((got.double() - ref).abs() <= bound).all()
    mode = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.equal(grad(), grad())
    finally:
        torch.use_deterministic_algorithms(mode)
