"""Bias gradient of a linear layer: the column sums of its output gradient g (M, N).

A grid of (P, column blocks) programs; program (p, j) adds up row tiles p, p + P, ... of
column block j in an fp32 register tile (one reduction across its rows at the end, none
per tile), and writes one row of a (P, N) partial-sum buffer, which the same kernel then
sums with one program per narrow column block (P is a few hundred at most): no atomics,
the same result run to run. Against PyTorch's `g.sum(0)` on an H200: 36.3 vs 40.4 us at
16384 x 3072, 16.4 vs 25.5 at 16384 x 768, and exact in fp32 where `sum` rounds to bf16;
the fused MLP's measured forward+backward peak fell by 100 MB when its two bias
reductions moved here (not attributed further).

Kernels that produce g tile by tile (the MLP's dGELU GEMM, the GELU backward) can instead
write each tile's column sums as one row of such a partial-sum buffer
(`store_column_sums`), which then costs one short launch here instead of reading g again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._device import acc_dtype, ceil_div, next_pow2, sm_count, stat_dtype
from fusedtrain.kernels._launch import fast_launch
from fusedtrain.kernels._primitives import device_fn, row_sum

# A (BLOCK_M, BLOCK_N) tile of 8K elements, 32 per thread at 8 warps: 16 KB of bf16 per
# load, enough in flight with the loop's loads issued three tiles ahead.
_TILE = 8192
_WARPS = 8
# Up to this many rows, one pass: 2048 rows x 32 columns of fp32 per program at most.
_SHORT = 2048


@device_fn
def store_column_sums(part_ptr, row, cols, N, tile):
    """Row `row` of a (rows, N) partial-sum buffer, at columns `cols`: the column sums of
    `tile` (BLOCK_M, len(cols)), whose rows past the matrix's end must be zero."""
    tl.store(part_ptr + row.to(tl.int64) * N + cols,
             row_sum(tile, 0).to(part_ptr.dtype.element_ty), mask=cols < N)


@fast_launch
@triton.jit
def _column_sums_kernel(g_ptr, part_ptr, M, N, s_gm, ACC: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    p, n_progs = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    for start in tl.range(p * BLOCK_M, M, n_progs * BLOCK_M, num_stages=3):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        acc += tl.load(g_ptr + rows.to(tl.int64)[:, None] * s_gm + cols[None, :], mask=mask,
                       other=0.0).to(ACC)
    store_column_sums(part_ptr, p, cols, N, acc)


def bias_grad(g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """g: (M, N) -> g.sum(0): (N,), accumulated in fp32 (fp64 for fp64 g) and returned in
    `dtype` (default: the accumulation's), rounded once by the last pass's store: no
    separate cast kernel for a bias gradient in the bias's dtype."""
    if g.stride(-1) != 1:
        g = g.contiguous()
    M, N = g.shape
    if M <= _SHORT:
        out = torch.empty(N, device=g.device, dtype=dtype or stat_dtype(g))
        column_sums(g, out)
        return out
    block_n = min(256, next_pow2(N))
    # About four programs per SM in all (a few under the interpreter), each with rows.
    wanted = 4 if INTERPRET else max(1, 4 * sm_count(g.device) // ceil_div(N, block_n))
    programs = max(1, min(wanted, ceil_div(M, _TILE // block_n)))
    last = programs == 1
    parts = torch.empty((programs, N), device=g.device,
                        dtype=(dtype or stat_dtype(g)) if last else stat_dtype(g))
    _column_sums_kernel.planned(
        (M, N, g.stride(0), g.dtype, parts.dtype), (g, parts, M, N, g.stride(0)),
        lambda: ((programs, ceil_div(N, block_n)),
                 dict(ACC=acc_dtype(g), BLOCK_M=min(_TILE // block_n, next_pow2(M)),
                      BLOCK_N=block_n, num_warps=_WARPS)))
    return parts.view(N) if last else bias_grad(parts, dtype)


def column_sums(g: torch.Tensor, out: torch.Tensor) -> None:
    """out (N values, contiguous) = g.sum(0) for g (M, N) of unit column stride and at most
    2048 rows (a buffer of partial sums): one program per 32 columns reads them whole,
    accumulating in fp32 (fp64 for fp64 g), and writes them once in out's dtype."""
    M, N = g.shape
    s_gm = g.stride(0)

    def launch():
        if M > _SHORT:
            raise ValueError(f"column_sums takes at most {_SHORT} rows, got {M}")
        block_n = min(32, next_pow2(N))
        return (1, ceil_div(N, block_n)), dict(
            ACC=acc_dtype(g), BLOCK_M=min(_TILE // block_n, next_pow2(max(M, 1))),
            BLOCK_N=block_n, num_warps=_WARPS)

    _column_sums_kernel.planned((M, N, s_gm, g.dtype, out.dtype), (g, out, M, N, s_gm), launch)
