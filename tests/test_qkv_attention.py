"""ops.qkv_attention: the QKV projection and flash attention as one op, whose attention
backward sums the projection's bias gradient."""

import pytest
import torch
from conftest import check_against_oracle, grads_of
from torch.autograd import gradcheck

from fusedtrain import eager, ops

F64 = torch.float64


def _inputs(B, T, C, dtype=F64, bias=True):
    x = torch.randn(B, T, C, dtype=dtype, requires_grad=True)
    w = (torch.randn(3 * C, C, dtype=dtype) / C ** 0.5).requires_grad_()
    b = torch.randn(3 * C, dtype=dtype, requires_grad=True) if bias else None
    return x, w, b


@pytest.mark.parametrize("B,T,C,H,causal", [(2, 70, 16, 2, True), (1, 130, 12, 3, False)])
def test_matches_the_two_ops_composed(B, T, C, H, causal):
    """T past one and two 64-row grains of the bias partial sums, with a tail; the key
    bias's gradient is exactly zero (the softmax cancels it), the eager one only nearly."""
    inputs = _inputs(B, T, C)
    outs, grads, g = grads_of(lambda *a: ops.qkv_attention(*a, H, causal), inputs)
    refs, ref_grads, _ = grads_of(lambda *a: eager.qkv_attention(*a, H, causal), inputs, g)
    assert outs[0].shape == (B, H, T, C // H)
    for got, want in zip(outs + tuple(grads), refs + tuple(ref_grads)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert torch.equal(grads[2][C:2 * C], torch.zeros(C, dtype=F64))


@pytest.mark.parametrize("bias,causal", [(True, True), (False, False)])
def test_gradcheck(bias, causal):
    inputs = _inputs(2, 5, 12, bias=bias)
    assert gradcheck(lambda *a: ops.qkv_attention(*a, 3, causal), inputs, fast_mode=True)


def test_fp32_accuracy():
    x, w, b = (t.detach().float().requires_grad_() for t in _inputs(2, 203, 96))
    check_against_oracle(lambda *a: ops.qkv_attention(*a, 4),
                         lambda *a: eager.qkv_attention(*a, 4), (x, w, b), 1e-5, 1e-4,
                         "qkv_attention")


def test_compile_fullgraph_matches_eager():
    x, w, b = (t.detach().float().requires_grad_() for t in _inputs(2, 9, 16))
    compiled = torch.compile(lambda *a: ops.qkv_attention(*a, 2), fullgraph=True,
                             backend="aot_eager")
    outs, grads, g = grads_of(compiled, (x, w, b))
    refs, ref_g, _ = grads_of(lambda *a: eager.qkv_attention(*a, 2), (x, w, b), g)
    for a, r in zip(outs + tuple(grads), refs + tuple(ref_g)):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)


def test_bad_inputs():
    x, w, b = _inputs(2, 5, 12)
    with pytest.raises(ValueError, match="n_heads"):
        ops.qkv_attention(x, w, b, 5)
    with pytest.raises(ValueError, match="bias"):
        ops.qkv_attention(x, w, b[:30], 3)
    with pytest.raises(TypeError, match="weight"):
        ops.qkv_attention(x, w.float(), b, 3)
    with pytest.raises(ValueError, match="softmax_scale"):
        ops.qkv_attention(x, w, b, 3, softmax_scale=0.0)
    wide = torch.randn(2, 3, 300, dtype=F64)
    with pytest.raises(ValueError, match="head dim"):
        ops.qkv_attention(wide, torch.randn(900, 300, dtype=F64), None, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,H", [(16, 1024, 768, 12), (8, 2048, 2048, 16)])
def test_gpu_bf16_accuracy(B, T, C, H):
    x, w, b = (t.detach().cuda().bfloat16().requires_grad_()
               for t in _inputs(B, T, C, dtype=torch.float32))
    check_against_oracle(lambda *a: ops.qkv_attention(*a, H),
                         lambda *a: eager.qkv_attention(*a, H), (x, w, b), 1e-2, 1e-2,
                         "qkv_attention")
