"""Linear+GELU kernels.

  linear_gelu_fwd   y = gelu(x @ W.T + b), bias and GELU applied to the accumulator in
                    registers; optionally also writes h = x @ W.T + b for backward.
  matmul_dgelu      dh = (dy @ W2) * gelu'(h): the MLP's backward GEMM, gelu'(h)
                    recomputed from h in the epilogue (no dGELU tensor in memory).
  matmul_gelu_rhs   dW2 = dy.T @ gelu(h): gelu(h) recomputed while each tile of h is
                    loaded, so gelu(h) is never stored.
  gelu_bwd          dh = dy * gelu'(h), elementwise (standalone linear_gelu backward).

Block sizes come from triton.autotune (Hopper-leaning tilings, keyed on M, N, K;
choices cached on disk). All 2-D operands take arbitrary strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._common import (
    INTERPRET_GEMM,
    WIDE_GEMM,
    acc_dtype,
    autotune,
    dot_precision,
    gelu,
    gelu_grad,
    gelu_mode,
    gemm_configs,
    gemm_tile,
    sm_count,
    stat_dtype,
    tile_ptrs,
)


@autotune(gemm_configs(), key=["M", "N", "K"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _linear_gelu_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, h_ptr, M, N, K,
    s_xm, s_xk, s_wn, s_wk, s_ym, s_yn, s_hm, s_hn,
    HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, APPROX: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # B[k, n] = W[n, k]: the transpose is only a choice of strides.
    acc, offs_m, offs_n, mask = gemm_tile(x_ptr, w_ptr, M, N, K, s_xm, s_xk, s_wk, s_wn, ACC,
                                          PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(ACC)[None, :]
    if STORE_H:
        tl.store(tile_ptrs(h_ptr, offs_m, offs_n, s_hm, s_hn), acc.to(h_ptr.dtype.element_ty),
                 mask=mask)
    y = gelu(acc, APPROX)
    tl.store(tile_ptrs(y_ptr, offs_m, offs_n, s_ym, s_yn), y.to(y_ptr.dtype.element_ty),
             mask=mask)


@autotune(gemm_configs(), key=["M", "N", "K"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _matmul_dgelu_kernel(
    dy_ptr, w_ptr, h_ptr, dh_ptr, M, N, K,
    s_dym, s_dyk, s_wk, s_wn, s_hm, s_hn, s_dhm, s_dhn,
    APPROX: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    acc, offs_m, offs_n, mask = gemm_tile(dy_ptr, w_ptr, M, N, K, s_dym, s_dyk, s_wk, s_wn,
                                          ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    h = tl.load(tile_ptrs(h_ptr, offs_m, offs_n, s_hm, s_hn), mask=mask, other=0.0).to(ACC)
    dh = acc * gelu_grad(h, APPROX)
    tl.store(tile_ptrs(dh_ptr, offs_m, offs_n, s_dhm, s_dhn), dh.to(dh_ptr.dtype.element_ty),
             mask=mask)


@autotune(gemm_configs(), key=["M", "N", "K_SPLIT"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _matmul_gelu_rhs_kernel(
    a_ptr, h_ptr, c_ptr, M, N, K, K_SPLIT,
    s_am, s_ak, s_hk, s_hn, s_cs, s_cm, s_cn,
    APPROX: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Split-K: program (tile, s) reduces k in [s * K_SPLIT, (s + 1) * K_SPLIT) and writes
    # its own slice s of C; the host sums the slices. The output (C x 4C) is small and
    # K (tokens) long, so without the split too few tiles exist to fill the GPU.
    k0 = tl.program_id(1).to(tl.int64) * K_SPLIT
    k_len = tl.minimum(K - k0, K_SPLIT).to(tl.int32)
    acc, offs_m, offs_n, mask = gemm_tile(a_ptr + k0 * s_ak, h_ptr + k0 * s_hk, M, N, k_len,
                                          s_am, s_ak, s_hk, s_hn,
                                          ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                          B_GELU=True, APPROX=APPROX)
    c_ptr += tl.program_id(1).to(tl.int64) * s_cs
    tl.store(tile_ptrs(c_ptr, offs_m, offs_n, s_cm, s_cn), acc.to(c_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _gelu_bwd_kernel(dy_ptr, h_ptr, dh_ptr, n_elements, APPROX: tl.constexpr,
                     ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(ACC)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(ACC)
    tl.store(dh_ptr + offs, (dy * gelu_grad(h, APPROX)).to(dh_ptr.dtype.element_ty), mask=mask)


def _gemm_grid(M: int, N: int):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


def linear_gelu_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    approximate: str, store_h: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: (M, K), weight: (N, K), bias: (N,) -> (y, h), both (M, N); h is None unless store_h."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    h = torch.empty_like(y) if store_h else None
    h_arg = h if store_h else y  # never written when STORE_H is off
    _linear_gelu_fwd_kernel[_gemm_grid(M, N)](
        x, weight, bias if bias is not None else x, y, h_arg, M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        y.stride(0), y.stride(1), h_arg.stride(0), h_arg.stride(1),
        HAS_BIAS=bias is not None, STORE_H=store_h, APPROX=gelu_mode(approximate, x),
        ACC=acc_dtype(x), PRECISION=dot_precision(x),
    )
    return y, h


def matmul_dgelu(dy: torch.Tensor, w2: torch.Tensor, h: torch.Tensor,
                 approximate: str) -> torch.Tensor:
    """dy: (M, N2), w2: (N2, N), h: (M, N) -> dh = (dy @ w2) * gelu'(h): (M, N)."""
    M, K = dy.shape
    N = w2.shape[1]
    dh = torch.empty((M, N), device=dy.device, dtype=dy.dtype)
    _matmul_dgelu_kernel[_gemm_grid(M, N)](
        dy, w2, h, dh, M, N, K,
        dy.stride(0), dy.stride(1), w2.stride(0), w2.stride(1),
        h.stride(0), h.stride(1), dh.stride(0), dh.stride(1),
        APPROX=gelu_mode(approximate, dy), ACC=acc_dtype(dy), PRECISION=dot_precision(dy),
    )
    return dh


