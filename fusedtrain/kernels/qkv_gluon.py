"""The fused QKV projection's forward as a warp-specialised Gluon kernel for Hopper (the
pipeline and ping-pong consumers of kernels.gemm_gluon): one GEMM over W_qkv = [Wq|Wk|Wv]
whose epilogue adds the bias and stores each head's (BM, D) block straight into q, k or
v (B, H, T, D) by TMA, under the other consumer's MMAs. The same computation as
qkv._qkv_fwd_tma_kernel's head-store path, which it replaces on sm_90 GPUs where every
output tile lies inside one segment and one sequence (C % BN == 0, T % BM == 0) and
covers whole heads (D = BN or BN / 2).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.language.core import _aggregate as aggregate

from fusedtrain.kernels._launch import fast_launch
from fusedtrain.kernels.gemm_gluon import (
    BK,
    BM,
    BN,
    launch,
    make_pipe,
    matrix_desc,
    no_prefetch,
    run,
    stage_tile,
    tile_columns,
)


@aggregate
class _HeadArgs:
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    b_ptr: gl.tensor
    C: gl.tensor
    T: gl.tensor
    H: gl.tensor
    HAS_BIAS: gl.constexpr
    D: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, b_ptr, C, T, H, HAS_BIAS, D):
        self.q_desc, self.k_desc, self.v_desc = q_desc, k_desc, v_desc
        self.b_ptr, self.C, self.T, self.H = b_ptr, C, T, H
        self.HAS_BIAS, self.D = gl.constexpr(HAS_BIAS), gl.constexpr(D)


@gluon.jit
def _head_epilogue(e, acc, buf, bar, off_m, off_n, j):
    # Output column off_n of the 3C is column off_c of segment seg (q, k, v); rows
    # off_m.. are tokens t0.. of sequence b; head h's block is rows (b, h, t0..) of q, k
    # or v viewed as a (B*H*T, D) matrix, the next head's T rows further on. (Every column
    # of the tile exists: fits.)
    if e.HAS_BIAS:
        acc = acc + gl.load(e.b_ptr + tile_columns(off_n)).to(gl.float32)[None, :]
    stage_tile(buf, acc)
    seg = off_n // e.C
    off_c = off_n % e.C
    row = ((off_m // e.T) * e.H + off_c // e.D) * e.T + off_m % e.T
    for i in gl.static_range(BN // e.D):
        head = buf.slice(i * e.D, e.D, dim=1)
        if seg == 0:
            tma.async_copy_shared_to_global(e.q_desc, [row + i * e.T, 0], head)
        elif seg == 1:
            tma.async_copy_shared_to_global(e.k_desc, [row + i * e.T, 0], head)
        else:
            tma.async_copy_shared_to_global(e.v_desc, [row + i * e.T, 0], head)


@fast_launch
@gluon.jit
def _qkv_fwd_ws_kernel(x_ptr, w_ptr, b_ptr, q_ptr, k_ptr, v_ptr, M, C, T, H, s_xm, s_wn,
                       HAS_BIAS: gl.constexpr, HEAD_D: gl.constexpr):
    p = make_pipe(matrix_desc(x_ptr, M, C, s_xm, BM, BK),
                  matrix_desc(w_ptr, 3 * C, C, s_wn, BN, BK), M, 3 * C, C, True)
    rows = M * H
    D: gl.constexpr = HEAD_D
    args = _HeadArgs(matrix_desc(q_ptr, rows, D, D, BM, D), matrix_desc(k_ptr, rows, D, D, BM, D),
                     matrix_desc(v_ptr, rows, D, D, BM, D), b_ptr, gl.to_tensor(C),
                     gl.to_tensor(T), gl.to_tensor(H), HAS_BIAS, D)
    run(p, args, q_ptr.dtype.element_ty, no_prefetch, _head_epilogue)


def fits(T: int, C: int, D: int) -> bool:
    """Whether every (BM, BN) output tile lies in one sequence and one of q, k, v and
    covers one or two whole heads."""
    return T % BM.value == 0 and C % BN.value == 0 and D in (BN.value, BN.value // 2)


def qkv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, q: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor) -> None:
    """x: (B*T, C) tokens, weight: (3C, C), bias: (3C,) -> q, k, v: (B, H, T, D),
    contiguous, written in place (see fits)."""
    M, C = x.shape
    _, H, T, D = q.shape
    launch(_qkv_fwd_ws_kernel, M, 3 * C, x.device, x, weight,
           q if bias is None else bias, q, k, v, M, C, T, H, x.stride(0), weight.stride(0),
           HAS_BIAS=bias is not None, HEAD_D=D)
