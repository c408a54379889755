"""SwiGLU's forward GEMMs with the activation in the epilogue, as a warp-specialised Gluon
kernel for Hopper (the pipeline and ping-pong consumers of kernels.gemm_gluon; each
consumer's epilogue runs under the other consumer's MMAs): one GEMM over the gate and up
weights side by side (make_paired_pipe: an output tile's first half is BN/2 columns of g,
its second the same columns of u), storing g and u (rounded, for backward) and
h = silu(g) * u of the rounded values, as the backward recomputes it. The same
computation as kernels.swiglu's two cuBLAS GEMMs and activation pass, which it replaces
on sm_90 GPUs up to C = 1024 (see swiglu.swiglu_fwd).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
from triton.language.core import _aggregate as aggregate

from fusedtrain.kernels._launch import fast_launch
from fusedtrain.kernels.gemm_gluon import (
    BK,
    BM,
    BN,
    launch,
    make_paired_pipe,
    matrix_desc,
    no_prefetch,
    run,
)
from fusedtrain.kernels.swiglu import swiglu_value

HALF = gl.constexpr(BN.value // 2)


@aggregate
class _FwdArgs:
    g_desc: tma.tensor_descriptor
    u_desc: tma.tensor_descriptor
    h_desc: tma.tensor_descriptor

    @gluon.constexpr_function
    def __init__(self, g_desc, u_desc, h_desc):
        self.g_desc, self.u_desc, self.h_desc = g_desc, u_desc, h_desc


@gluon.jit
def _column_halves(acc):
    """(BM, BN) -> its columns [0, BN/2) and [BN/2, BN). A thread of the wgmma accumulator
    holds every 8th column pair, so both halves of a column pair's row sit in one thread
    and the split moves no data."""
    first, second = gl.split(gl.permute(gl.reshape(acc, [BM, 2, HALF]), [0, 2, 1]))
    return first, second


@gluon.jit
def _fwd_epilogue(e, acc, buf, bar, off_m, off_n, j):
    # Tile columns off_n.. of the paired GEMM are columns off_n / 2.. of g and of u.
    g, u = _column_halves(acc)
    g = g.to(e.g_desc.dtype)
    u = u.to(e.u_desc.dtype)
    h = swiglu_value(g.to(gl.float32), u.to(gl.float32)).to(e.h_desc.dtype)
    col = off_n // 2
    first = buf.slice(0, HALF, dim=1)
    second = buf.slice(HALF, HALF, dim=1)
    tma.store_wait(pendings=0)  # the last tile's stores have read buf
    first.store(g)
    second.store(u)
    fence_async_shared()
    tma.async_copy_shared_to_global(e.g_desc, [off_m, col], first)
    tma.async_copy_shared_to_global(e.u_desc, [off_m, col], second)
    tma.store_wait(pendings=1)  # g's store has read the first half
    first.store(h)
    fence_async_shared()
    tma.async_copy_shared_to_global(e.h_desc, [off_m, col], first)


@fast_launch
@gluon.jit
def _swiglu_fwd_ws_kernel(x_ptr, wg_ptr, wu_ptr, g_ptr, u_ptr, h_ptr, M, N, K, s_xm, s_wg,
                          s_wu, s_om):
    p = make_paired_pipe(matrix_desc(x_ptr, M, K, s_xm, BM, BK),
                         matrix_desc(wg_ptr, N, K, s_wg, HALF, BK),
                         matrix_desc(wu_ptr, N, K, s_wu, HALF, BK), M, 2 * N, K)
    args = _FwdArgs(matrix_desc(g_ptr, M, N, s_om, BM, HALF),
                    matrix_desc(u_ptr, M, N, s_om, BM, HALF),
                    matrix_desc(h_ptr, M, N, s_om, BM, HALF))
    run(p, args, g_ptr.dtype.element_ty, no_prefetch, _fwd_epilogue)


def swiglu_fwd(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
               g: torch.Tensor, u: torch.Tensor, h: torch.Tensor) -> None:
    """x: (M, K), gate_weight, up_weight: (N, K) -> g = x @ gate_weight.T, u = x @
    up_weight.T and h = silu(g) * u written into g, u, h: (M, N), contiguous."""
    M, K = x.shape
    N = gate_weight.shape[0]
    launch(_swiglu_fwd_ws_kernel, M, 2 * N, x.device, x, gate_weight, up_weight, g, u, h, M,
           N, K, x.stride(0), gate_weight.stride(0), up_weight.stride(0), g.stride(0))
