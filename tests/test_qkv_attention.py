"""ops.qkv_attention: the QKV projection and flash attention as one op, whose attention
backward sums the projection's bias gradient."""

import pytest
import torch
from conftest import check_against_oracle, grads_of, max_err
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
    """DESIGN.md's rule (fused error against fp64 <= 2 x the eager twin's + atol) on each
    output and gradient's largest error over three draws. The weight gradient sums B*T
    tokens' products into values of up to ~190 at gpt2's shape, whose largest error is a
    few bf16 ulps (one ulp = 1 there) and moves between draws by as much as the rule
    allows: eager's went from 1.89 to 3.18 over ten draws, the fused ops' (this op's are
    theirs) from 2.4 to 3.8 (docs/perf-notes.md, sixteenth round). One draw's maximum
    failed the rule once (3.83 against 1.89); the maximum over three draws does not depend
    on one lucky draw of the eager op."""
    worst = {"fused": [0.0] * 4, "eager": [0.0] * 4}
    for _ in range(3):
        x, w, b = (t.detach().cuda() for t in _inputs(B, T, C, dtype=torch.float32))
        g = (torch.randn(B, H, T, C // H, dtype=torch.float64),)  # a fresh upstream gradient
        ref_in = [t.double().requires_grad_() for t in (x, w, b)]
        refs, ref_g, _ = grads_of(lambda *a: eager.qkv_attention(*a, H), ref_in, g)
        low = [t.bfloat16().requires_grad_() for t in (x, w, b)]
        for name, fn in (("fused", ops.qkv_attention), ("eager", eager.qkv_attention)):
            outs, grads, _ = grads_of(lambda *a, fn=fn: fn(*a, H), low, g)
            for i, (got, want) in enumerate(zip(outs + tuple(grads), refs + tuple(ref_g))):
                worst[name][i] = max(worst[name][i], max_err(got, want))
    for i, what in enumerate(["output", "grad of x", "grad of weight", "grad of bias"]):
        f, e = worst["fused"][i], worst["eager"][i]
        assert f <= 2 * e + 1e-2, f"{what}: fused error {f:.3g} > 2 x eager error {e:.3g} + 0.01"
