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


def test_layout_matches_eager():
    x, w, b = _inputs(2, 7, 12)
    for fused, ref in zip(ops.qkv_projection(x, w, b, 3), eager.qkv_projection(x, w, b, 3)):
        assert fused.shape == (2, 3, 7, 4)
        torch.testing.assert_close(fused, ref)


def test_packed_eager_form_matches_three_projections():
    x, w, b = _inputs(2, 7, 12)
    for a, r in zip(eager.qkv_projection_packed(x, w, b, 3), eager.qkv_projection(x, w, b, 3)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck(bias):
    inputs = _inputs(2, 5, 12, bias=bias)
    assert gradcheck(lambda *a: ops.qkv_projection(*a, 3), inputs, fast_mode=True)


def test_strided_x():
    base = torch.randn(2, 9, 12, dtype=F64)
    x = base[:, 1:8]  # (B, T, C) with a batch stride that is not T*C
    w, b = torch.randn(36, 12, dtype=F64), torch.randn(36, dtype=F64)
    for a, r in zip(ops.qkv_projection(x, w, b, 4), eager.qkv_projection(x, w, b, 4)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("B,T,C,H", [(2, 32, 48, 3), (3, 48, 64, 4)])
def test_tma_kernels_match_eager(B, T, C, H):
    """The TMA forward and dx kernels, with tiles small enough that programs walk several
    tiles, a W tile runs past its q/k/v segment (C % 32 != 0 in the first case) and every
    row tile of dx reads several heads of dq, dk and dv."""
    from fusedtrain.kernels import qkv as K
    from fusedtrain.kernels._tma import TmaConfig

    small = TmaConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=1)
    x, w, b = (t.detach() for t in _inputs(B, T, C))
    for got, want in zip(K.qkv_fwd(x, w, b, H, config=small), eager.qkv_projection(x, w, b, H)):
        torch.testing.assert_close(got, want)
    grads = [torch.randn(B, H, T, C // H, dtype=F64) for _ in range(3)]
    packed = torch.cat([g.transpose(1, 2).reshape(B, T, C) for g in grads], -1)
    torch.testing.assert_close(K.qkv_dx(*grads, w, config=small), packed @ w)


def test_fp32_accuracy():
    x, w, b = (t.detach().float().requires_grad_() for t in _inputs(2, 203, 96))
    check_against_oracle(lambda *a: ops.qkv_projection(*a, 4),
                         lambda *a: eager.qkv_projection(*a, 4), (x, w, b), 1e-5, 1e-4, "qkv")


def test_compile_fullgraph_matches_eager():
    x, w, b = (t.detach().float().requires_grad_() for t in _inputs(2, 9, 16))
    compiled = torch.compile(lambda *a: ops.qkv_projection(*a, 2), fullgraph=True,
                             backend="aot_eager")
    outs, grads, g = grads_of(compiled, (x, w, b))
    refs, ref_g, _ = grads_of(lambda *a: eager.qkv_projection(*a, 2), (x, w, b), g)
    for a, r in zip(outs + tuple(grads), refs + tuple(ref_g)):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)


def test_bad_inputs():
    x, w, b = _inputs(2, 5, 12)
    with pytest.raises(ValueError, match="n_heads"):
        ops.qkv_projection(x, w, b, 5)
    with pytest.raises(ValueError, match="weight"):
        ops.qkv_projection(x, w[:30], b, 3)
    with pytest.raises(TypeError, match="weight"):
        ops.qkv_projection(x, w.float(), b, 3)
    with pytest.raises(ValueError, match="x"):
        ops.qkv_projection(x[0], w, b, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,H", [(16, 1024, 768, 12), (8, 2048, 2048, 16)])
def test_gpu_bf16_accuracy(B, T, C, H):
    x, w, b = (t.detach().cuda().bfloat16().requires_grad_()
               for t in _inputs(B, T, C, dtype=torch.float32))
    check_against_oracle(lambda *a: ops.qkv_projection(*a, H),
                         lambda *a: eager.qkv_projection(*a, H), (x, w, b), 1e-2, 1e-2, "qkv")


def test_bias_gradient_in_one_reduction_when_the_gradients_share_a_buffer():
    from fusedtrain.ops.qkv import _bias_grad, _consecutive

    dq, dk, dv = torch.randn(3, 2, 3, 5, 4, dtype=torch.float64).unbind(0)
    apart = dv.clone()
    assert _consecutive(dq, dk, dv) and not _consecutive(dq, dk, apart)
    expected = torch.cat([g.sum((0, 2)).flatten() for g in (dq, dk, dv)])
    torch.testing.assert_close(_bias_grad(dq, dk, dv), expected)
    torch.testing.assert_close(_bias_grad(dq, dk, apart), expected)


def test_back_to_back_allocations_are_not_one_buffer():
    """Three gradients allocated separately can lie back to back in memory (the caching
    allocator does this on the GPU); one view over them would reach past the first one's
    storage. Here: three storages over adjacent slices of one host buffer."""
    from fusedtrain.ops.qkv import _bias_grad, _consecutive

    shape, n = (2, 3, 5, 4), 2 * 3 * 5 * 4
    memory = bytearray(torch.randn(3 * n, dtype=torch.float64).numpy().tobytes())
    dq, dk, dv = (torch.frombuffer(memory, dtype=torch.float64, count=n, offset=8 * n * i)
                  .view(shape) for i in range(3))
    assert dk.data_ptr() - dq.data_ptr() == 8 * n
    assert not _consecutive(dq, dk, dv)
    expected = torch.cat([g.sum((0, 2)).flatten() for g in (dq, dk, dv)])
    torch.testing.assert_close(_bias_grad(dq, dk, dv), expected)
