"""Linear+GELU forward and the MLP's dGELU GEMM as warp-specialised Gluon kernels for
Hopper (the pipeline and its ping-pong consumers: kernels.gemm_gluon). The same computations as
linear_gelu's TMA kernels, which they replace on sm_90 GPUs; each consumer's epilogue
runs under the other consumer's MMAs.

  linear_gelu_fwd   y = gelu(x @ W.T + b), and h = x @ W.T + b when asked.
  matmul_dgelu      dh = (dy @ W2) * gelu'(h), h's tile loaded by TMA while the tile's
                    MMAs run; optionally each tile's column sums of dh (the bias gradient's
                    partial sums, one row per BM rows of dh).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import _aggregate as aggregate

from fusedtrain.kernels._launch import fast_launch
from fusedtrain.kernels.gelu import gelu, gelu_grad
from fusedtrain.kernels.gemm_gluon import (
    BK,
    BM,
    BN,
    launch,
    make_pipe,
    matrix_desc,
    no_prefetch,
    run,
    store_tile,
    tile_columns,
)


@aggregate
class _FwdArgs:
    y_desc: tma.tensor_descriptor
    h_desc: tma.tensor_descriptor
    b_ptr: gl.tensor
    N: gl.tensor
    HAS_BIAS: gl.constexpr
    STORE_H: gl.constexpr
    APPROX: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, y_desc, h_desc, b_ptr, N, HAS_BIAS, STORE_H, APPROX):
        self.y_desc, self.h_desc, self.b_ptr, self.N = y_desc, h_desc, b_ptr, N
        self.HAS_BIAS, self.STORE_H = gl.constexpr(HAS_BIAS), gl.constexpr(STORE_H)
        self.APPROX = gl.constexpr(APPROX)


@gluon.jit
def _fwd_epilogue(e, acc, buf, bar, off_m, off_n, j):
    if e.HAS_BIAS:
        cols = tile_columns(off_n)
        acc = acc + gl.load(e.b_ptr + cols, mask=cols < e.N, other=0.0).to(gl.float32)[None, :]
    y = gelu(acc, e.APPROX)
    if e.STORE_H:
        store_tile(e.h_desc, buf, acc, off_m, off_n)
    store_tile(e.y_desc, buf, y, off_m, off_n)


@fast_launch
@gluon.jit
def _linear_gelu_fwd_ws_kernel(x_ptr, w_ptr, b_ptr, y_ptr, h_ptr, M, N, K, s_xm, s_wn, s_ym,
                               s_hm, HAS_BIAS: gl.constexpr, STORE_H: gl.constexpr,
                               APPROX: gl.constexpr):
    y_desc = matrix_desc(y_ptr, M, N, s_ym, BM, BN)
    p = make_pipe(matrix_desc(x_ptr, M, K, s_xm, BM, BK), matrix_desc(w_ptr, N, K, s_wn, BN, BK),
                  M, N, K, True)
    args = _FwdArgs(y_desc, matrix_desc(h_ptr, M, N, s_hm, BM, BN), b_ptr, gl.to_tensor(N),
                    HAS_BIAS, STORE_H, APPROX)
    run(p, args, y_desc.dtype, no_prefetch, _fwd_epilogue)


@aggregate
class _DgeluArgs:
    h_desc: tma.tensor_descriptor
    dh_desc: tma.tensor_descriptor
    part_ptr: gl.tensor
    N: gl.tensor
    COL_SUMS: gl.constexpr
    APPROX: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, h_desc, dh_desc, part_ptr, N, COL_SUMS, APPROX):
        self.h_desc, self.dh_desc, self.part_ptr, self.N = h_desc, dh_desc, part_ptr, N
        self.COL_SUMS, self.APPROX = gl.constexpr(COL_SUMS), gl.constexpr(APPROX)


@gluon.jit
def _load_h(e, buf, bar, off_m, off_n):
    """h's tile into buf (which the last tile's dh store has read out), completing bar."""
    tma.store_wait(pendings=0)
    mbarrier.expect(bar, e.h_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(e.h_desc, [off_m, off_n], bar, buf)


@gluon.jit
def _dgelu_epilogue(e, acc, buf, bar, off_m, off_n, j):
    # Rows past M are zero in acc and h (TMA reads zeros there): they add nothing to the sums.
    mbarrier.wait(bar, j & 1)
    dh = acc * gelu_grad(buf.load(acc.type.layout).to(gl.float32), e.APPROX)
    if e.COL_SUMS:
        cols = tile_columns(off_n)
        gl.store(e.part_ptr + (off_m // BM).to(gl.int64) * e.N + cols, gl.sum(dh, axis=0),
                 mask=cols < e.N)
    store_tile(e.dh_desc, buf, dh, off_m, off_n)


@fast_launch
@gluon.jit
def _matmul_dgelu_ws_kernel(dy_ptr, w_ptr, h_ptr, dh_ptr, part_ptr, M, N, K, s_dym, s_wk, s_hm,
                            s_dhm, COL_SUMS: gl.constexpr, APPROX: gl.constexpr):
    h_desc = matrix_desc(h_ptr, M, N, s_hm, BM, BN)
    p = make_pipe(matrix_desc(dy_ptr, M, K, s_dym, BM, BK), matrix_desc(w_ptr, K, N, s_wk, BK, BN),
                  M, N, K, False)
    args = _DgeluArgs(h_desc, matrix_desc(dh_ptr, M, N, s_dhm, BM, BN), part_ptr,
                      gl.to_tensor(N), COL_SUMS, APPROX)
    run(p, args, h_desc.dtype, _load_h, _dgelu_epilogue)


def linear_gelu_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    y: torch.Tensor, h: torch.Tensor | None, approx: int, key=None) -> None:
    """x: (M, K), weight: (N, K), bias: (N,) -> y = gelu(x @ W.T + b) and, unless h is None,
    h = x @ W.T + b, written into y and h: (M, N). approx: a GeluMode value (kernels.gelu);
    key: the call's signature, to plan the launch under (gemm_gluon.launch)."""
    M, K = x.shape
    N = weight.shape[0]
    h_arg = y if h is None else h  # never written without STORE_H
    launch(_linear_gelu_fwd_ws_kernel, M, N, x.device, x, weight,
           y if bias is None else bias, y, h_arg, M, N, K,
           x.stride(0), weight.stride(0), y.stride(0), h_arg.stride(0),
           key=key, HAS_BIAS=bias is not None, STORE_H=h is not None, APPROX=approx)


def matmul_dgelu(dy: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, dh: torch.Tensor,
                 parts: torch.Tensor | None, approx: int, key=None) -> None:
    """dy: (M, K), w2: (K, N), h: (M, N) -> dh = (dy @ w2) * gelu'(h) written into dh: (M, N),
    and unless parts is None, dh's column sums per BM rows into parts: (cdiv(M, BM), N)
    fp32 (before dh's rounding). key: as linear_gelu_fwd's."""
    M, K = dy.shape
    N = w2.shape[1]
    launch(_matmul_dgelu_ws_kernel, M, N, dy.device, dy, w2, h, dh,
           dh if parts is None else parts, M, N, K,
           dy.stride(0), w2.stride(0), h.stride(0), dh.stride(0),
           key=key, COL_SUMS=parts is not None, APPROX=approx)
