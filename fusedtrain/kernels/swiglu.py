"""SwiGLU MLP kernels: the gate and up projections in one GEMM, and the backward GEMMs that
recompute silu(g) * u from the saved pre-activations instead of reading it.

  swiglu_fwd          g = x @ Wg.T, u = x @ Wu.T (one x tile feeds both dots), and
                      h = silu(g) * u from the fp32 accumulators; g and u stored for
                      backward only when asked, h for the down projection.
  matmul_dswiglu      dh = dy @ Wd with the SwiGLU derivative in the epilogue, from g and
                      u: dg = dh * u * silu'(g), du = dh * silu(g).
  matmul_swiglu_rhs   dWd = dy.T @ h, h = silu(g) * u recomputed as each tile of g and u is
                      loaded (rounded to dy's dtype, as the forward's h was), so h never
                      exists in memory in backward.

silu(g) = g * sigmoid(g); silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
Pointer-based GEMMs (any strides, fp32/fp64 too), block sizes from triton.autotune over
kernels._gemm's tilings keyed on M, N, K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels._device import ceil_div, stat_dtype
from fusedtrain.kernels._gemm import (
    INTERPRET_GEMM,
    WIDE_GEMM,
    gemm_configs,
    gemm_flags,
    gemm_tile,
    grouped_tile,
)
from fusedtrain.kernels._launch import operand_signature
from fusedtrain.kernels._primitives import device_fn, sigmoid, tile_ptrs
from fusedtrain.kernels._tma import k_splits
from fusedtrain.kernels._tuning import autotune

# Two (BLOCK_M, BLOCK_N) fp32 tiles live at once in each kernel (two accumulators, or the
# accumulator and g, u in the epilogue): at most 128 x 128 over 8 warps. compile_report's
# sm_90 build (triton 3.9) of GEMM_SHAPES' 256-wide and 4-warp 128 x 128 tiles spilled
# 2.9-5.6 KB a thread; these spill at most 1.6 KB (the dh GEMM at 128 x 128), the 64 x 64
# tiles none.
_SHAPES = [(128, 128, 64, 3, 8), (128, 128, 32, 4, 8), (128, 64, 64, 4, 4),
           (64, 128, 64, 4, 4), (64, 64, 64, 4, 4)]


@device_fn
def _swiglu(g, u):
    return g * sigmoid(g) * u


@autotune(gemm_configs(_SHAPES), key=["M", "N", "K"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _swiglu_fwd_kernel(
    x_ptr, wg_ptr, wu_ptr, g_ptr, u_ptr, h_ptr, M, N, K,
    s_xm, s_xk, s_gn, s_gk, s_un, s_uk, s_om, s_on,
    STORE_GU: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows, cols_ok = offs_m.to(tl.int64) * s_xm, offs_n < N
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + rows[:, None] + k[None, :] * s_xk,
                    mask=(offs_m < M)[:, None] & (k < K)[None, :], other=0.0)
        w_ok = (k < K)[:, None] & cols_ok[None, :]
        # B[k, n] = W[n, k]: the transpose is only a choice of strides.
        wg = tl.load(wg_ptr + k[:, None] * s_gk + offs_n.to(tl.int64)[None, :] * s_gn,
                     mask=w_ok, other=0.0)
        wu = tl.load(wu_ptr + k[:, None] * s_uk + offs_n.to(tl.int64)[None, :] * s_un,
                     mask=w_ok, other=0.0)
        acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION, out_dtype=ACC)
        acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION, out_dtype=ACC)
    mask = (offs_m < M)[:, None] & cols_ok[None, :]
    if STORE_GU:
        tl.store(tile_ptrs(g_ptr, offs_m, offs_n, s_om, s_on),
                 acc_g.to(g_ptr.dtype.element_ty), mask=mask)
        tl.store(tile_ptrs(u_ptr, offs_m, offs_n, s_om, s_on),
                 acc_u.to(u_ptr.dtype.element_ty), mask=mask)
    tl.store(tile_ptrs(h_ptr, offs_m, offs_n, s_om, s_on),
             _swiglu(acc_g, acc_u).to(h_ptr.dtype.element_ty), mask=mask)


@autotune(gemm_configs(_SHAPES), key=["M", "N", "K"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _matmul_dswiglu_kernel(
    dy_ptr, w_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, M, N, K,
    s_dym, s_dyk, s_wk, s_wn, s_om, s_on,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    dh, offs_m, offs_n, mask = gemm_tile(dy_ptr, w_ptr, M, N, K, s_dym, s_dyk, s_wk, s_wn,
                                         ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    g = tl.load(tile_ptrs(g_ptr, offs_m, offs_n, s_om, s_on), mask=mask, other=0.0).to(ACC)
    u = tl.load(tile_ptrs(u_ptr, offs_m, offs_n, s_om, s_on), mask=mask, other=0.0).to(ACC)
    s = sigmoid(g)
    tl.store(tile_ptrs(du_ptr, offs_m, offs_n, s_om, s_on),
             (dh * g * s).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(tile_ptrs(dg_ptr, offs_m, offs_n, s_om, s_on),
             (dh * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)


@autotune(gemm_configs(_SHAPES), key=["M", "N", "K_SPLIT"], interpret=INTERPRET_GEMM,
          wide=WIDE_GEMM)
@triton.jit
def _matmul_swiglu_rhs_kernel(
    a_ptr, g_ptr, u_ptr, c_ptr, M, N, K, K_SPLIT,
    s_am, s_ak, s_hk, s_hn, s_cs, s_cm, s_cn,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Split-K as matmul_gelu_rhs: program (tile, s) reduces k in [s * K_SPLIT, (s + 1) *
    # K_SPLIT) into slice s of C (the output, C_out x H, is small and K, the tokens, long).
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = tl.program_id(1).to(tl.int64) * K_SPLIT
    k_len = tl.minimum(K - k0, K_SPLIT).to(tl.int32)
    a_ptr += k0 * s_ak
    g_ptr += k0 * s_hk
    u_ptr += k0 * s_hk
    rows, cols = offs_m.to(tl.int64) * s_am, offs_n.to(tl.int64) * s_hn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    for kk in range(0, k_len, BLOCK_K):
        k = kk + offs_k
        a = tl.load(a_ptr + rows[:, None] + k[None, :] * s_ak,
                    mask=(offs_m < M)[:, None] & (k < k_len)[None, :], other=0.0)
        h_ok = (k < k_len)[:, None] & (offs_n < N)[None, :]
        g = tl.load(g_ptr + k[:, None] * s_hk + cols[None, :], mask=h_ok, other=0.0)
        u = tl.load(u_ptr + k[:, None] * s_hk + cols[None, :], mask=h_ok, other=0.0)
        h = _swiglu(g.to(ACC), u.to(ACC)).to(a.dtype)
        acc = tl.dot(a, h, acc, input_precision=PRECISION, out_dtype=ACC)
    c_ptr += tl.program_id(1).to(tl.int64) * s_cs
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(tile_ptrs(c_ptr, offs_m, offs_n, s_cm, s_cn), acc.to(c_ptr.dtype.element_ty),
             mask=mask)


def _grid(M: int, N: int, *splits: int):
    """The programs of an (M, N) output: one a tile (GROUP_M order), times `splits`."""
    return lambda meta: (ceil_div(M, meta["BLOCK_M"]) * ceil_div(N, meta["BLOCK_N"]), *splits)


def swiglu_fwd(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
               store_gu: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """x: (M, K), gate_weight, up_weight: (N, K) -> (g, u, h), each (M, N) in x's dtype:
    g = x @ gate_weight.T, u = x @ up_weight.T (None unless store_gu), h = silu(g) * u."""
    M, K = x.shape
    N = gate_weight.shape[0]
    h = torch.empty((M, N), device=x.device, dtype=x.dtype)
    g, u = (torch.empty_like(h) for _ in range(2)) if store_gu else (h, h)  # h: not written
    key = (*operand_signature("swiglu_fwd", x, gate_weight, up_weight), store_gu)
    _swiglu_fwd_kernel.planned(key, (
        x, gate_weight, up_weight, g, u, h, M, N, K, x.stride(0), x.stride(1),
        gate_weight.stride(0), gate_weight.stride(1), up_weight.stride(0), up_weight.stride(1),
        h.stride(0), h.stride(1)), lambda: (_grid(M, N), dict(STORE_GU=store_gu,
                                                                **gemm_flags(x))))
    return (g, u, h) if store_gu else (None, None, h)


def matmul_dswiglu(dy: torch.Tensor, down_weight: torch.Tensor, g: torch.Tensor,
                   u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dy: (M, C_out), down_weight: (C_out, N), g, u: (M, N) of one layout -> (dg, du):
    (M, N) in g's dtype and layout, through dh = dy @ down_weight."""
    M, K = dy.shape
    N = down_weight.shape[1]
    dg, du = (torch.empty_like(g) for _ in range(2))
    key = operand_signature("dswiglu", dy, down_weight, g, u)
    _matmul_dswiglu_kernel.planned(key, (
        dy, down_weight, g, u, dg, du, M, N, K, dy.stride(0), dy.stride(1),
        down_weight.stride(0), down_weight.stride(1), g.stride(0), g.stride(1)),
        lambda: (_grid(M, N), gemm_flags(dy)))
    return dg, du


def matmul_swiglu_rhs(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """dy: (K, M), g, u: (K, N) of one layout -> dy.T @ (silu(g) * u): (M, N) in out_dtype,
    reduced in fp32 (fp64) over slices of K (kernels._tma.k_splits) that the host adds."""
    K, M = dy.shape
    N = g.shape[1]
    splits = k_splits(ceil_div(M, 128) * ceil_div(N, 128), K, dy.device)
    k_split = ceil_div(ceil_div(K, splits), 128) * 128  # a multiple of any BLOCK_K
    splits = ceil_div(K, k_split)
    part_dtype = out_dtype if splits == 1 else stat_dtype(dy)
    out = torch.empty(splits, M, N, device=dy.device, dtype=part_dtype)
    key = (*operand_signature("swiglu_rhs", dy, g, u), out_dtype)
    _matmul_swiglu_rhs_kernel.planned(key, (
        dy, g, u, out, M, N, K, k_split, dy.stride(1), dy.stride(0), g.stride(0), g.stride(1),
        M * N, N, 1), lambda: (_grid(M, N, splits), gemm_flags(dy)))
    return out[0] if splits == 1 else out.sum(0).to(out_dtype)
