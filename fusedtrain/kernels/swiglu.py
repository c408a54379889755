"""SwiGLU MLP kernels: h = silu(g) * u after cuBLAS's gate and up GEMMs, and the
backward's one pass that recomputes silu(g) * u from the saved pre-activations instead of
reading it.

  swiglu_fwd   g = x @ Wg.T and u = x @ Wu.T by cuBLAS, then one pass over g and u
               writing h = silu(g) * u for the down projection.
  swiglu_bwd   dh = dy @ Wd (cuBLAS), then one pass over dh, g, u: dg = dh * u * silu'(g)
               written over dh, du = dh * silu(g), and h = silu(g) * u for the down
               projection's weight gradient (a cuBLAS GEMM beside the other four).

silu(g) = g * sigmoid(g); silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
Triton GEMMs with the SwiGLU steps in their prologue and epilogue (a forward with one x
tile feeding both dots, a backward with the derivative in dh's epilogue) measured slower
than cuBLAS and these passes at every width tried (docs/journal.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels._device import acc_dtype, ceil_div
from fusedtrain.kernels._launch import fast_launch
from fusedtrain.kernels._primitives import device_fn, sigmoid, tile_ptrs
from fusedtrain.kernels._tma import GLUON_EPILOGUE_MAX_K, gluon_ok


@device_fn
def swiglu_value(g, u):
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
    # One (BLOCK_M, BLOCK_N) tile of h = silu(g) * u.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    g = tl.load(tile_ptrs(g_ptr, offs_m, offs_n, s_gm, 1), mask=mask, other=0.0).to(ACC)
    u = tl.load(tile_ptrs(u_ptr, offs_m, offs_n, s_um, 1), mask=mask, other=0.0).to(ACC)
    tl.store(tile_ptrs(h_ptr, offs_m, offs_n, s_hm, 1),
             swiglu_value(g, u).to(h_ptr.dtype.element_ty), mask=mask)


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
             swiglu_value(g, u).to(h_ptr.dtype.element_ty), mask=mask)


# The elementwise passes' tile: 8K elements, 32 per thread at 8 warps (gelu_bwd's).
_PASS_TILE = (64, 128)


def _pass_plan(M: int, N: int, g: torch.Tensor) -> tuple[tuple[int, int], dict]:
    """Grid and constexprs of either pass over (M, N) elements like g."""
    return ((ceil_div(M, _PASS_TILE[0]), ceil_div(N, _PASS_TILE[1])),
            dict(ACC=acc_dtype(g), BLOCK_M=_PASS_TILE[0], BLOCK_N=_PASS_TILE[1],
                 num_warps=8))


def swiglu_fwd(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: (M, K), gate_weight, up_weight: (N, K) -> (g, u, h), each (M, N) in x's dtype:
    g = x @ gate_weight.T, u = x @ up_weight.T, h = silu(g) * u: one Gluon GEMM with the
    activation in its epilogue on an sm_90 GPU up to K = GLUON_EPILOGUE_MAX_K, else two
    cuBLAS GEMMs and an activation pass."""
    if (x.shape[1] <= GLUON_EPILOGUE_MAX_K and gate_weight.shape[0] % 8 == 0
            and gluon_ok(x, gate_weight, up_weight)):
        from fusedtrain.kernels import swiglu_gluon  # Gluon: imported where it compiles

        g, u, h = (x.new_empty((x.shape[0], gate_weight.shape[0])) for _ in range(3))
        swiglu_gluon.swiglu_fwd(x, gate_weight, up_weight, g, u, h)
        return g, u, h
    g, u = torch.mm(x, gate_weight.t()), torch.mm(x, up_weight.t())
    M, N = g.shape
    h = torch.empty_like(g)
    _swiglu_act_kernel.planned((M, N, g.dtype), (g, u, h, M, N, N, N, N),
                               lambda: _pass_plan(M, N, g))
    return g, u, h


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
        lambda: _pass_plan(M, N, g))
    return dh, du, h
