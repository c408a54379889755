"""Embedding lookups and their backward by fp32 atomic adds.

  embedding_fwd  x[n] = W[idx[n]] (+ P[n % T]): a token table's rows, with a position
                 table's rows added in the same pass (GPT's input: tokens of (B, T)
                 sequences flattened, so token n sits at position n % T)
  embedding_bwd  dW[idx[n]] += dy[n] (and dP[n % T] += dy[n])

A row id outside [0, V) gives a row of NaN (as F.embedding would raise, but without a sync
to check the ids) and adds no gradient.

PyTorch's CUDA backward of an embedding sorts the token ids, then sums each id's rows
(radix sorts, a segment scan and two more kernels: ~0.3 ms a GPT-2 step on an H200);
here one kernel adds each token's row into the fp32 gradient, the additions to one row
meeting in L2. Their order, and so the last bits of a row shared by several tokens, vary
run to run: under torch.use_deterministic_algorithms(True) the ops keep PyTorch's sorted
backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels._device import ceil_div, stat_dtype
from fusedtrain.kernels._launch import fast_launch

# 16 tokens x 256 columns a program: 4K elements, 16 per thread at 8 warps (each with its
# own 64-bit address).
_BLOCK_T, _BLOCK_C, _WARPS = 16, 256, 8


@triton.jit
def _token_tile(idx_ptr, N, C, T, V, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tokens (as int64 row offsets), their table rows and positions, its
    columns, the mask of the (BLOCK_T, BLOCK_C) tile inside (N, C), and that mask where
    the row id is a valid one, in [0, V)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (tokens < N)[:, None] & (cols < C)[None, :]
    rows = tl.load(idx_ptr + tokens, mask=tokens < N, other=0).to(tl.int64)
    valid = mask & ((rows >= 0) & (rows < V))[:, None]
    return tokens.to(tl.int64), rows, tokens % T, cols, mask, valid


@triton.jit
def _rows_at(base, rows, stride, cols):
    """Pointers to a (len(rows), len(cols)) tile: rows `rows` of a matrix at `base`."""
    return base + rows[:, None] * stride + cols[None, :]


@fast_launch
@triton.jit
def _embedding_fwd_kernel(idx_ptr, w_ptr, pos_ptr, x_ptr, N, C, T, V, s_w, s_pos, s_x,
                          POSITIONS: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    tokens, rows, positions, cols, mask, valid = _token_tile(idx_ptr, N, C, T, V, BLOCK_T,
                                                             BLOCK_C)
    x = tl.load(_rows_at(w_ptr, rows, s_w, cols), mask=valid, other=float("nan"))
    if POSITIONS:
        x += tl.load(_rows_at(pos_ptr, positions, s_pos, cols), mask=mask, other=0.0)
    tl.store(_rows_at(x_ptr, tokens, s_x, cols), x.to(x_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _embedding_bwd_kernel(idx_ptr, dy_ptr, dw_ptr, dpos_ptr, N, C, T, V, s_dy, s_dw, s_dpos,
                          POSITIONS: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    tokens, rows, positions, cols, _, valid = _token_tile(idx_ptr, N, C, T, V, BLOCK_T,
                                                          BLOCK_C)
    g = tl.load(_rows_at(dy_ptr, tokens, s_dy, cols), mask=valid, other=0.0)
    g = g.to(dw_ptr.dtype.element_ty)
    tl.atomic_add(_rows_at(dw_ptr, rows, s_dw, cols), g, mask=valid, sem="relaxed")
    if POSITIONS:
        tl.atomic_add(_rows_at(dpos_ptr, positions, s_dpos, cols), g, mask=valid, sem="relaxed")


def _grid(N: int, C: int) -> tuple[int, int]:
    return ceil_div(N, _BLOCK_T), ceil_div(C, _BLOCK_C)


def embedding_fwd(idx: torch.Tensor, weight: torch.Tensor,
                  positions: torch.Tensor | None = None, seq_len: int = 1) -> torch.Tensor:
    """idx: (N,) row ids, weight: (V, C), positions: (P, C) with P >= seq_len, or None ->
    x: (N, C) in weight's dtype, x[n] = weight[idx[n]] + positions[n % seq_len] (NaN for an
    id outside [0, V))."""
    idx = idx.contiguous()
    N, C = idx.shape[0], weight.shape[1]
    x = torch.empty((N, C), device=weight.device, dtype=weight.dtype)
    pos = weight if positions is None else positions  # not read without positions
    _embedding_fwd_kernel[_grid(N, C)](
        idx, weight, pos, x, N, C, seq_len, weight.shape[0], weight.stride(0), pos.stride(0),
        x.stride(0),
        POSITIONS=positions is not None, BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C, num_warps=_WARPS)
    return x


def embedding_bwd(idx: torch.Tensor, dy: torch.Tensor, num_rows: int,
                  dw: torch.Tensor | None = None, num_positions: int = 0,
                  seq_len: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """idx: (N,) row ids, dy: (N, C) -> (dW, dP): dW (num_rows, C) with dy's rows added at
    idx (none for an id outside [0, num_rows)), accumulated in fp32 (fp64 for fp64 dy),
    into `dw` in place when given (of that dtype); with num_positions, dP (num_positions,
    C) with dy's row n added at position n % seq_len (else None)."""
    idx = idx.contiguous()  # read with unit stride (a 1-D view may have another)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    N, C = dy.shape
    acc = stat_dtype(dy)
    if dw is None:
        dw = torch.zeros((num_rows, C), device=dy.device, dtype=acc)
    dpos = (torch.zeros((num_positions, C), device=dy.device, dtype=acc) if num_positions
            else None)
    target = dw if dpos is None else dpos  # not written without positions
    _embedding_bwd_kernel[_grid(N, C)](
        idx, dy, dw, target, N, C, seq_len, num_rows, dy.stride(0), dw.stride(0),
        target.stride(0),
        POSITIONS=dpos is not None, BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C, num_warps=_WARPS)
    return dw, dpos
