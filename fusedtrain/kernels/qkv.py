"""Fused QKV projection kernels: one GEMM over W_qkv = [Wq|Wk|Wv] (3C, C) whose epilogue
writes q, k, v straight into the head-split (B, H, T, D) layout, and a backward that
reads dq, dk, dv in place from that layout (no concatenation, no transpose copies).

Index maps used throughout, with M = B*T tokens and the 3C output features split into
segments s in {q, k, v} of C = H*D features each:
  token m   -> (b, t) = (m // T, m % T)
  feature c -> (h, d) = (c // D, c % D)        within segment s
Every program works inside one segment, so its q/k/v pointer is a scalar choice.
Block sizes: triton.autotune over the shared GEMM tilings, keyed on (M, C).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels._common import (
    INTERPRET_GEMM,
    WIDE_GEMM,
    acc_dtype,
    autotune,
    cdiv,
    dot_precision,
    gemm_configs,
    grouped_tile,
    matmul_acc,
    pick3,
)


@autotune(gemm_configs(), key=["M", "C"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _qkv_fwd_kernel(
    x_ptr, w_ptr, b_ptr, q_ptr, k_ptr, v_ptr, M, C, T, D,
    s_xb, s_xt, s_xc, s_w0, s_w1, s_ob, s_oh, s_ot, s_od,
    HAS_BIAS: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tiles_per_seg = cdiv(C, BLOCK_N)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, 3 * tiles_per_seg * BLOCK_N,
                                BLOCK_M, BLOCK_N, GROUP_M)
    seg = pid_n // tiles_per_seg
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = (pid_n % tiles_per_seg) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, c_ok = offs_m < M, offs_c < C
    b = offs_m.to(tl.int64) // T
    t = offs_m.to(tl.int64) % T
    w_rows = (seg * C + offs_c).to(tl.int64)  # rows of W_qkv this tile produces
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    # out[m, c] = sum_j x[b, t, j] * W[seg*C + c, j]
    acc = matmul_acc(acc, x_ptr, w_ptr, b * s_xb + t * s_xt, w_rows * s_w0, m_ok, c_ok,
                     1, C, 0, s_xc, 0, s_w1, BLOCK_K, PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + w_rows, mask=c_ok, other=0.0).to(ACC)[None, :]
    out = pick3(seg, q_ptr, k_ptr, v_ptr)
    dst = (out + (b * s_ob + t * s_ot)[:, None]
           + ((offs_c // D).to(tl.int64) * s_oh + (offs_c % D) * s_od)[None, :])
    tl.store(dst, acc.to(q_ptr.dtype.element_ty), mask=m_ok[:, None] & c_ok[None, :])


@autotune(gemm_configs(), key=["M", "C"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _qkv_dx_kernel(
    dq_ptr, dk_ptr, dv_ptr, w_ptr, dx_ptr, M, C, T, H, D,
    s_ob, s_oh, s_ot, s_od, s_w0, s_w1, s_dxb, s_dxt, s_dxc,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, C, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < C
    b = offs_m.to(tl.int64) // T
    t = offs_m.to(tl.int64) % T
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    # dx[m, n] = sum_s sum_(h, d) dseg[b, h, t, d] * W[s*C + h*D + d, n]
    for seg in tl.static_range(3):
        src = pick3(seg, dq_ptr, dk_ptr, dv_ptr)
        w_seg = w_ptr + seg * C * s_w0
        acc = matmul_acc(acc, src, w_seg, b * s_ob + t * s_ot, offs_n.to(tl.int64) * s_w1,
                         m_ok, n_ok, H, D, s_oh, s_od, D * s_w0, s_w0, BLOCK_K, PRECISION)
    dst = dx_ptr + (b * s_dxb + t * s_dxt)[:, None] + offs_n.to(tl.int64)[None, :] * s_dxc
    tl.store(dst, acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@autotune(gemm_configs(), key=["M", "C"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _qkv_dw_kernel(
    dq_ptr, dk_ptr, dv_ptr, x_ptr, dw_ptr, M, C, B, T, D,
    s_ob, s_oh, s_ot, s_od, s_xb, s_xt, s_xc, s_dw0, s_dw1,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tiles_per_seg = cdiv(C, BLOCK_M)
    pid_m, pid_n = grouped_tile(tl.program_id(0), 3 * tiles_per_seg * BLOCK_M, C,
                                BLOCK_M, BLOCK_N, GROUP_M)
    seg = pid_m // tiles_per_seg
    offs_r = (pid_m % tiles_per_seg) * BLOCK_M + tl.arange(0, BLOCK_M)  # feature (h, d)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok, n_ok = offs_r < C, offs_n < C
    src = pick3(seg, dq_ptr, dk_ptr, dv_ptr)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    # dW[s*C + r, n] = sum_(b, t) dseg[b, h(r), t, d(r)] * x[b, t, n]
    acc = matmul_acc(acc, src, x_ptr,
                     (offs_r // D).to(tl.int64) * s_oh + (offs_r % D) * s_od,
                     offs_n.to(tl.int64) * s_xc, r_ok, n_ok,
                     B, T, s_ob, s_ot, s_xb, s_xt, BLOCK_K, PRECISION)
    rows = (seg * C + offs_r).to(tl.int64)
    dst = dw_ptr + rows[:, None] * s_dw0 + offs_n.to(tl.int64)[None, :] * s_dw1
    tl.store(dst, acc.to(dw_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


def qkv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: (B, T, C), weight: (3C, C), bias: (3C,) -> q, k, v: (B, H, T, D), contiguous."""
    B, T, C = x.shape
    D = C // n_heads
    q, k, v = (torch.empty((B, n_heads, T, D), device=x.device, dtype=x.dtype)
               for _ in range(3))
    M = B * T
    grid = lambda meta: (  # noqa: E731
        triton.cdiv(M, meta["BLOCK_M"]) * 3 * triton.cdiv(C, meta["BLOCK_N"]),)
    _qkv_fwd_kernel[grid](
        x, weight, bias if bias is not None else x, q, k, v, M, C, T, D,
        *x.stride(), *weight.stride(), *q.stride(),
        HAS_BIAS=bias is not None, ACC=acc_dtype(x), PRECISION=dot_precision(x),
    )
    return q, k, v


