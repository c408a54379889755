"""ops.swiglu_mlp against its eager twin: fp64 gradcheck, odd shapes, what it saves for
backward, inference, torch.compile, bad input; bf16 against an fp64 oracle on the GPU."""

import pytest
import torch
from conftest import check_against_oracle, grads_of

from fusedtrain import eager, ops
from fusedtrain.gradcheck import gradcheck

F64 = torch.float64


def _inputs(M=(2, 5), C=12, H=20, C_out=9, dtype=F64, device="cpu"):
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0):
        t = torch.randn(*shape, generator=gen, dtype=F64) * scale
        return t.to(device, dtype).requires_grad_()

    return (leaf(*M, C), leaf(H, C, scale=C ** -0.5), leaf(H, C, scale=C ** -0.5),
            leaf(C_out, H, scale=H ** -0.5))


def test_gradcheck():
    assert gradcheck(ops.swiglu_mlp, _inputs((2, 3), 6, 10, 5))


@pytest.mark.parametrize("M,C,H,C_out", [((1, 1), 1, 1, 1), ((3, 37), 24, 72, 40),
                                          ((131,), 65, 33, 130)])
def test_matches_the_twin_at_odd_shapes(M, C, H, C_out):
    args = _inputs(M, C, H, C_out, dtype=torch.float32)
    (y,), grads, g = grads_of(ops.swiglu_mlp, args)
    (ref,), ref_grads, _ = grads_of(eager.swiglu_mlp, args, g)
    for a, b in zip((y, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("M,C,N", [(1, 3, 1), (130, 24, 300)])
def test_forward_pass_matches_the_math(M, C, N):
    """The two GEMMs, then h past one pass tile in both dimensions."""
    from fusedtrain.kernels import swiglu as K

    gen = torch.Generator().manual_seed(2)
    x, wg, wu = (torch.randn(*s, generator=gen, dtype=F64) for s in ((M, C), (N, C), (N, C)))
    g, u, h = K.swiglu_fwd(x, wg, wu)
    torch.testing.assert_close(g, x @ wg.T)
    torch.testing.assert_close(u, x @ wu.T)
    torch.testing.assert_close(h, torch.nn.functional.silu(g) * u)


@pytest.mark.parametrize("M,N", [(1, 1), (65, 129), (130, 300)])
def test_backward_pass_matches_the_math(M, N):
    """swiglu_bwd past one tile in both dimensions, with g and u of row strides other than
    dh's (columns of a wider buffer): dg over dh, du and the recomputed h."""
    from fusedtrain.kernels import swiglu as K

    gen = torch.Generator().manual_seed(1)
    C_out = 7
    dy = torch.randn(M, C_out, generator=gen, dtype=F64)
    wd = torch.randn(C_out, N, generator=gen, dtype=F64)
    g, u = torch.randn(2, M, N + 3, generator=gen, dtype=F64)[..., :N].unbind(0)
    dg, du, h = K.swiglu_bwd(dy, wd, g, u)
    dh, s = dy @ wd, torch.sigmoid(g)
    torch.testing.assert_close(dg, dh * u * s * (1 + g * (1 - s)))
    torch.testing.assert_close(du, dh * g * s)
    torch.testing.assert_close(h, g * s * u)


def test_saves_the_two_pre_activations_only():
    """Fused: x, g and u ((M, C) and two (M, H)); eager also keeps silu(g) and silu(g) * u
    (bench.kernels.saved_mib's count, the weights left out): the issue's target is <= 2/3."""
    from fusedtrain.bench.kernels import saved_mib

    args = _inputs((64,), 16, 48, 16, dtype=torch.float32)
    fused, twin = saved_mib(ops.swiglu_mlp, args), saved_mib(eager.swiglu_mlp, args)
    assert fused * 2 ** 20 == 64 * (16 + 2 * 48) * 4
    assert twin * 2 ** 20 == 64 * (16 + 4 * 48) * 4 and fused <= twin * 2 / 3


def test_inference_matches_and_saves_nothing():
    args = _inputs(dtype=torch.float32)
    with torch.no_grad():
        y = ops.swiglu_mlp(*args)
    assert y.grad_fn is None
    torch.testing.assert_close(y, eager.swiglu_mlp(*args).detach(), rtol=1e-4, atol=1e-5)


def test_compile_fullgraph_matches_eager():
    args = _inputs(dtype=torch.float32)
    compiled = torch.compile(lambda *a: ops.swiglu_mlp(*a), fullgraph=True, backend="aot_eager")
    (y,), grads, g = grads_of(compiled, args)
    (ref,), ref_grads, _ = grads_of(eager.swiglu_mlp, args, g)
    for a, b in zip((y, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bad_inputs():
    x, wg, wu, wd = (t.detach() for t in _inputs())
    with pytest.raises(ValueError, match="gate_weight"):
        ops.swiglu_mlp(x, wg[:, :5], wu, wd)
    with pytest.raises(ValueError, match="up_weight"):
        ops.swiglu_mlp(x, wg, wu[:7], wd)
    with pytest.raises(ValueError, match="down_weight"):
        ops.swiglu_mlp(x, wg, wu, wd[:, :3])
    with pytest.raises(TypeError, match="up_weight"):
        ops.swiglu_mlp(x, wg, wu.float(), wd)


@pytest.mark.gpu
@pytest.mark.parametrize("M,C,H", [(16384, 768, 2048), (4096, 4096, 11008), (1000, 96, 200)])
def test_gpu_bf16_accuracy(M, C, H):
    args = [t.detach().bfloat16().requires_grad_()
            for t in _inputs((M,), C, H, C, dtype=torch.float32, device="cuda")]
    check_against_oracle(ops.swiglu_mlp, eager.swiglu_mlp, args, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("M,C,H", [(512, 768, 2048), (300, 256, 200), (1024, 1024, 2816)])
def test_gpu_warp_specialised_forward_matches_cublas(M, C, H, monkeypatch):
    """The Gluon forward (sm_90) against cuBLAS's two GEMMs and the activation pass on the
    same bf16 data: the same fp32 accumulation, each output one bf16 rounding, h from the
    rounded g and u in both; rows and columns past a tile's edge (M = 300, H = 200)."""
    from fusedtrain.kernels import swiglu as K
    from fusedtrain.kernels._tma import gluon_ok

    x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
    wg, wu = ((torch.randn(H, C, device="cuda") / C ** 0.5).bfloat16() for _ in range(2))
    if not gluon_ok(x, wg, wu):
        pytest.skip("the warp-specialised kernels need an sm_90 GPU and triton 3.6")
    got = K.swiglu_fwd(x, wg, wu)
    monkeypatch.setattr(K, "gluon_ok", lambda *tensors: False)
    for a, b in zip(got, K.swiglu_fwd(x, wg, wu)):
        torch.testing.assert_close(a, b)

