"""SwiGLU MLP kernels: the gate and up projections with h = silu(g) * u, and the
backward's one pass that recomputes silu(g) * u from the saved pre-activations instead of
reading it.

  swiglu_fwd   g = x @ Wg.T, u = x @ Wu.T and h = silu(g) * u, on one of two paths chosen
               once per operand signature (_forward_path):
               TMA   one persistent TMA GEMM (Hopper, 16-bit TMA-aligned operands, C below
                     _TMA_MAX_K): each x tile feeds both dots, h comes from the fp32
                     accumulators, g and u are stored only when asked;
               mm    two cuBLAS GEMMs, then one pass over g and u writing h (everything
                     else: wider inputs, other GPUs and dtypes, the CPU interpreter).
  swiglu_bwd   dh = dy @ Wd (cuBLAS), then one pass over dh, g, u: dg = dh * u * silu'(g)
               written over dh, du = dh * silu(g), and h = silu(g) * u for the down
               projection's weight gradient (a cuBLAS GEMM beside the other four).

silu(g) = g * sigmoid(g); silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
The backward's GEMMs and the wide forward's were Triton kernels with the SwiGLU steps in
their prologue and epilogue until cuBLAS with one elementwise pass measured faster
(docs/journal.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._device import acc_dtype, ceil_div
from fusedtrain.kernels._gemm import gemm_flags
from fusedtrain.kernels._launch import fast_launch, operand_signature, plan_once, stand_in
from fusedtrain.kernels._primitives import cdiv, device_fn, sigmoid, tile_ptrs
from fusedtrain.kernels._tma import (
    TmaConfig,
    column_halves,
    launch,
    matrix_desc,
    tile_origin,
    tma_config,
    tma_ok,
)


@device_fn
def _swiglu(g, u):
    return g * sigmoid(g) * u


@device_fn
def _dswiglu(dh, g, u):
    """(dg, du) of h = silu(g) * u given dh."""
    s = sigmoid(g)
    return dh * u * s * (1.0 + g * (1.0 - s)), dh * g * s


@fast_launch
@triton.jit
def _swiglu_act_kernel(g_ptr, u_ptr, h_ptr, M, N, s_gm, s_um, s_hm,
                       ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One (BLOCK_M, BLOCK_N) tile of h = silu(g) * u (the mm path's forward).
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    g = tl.load(tile_ptrs(g_ptr, offs_m, offs_n, s_gm, 1), mask=mask, other=0.0).to(ACC)
    u = tl.load(tile_ptrs(u_ptr, offs_m, offs_n, s_um, 1), mask=mask, other=0.0).to(ACC)
    tl.store(tile_ptrs(h_ptr, offs_m, offs_n, s_hm, 1),
             _swiglu(g, u).to(h_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _swiglu_bwd_kernel(dhg_ptr, g_ptr, u_ptr, du_ptr, h_ptr, M, N, s_dhm, s_gm, s_um, s_om,
                       ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One (BLOCK_M, BLOCK_N) tile: dh is read from dhg_ptr and dg written back over it.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    dh_ptrs = tile_ptrs(dhg_ptr, offs_m, offs_n, s_dhm, 1)
    dh = tl.load(dh_ptrs, mask=mask, other=0.0).to(ACC)
    g = tl.load(tile_ptrs(g_ptr, offs_m, offs_n, s_gm, 1), mask=mask, other=0.0).to(ACC)
    u = tl.load(tile_ptrs(u_ptr, offs_m, offs_n, s_um, 1), mask=mask, other=0.0).to(ACC)
    dg, du = _dswiglu(dh, g, u)
    tl.store(dh_ptrs, dg.to(dhg_ptr.dtype.element_ty), mask=mask)
    tl.store(tile_ptrs(du_ptr, offs_m, offs_n, s_om, 1), du.to(du_ptr.dtype.element_ty),
             mask=mask)
    tl.store(tile_ptrs(h_ptr, offs_m, offs_n, s_om, 1),
             _swiglu(g, u).to(h_ptr.dtype.element_ty), mask=mask)



# ---------------------------------------------------------------- TMA (Hopper) version
# The forward GEMM as a persistent TMA kernel (kernels/_tma.py), for 16-bit TMA-aligned
# operands on Hopper: one program per SM walking its tiles in one flattened loop, epilogues
# on the accumulator's column halves.


@device_fn
def _swiglu_store(g, u, off_m, off_n, g_desc, u_desc, h_desc, STORE_GU: tl.constexpr):
    """Epilogue of one column half of the forward: g, u (if asked) and h = silu(g) * u."""
    if STORE_GU:
        g_desc.store([off_m, off_n], g.to(g_desc.dtype))
        u_desc.store([off_m, off_n], u.to(u_desc.dtype))
    h_desc.store([off_m, off_n], _swiglu(g, u).to(h_desc.dtype))


@fast_launch
@triton.jit
def _swiglu_fwd_tma_kernel(
    x_ptr, wg_ptr, wu_ptr, g_ptr, u_ptr, h_ptr, M, N, K, s_xm, s_gn, s_un, s_om,
    STORE_GU: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # g = x @ Wg.T and u = x @ Wu.T: each x tile, loaded once, feeds both dots.
    x_desc = matrix_desc(x_ptr, M, K, s_xm, BLOCK_M, BLOCK_K)
    wg_desc = matrix_desc(wg_ptr, N, K, s_gn, BLOCK_N, BLOCK_K)
    wu_desc = matrix_desc(wu_ptr, N, K, s_un, BLOCK_N, BLOCK_K)
    g_desc = matrix_desc(g_ptr, M, N, s_om, BLOCK_M, BLOCK_N // 2)
    u_desc = matrix_desc(u_ptr, M, N, s_om, BLOCK_M, BLOCK_N // 2)
    h_desc = matrix_desc(h_ptr, M, N, s_om, BLOCK_M, BLOCK_N // 2)
    tiles = cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        off_m, off_n = tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
        acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
        for k in range(0, K, BLOCK_K):
            x = x_desc.load([off_m, k])
            acc_g = tl.dot(x, tl.trans(wg_desc.load([off_n, k])), acc_g,
                           input_precision=PRECISION, out_dtype=ACC)
            acc_u = tl.dot(x, tl.trans(wu_desc.load([off_n, k])), acc_u,
                           input_precision=PRECISION, out_dtype=ACC)
        g_left, g_right = column_halves(acc_g, BLOCK_M, BLOCK_N)
        u_left, u_right = column_halves(acc_u, BLOCK_M, BLOCK_N)
        _swiglu_store(g_left, u_left, off_m, off_n, g_desc, u_desc, h_desc, STORE_GU)
        _swiglu_store(g_right, u_right, off_m, off_n + BLOCK_N // 2, g_desc, u_desc, h_desc,
                      STORE_GU)


# The TMA forward's tiles: two (128, 128) fp32 accumulators live at once, so 128 x 128 over
# 8 warps, 3 stages.
_TMA_TILES = TmaConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def _tma_config(config: TmaConfig | None) -> TmaConfig:
    """`config` (tuning, tests), else _TMA_TILES (the interpreter's one config there)."""
    return config or (tma_config(0) if INTERPRET else _TMA_TILES)


# The widest input the TMA forward takes: from C = _TMA_MAX_K on, cuBLAS's two GEMMs and
# the pass over g and u run faster than the one GEMM with two accumulators (H100/H200,
# docs/journal.md).
_TMA_MAX_K = 1024


def _forward_path(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                  h: torch.Tensor, tuning: bool) -> str:
    """"tma" or "mm" (module docstring). A tuning call (a TmaConfig given) is the TMA
    kernel's."""
    if tuning:
        return "tma"
    return "tma" if x.shape[1] < _TMA_MAX_K and tma_ok(x, gate_weight, up_weight, h) else "mm"


# The elementwise passes' tile: 8K elements, 32 per thread at 8 warps (gelu_bwd's).
_PASS_TILE = (64, 128)


def _pass_grid(M: int, N: int) -> tuple[int, int]:
    return ceil_div(M, _PASS_TILE[0]), ceil_div(N, _PASS_TILE[1])


def swiglu_fwd(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
               store_gu: bool, config: TmaConfig | None = None
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """x: (M, K), gate_weight, up_weight: (N, K) -> (g, u, h), each (M, N) in x's dtype:
    g = x @ gate_weight.T, u = x @ up_weight.T (None unless store_gu), h = silu(g) * u.
    `config` (tuning) runs the TMA kernel with its tiles."""
    M, K = x.shape
    N = gate_weight.shape[0]
    h = torch.empty((M, N), device=x.device, dtype=x.dtype)
    key = None if config else (*operand_signature("swiglu_fwd", x, gate_weight, up_weight),
                               store_gu)
    path, flags = plan_once(key, lambda: (
        _forward_path(x, gate_weight, up_weight, h, config is not None),
        dict(STORE_GU=store_gu, **gemm_flags(x))))
    if path == "mm":
        g, u = torch.mm(x, gate_weight.t()), torch.mm(x, up_weight.t())
        _swiglu_act_kernel.planned(
            (M, N, g.dtype), (g, u, h, M, N, N, N, N),
            lambda: (_pass_grid(M, N), dict(ACC=acc_dtype(g), BLOCK_M=_PASS_TILE[0],
                                            BLOCK_N=_PASS_TILE[1], num_warps=8)))
        return (g, u, h) if store_gu else (None, None, h)
    # g and u are not written without STORE_GU
    g, u = (torch.empty_like(h) for _ in range(2)) if store_gu else (stand_in(h), stand_in(h))
    cfg = _tma_config(config)
    launch(_swiglu_fwd_tma_kernel, ceil_div(M, cfg.block_m) * ceil_div(N, cfg.block_n),
           x.device, x, gate_weight, up_weight, g, u, h, M, N, K, x.stride(0),
           gate_weight.stride(0), up_weight.stride(0), N, config=cfg, key=key, **flags)
    return (g, u, h) if store_gu else (None, None, h)


def swiglu_bwd(dy: torch.Tensor, down_weight: torch.Tensor, g: torch.Tensor,
               u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy: (M, C_out), down_weight: (C_out, N), g, u: (M, N) -> (dg, du, h), each (M, N) in
    g's dtype: dh = dy @ down_weight by cuBLAS, then one pass over dh, g, u writing
    dg = dh * u * silu'(g) over dh, du = dh * silu(g), and h = silu(g) * u recomputed (the
    forward's rounding) for the down projection's weight gradient."""
    dh = torch.mm(dy if dy.dtype == g.dtype else dy.to(g.dtype), down_weight)
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u.stride(-1) != 1:
        u = u.contiguous()
    M, N = dh.shape
    du, h = torch.empty_like(dh), torch.empty_like(dh)
    s_g, s_u = g.stride(0), u.stride(0)
    _swiglu_bwd_kernel.planned(
        (M, N, s_g, s_u, g.dtype), (dh, g, u, du, h, M, N, N, s_g, s_u, N),
        lambda: (_pass_grid(M, N), dict(ACC=acc_dtype(g), BLOCK_M=_PASS_TILE[0],
                                        BLOCK_N=_PASS_TILE[1], num_warps=8)))
    return dh, du, h