def qkv_dx(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
           weight: torch.Tensor) -> torch.Tensor:
    """dq, dk, dv: (B, H, T, D) with equal strides, weight: (3C, C) -> dx: (B, T, C)."""
    B, H, T, D = dq.shape
    C = H * D
    dx = torch.empty((B, T, C), device=dq.device, dtype=dq.dtype)
    M = B * T
    grid = lambda meta: (  # noqa: E731
        triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(C, meta["BLOCK_N"]),)
    _qkv_dx_kernel[grid](
        dq, dk, dv, weight, dx, M, C, T, H, D, *dq.stride(), *weight.stride(), *dx.stride(),
        ACC=acc_dtype(dq), PRECISION=dot_precision(dq),
    )
    return dx


def qkv_dw(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
           x: torch.Tensor) -> torch.Tensor:
    """dq, dk, dv: (B, H, T, D) with equal strides, x: (B, T, C) -> dW_qkv: (3C, C)."""
    B, H, T, D = dq.shape
    C = H * D
    dw = torch.empty((3 * C, C), device=dq.device, dtype=dq.dtype)
    grid = lambda meta: (  # noqa: E731
        3 * triton.cdiv(C, meta["BLOCK_M"]) * triton.cdiv(C, meta["BLOCK_N"]),)
    _qkv_dw_kernel[grid](
        dq, dk, dv, x, dw, B * T, C, B, T, D, *dq.stride(), *x.stride(), *dw.stride(),
        ACC=acc_dtype(dq), PRECISION=dot_precision(dq),
    )
    return dw