def k_splits(M: int, N: int, K: int, device: torch.device) -> int:
    """How many slices to split a GEMM's reduction over: enough (128 x 128) output tiles
    times slices for about four programs per SM, each slice at least 1024 long."""
    if INTERPRET:
        return 1
    tiles = triton.cdiv(M, 128) * triton.cdiv(N, 128)
    return max(1, min(4 * sm_count(device) // tiles, K // 1024, 8))


def matmul_gelu_rhs(dy: torch.Tensor, h: torch.Tensor, approximate: str,
                    splits: int | None = None) -> torch.Tensor:
    """dy: (K, M), h: (K, N) -> dy.T @ gelu(h): (M, N), reduced over `splits` slices of K
    (default: k_splits) with fp32 partial sums."""
    K, M = dy.shape
    N = h.shape[1]
    splits = splits or k_splits(M, N, K, dy.device)
    k_split = triton.cdiv(triton.cdiv(K, splits), 64) * 64
    splits = triton.cdiv(K, k_split)
    part_dtype = dy.dtype if splits == 1 else stat_dtype(dy)
    out = torch.empty((splits, M, N), device=dy.device, dtype=part_dtype)
    _matmul_gelu_rhs_kernel[lambda meta: (_gemm_grid(M, N)(meta)[0], splits)](
        dy, h, out, M, N, K, k_split,
        dy.stride(1), dy.stride(0), h.stride(0), h.stride(1), *out.stride(),
        APPROX=gelu_mode(approximate, dy), ACC=acc_dtype(dy), PRECISION=dot_precision(dy),
    )
    return out[0] if splits == 1 else out.sum(0).to(dy.dtype)


def gelu_bwd(dy: torch.Tensor, h: torch.Tensor, approximate: str) -> torch.Tensor:
    """dy, h: same shape -> dy * gelu'(h)."""
    dy, h = dy.contiguous(), h.contiguous()
    dh = torch.empty_like(h)
    n = h.numel()
    block = 4096
    _gelu_bwd_kernel[(triton.cdiv(n, block),)](
        dy, h, dh, n, APPROX=gelu_mode(approximate, h), ACC=acc_dtype(h), BLOCK=block)
    return dh
