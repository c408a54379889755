"""Embedding lookups and their backward by fp32 atomic adds.

  embedding_fwd  x[n] = W[idx[n]] (+ P[p[n]]): a token table's rows, with a position
                 table's rows added in the same pass (GPT's input: tokens of (B, T)
                 sequences flattened, at positions p[n] = n % T, or at positions given,
                 as in packed documents)
  embedding_bwd  dW[idx[n]] += dy[n] (and dP[p[n]] += dy[n])
  embedding_bwd_sweep  dW in dy's dtype for up to SWEEP_TOKENS tokens: one kernel over the
                 table, each block of rows summing its tokens' rows (fp32) and writing
                 zeros elsewhere; deterministic
  embedding_bwd_rows  dW in dy's 16-bit dtype, for fewer tokens than table rows: each
                 distinct id's rows summed in fp32 in an (N, C) buffer, then written once

A row id outside [0, V), or a position outside the position table, gives a row of NaN (as
F.embedding would raise, but without a sync to check the ids) and adds no gradient (a
position outside its table none to it).

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

from fusedtrain.kernels._device import acc_dtype, ceil_div, dot_precision, stat_dtype
from fusedtrain.kernels._launch import fast_launch, stand_in
from fusedtrain.kernels._primitives import row_sum

# 16 tokens x 256 columns a program: 4K elements, 16 per thread at 8 warps (each with its
# own 64-bit address).
_BLOCK_T, _BLOCK_C, _WARPS = 16, 256, 8
# embedding_bwd_sweep: a program per 16 table rows reads every id, 32 at a time (at 2048
# tokens 64 blocks; 3144 x 3 programs for GPT-2's table). PyTorch's own sort-free kernel
# covers up to 3072 indices.
SWEEP_TOKENS, _SWEEP_ROWS, _SWEEP_BLOCK = 2048, 16, 32


@triton.jit
def _token_tile(idx_ptr, N, C, V, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tokens (as int64 row offsets), their table rows, its columns, the
    mask of the (BLOCK_T, BLOCK_C) tile inside (N, C), and that mask where the row id is a
    valid one, in [0, V)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (tokens < N)[:, None] & (cols < C)[None, :]
    rows = tl.load(idx_ptr + tokens, mask=tokens < N, other=0).to(tl.int64)
    valid = mask & ((rows >= 0) & (rows < V))[:, None]
    return tokens.to(tl.int64), rows, cols, mask, valid


@triton.jit
def _position_rows(pid_ptr, tokens, mask, N, T, P, POSITION_IDS: tl.constexpr):
    """The tokens' position-table rows, tokens % T or read from pid_ptr, and `mask` where
    that row is one of the table's P."""
    if POSITION_IDS:
        positions = tl.load(pid_ptr + tokens, mask=tokens < N, other=0).to(tl.int64)
    else:
        positions = tokens % T
    return positions, mask & ((positions >= 0) & (positions < P))[:, None]


@triton.jit
def _rows_at(base, rows, stride, cols):
    """Pointers to a (len(rows), len(cols)) tile: rows `rows` of a matrix at `base`."""
    return base + rows[:, None] * stride + cols[None, :]


@fast_launch
@triton.jit
def _embedding_fwd_kernel(idx_ptr, pid_ptr, w_ptr, pos_ptr, x_ptr, N, C, T, V, P, s_w, s_pos,
                          s_x, POSITIONS: tl.constexpr, POSITION_IDS: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    tokens, rows, cols, mask, valid = _token_tile(idx_ptr, N, C, V, BLOCK_T, BLOCK_C)
    x = tl.load(_rows_at(w_ptr, rows, s_w, cols), mask=valid, other=float("nan"))
    if POSITIONS:
        positions, seated = _position_rows(pid_ptr, tokens, mask, N, T, P, POSITION_IDS)
        x += tl.load(_rows_at(pos_ptr, positions, s_pos, cols), mask=seated,
                     other=float("nan"))
    tl.store(_rows_at(x_ptr, tokens, s_x, cols), x.to(x_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _embedding_bwd_kernel(idx_ptr, pid_ptr, dy_ptr, dw_ptr, dpos_ptr, N, C, T, V, P, s_dy,
                          s_dw, s_dpos, POSITIONS: tl.constexpr, POSITION_IDS: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    tokens, rows, cols, _, valid = _token_tile(idx_ptr, N, C, V, BLOCK_T, BLOCK_C)
    g = tl.load(_rows_at(dy_ptr, tokens, s_dy, cols), mask=valid, other=0.0)
    g = g.to(dw_ptr.dtype.element_ty)
    tl.atomic_add(_rows_at(dw_ptr, rows, s_dw, cols), g, mask=valid, sem="relaxed")
    if POSITIONS:
        positions, seated = _position_rows(pid_ptr, tokens, valid, N, T, P, POSITION_IDS)
        tl.atomic_add(_rows_at(dpos_ptr, positions, s_dpos, cols), g, mask=seated,
                      sem="relaxed")


@fast_launch
@triton.jit
def _table_sweep_kernel(idx_ptr, dy_ptr, dw_ptr, N, C, V, s_dy, s_dw, ACC: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row block, column block) of dW: for each block of tokens with an id among
    its rows, the rows' sums as one-hot(ids) @ dy (exact products, ACC sums, in token-block
    order); zeros where no token points."""
    r0 = tl.program_id(0) * BLOCK_R
    rows = r0 + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    total = tl.full((BLOCK_R, BLOCK_C), 0.0, ACC)
    for start in range(0, N, BLOCK_M):
        m = start + tl.arange(0, BLOCK_M)
        local = tl.load(idx_ptr + m, mask=m < N, other=-1).to(tl.int64) - r0
        inside = (local >= 0) & (local < BLOCK_R) & (r0 + local < V)
        if row_sum(inside.to(tl.int32), 0) > 0:
            g = tl.load(_rows_at(dy_ptr, m.to(tl.int64), s_dy, cols),
                        mask=inside[:, None] & (cols < C)[None, :], other=0.0)
            # through fp32: the interpreter casts a bool to bf16 as the bit pattern 1
            one_hot = (tl.arange(0, BLOCK_R)[:, None] == local[None, :]).to(tl.float32)
            one_hot = one_hot.to(g.dtype)
            total += tl.dot(one_hot, g, input_precision=PRECISION, out_dtype=ACC)
    tl.store(_rows_at(dw_ptr, rows.to(tl.int64), s_dw, cols),
             total.to(dw_ptr.dtype.element_ty), mask=(rows < V)[:, None] & (cols < C)[None, :])


@fast_launch
@triton.jit
def _first_token_kernel(idx_ptr, first_ptr, N, V, BLOCK: tl.constexpr):
    """first[v] = min(first[v], n) over the tokens n with id v: each id's first token."""
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(idx_ptr + tokens, mask=tokens < N, other=-1).to(tl.int64)
    seen = (tokens < N) & (rows >= 0) & (rows < V)
    tl.atomic_min(first_ptr + rows, tokens, mask=seen, sem="relaxed")


@fast_launch
@triton.jit
def _rows_kernel(idx_ptr, first_ptr, src_ptr, dst_ptr, N, C, V, s_src, s_dst,
                 WRITE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Not WRITE: acc[first[idx[n]]] += dy[n] in fp32 (src dy, dst acc: one accumulator
    row per distinct id). WRITE: dW[idx[n]] = acc[n], rounded once, by each id's first
    token n (src acc, dst dW)."""
    tokens, rows, cols, _, valid = _token_tile(idx_ptr, N, C, V, BLOCK_T, BLOCK_C)
    seen = (tokens < N) & (rows >= 0) & (rows < V)
    first = tl.load(first_ptr + rows, mask=seen, other=-1).to(tl.int64)
    if WRITE:
        own = valid & (first == tokens)[:, None]
        g = tl.load(_rows_at(src_ptr, tokens, s_src, cols), mask=own, other=0.0)
        tl.store(_rows_at(dst_ptr, rows, s_dst, cols), g.to(dst_ptr.dtype.element_ty),
                 mask=own)
    else:
        g = tl.load(_rows_at(src_ptr, tokens, s_src, cols), mask=valid, other=0.0)
        tl.atomic_add(_rows_at(dst_ptr, first, s_dst, cols), g.to(tl.float32), mask=valid,
                      sem="relaxed")


def _grid(N: int, C: int) -> tuple[int, int]:
    return ceil_div(N, _BLOCK_T), ceil_div(C, _BLOCK_C)


def embedding_fwd(idx: torch.Tensor, weight: torch.Tensor,
                  positions: torch.Tensor | None = None, seq_len: int = 1,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """idx: (N,) row ids, weight: (V, C), positions: (P, C), or None -> x: (N, C) in
    weight's dtype, x[n] = weight[idx[n]] + positions[p[n]], p[n] = position_ids[n]
    ((N,) ints) when given, else n % seq_len (NaN for an id outside its table)."""
    idx = idx.contiguous()
    N, C = idx.shape[0], weight.shape[1]
    x = torch.empty((N, C), device=weight.device, dtype=weight.dtype)
    pos = weight if positions is None else positions  # not read without positions
    pid = idx if position_ids is None else position_ids.contiguous()  # nor this without ids
    _embedding_fwd_kernel[_grid(N, C)](
        idx, pid, weight, pos, x, N, C, seq_len, weight.shape[0], pos.shape[0],
        weight.stride(0), pos.stride(0), x.stride(0),
        POSITIONS=positions is not None, POSITION_IDS=position_ids is not None,
        BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C, num_warps=_WARPS)
    return x


def embedding_bwd(idx: torch.Tensor, dy: torch.Tensor, num_rows: int,
                  dw: torch.Tensor | None = None, num_positions: int = 0,
                  seq_len: int = 1, position_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """idx: (N,) row ids, dy: (N, C) -> (dW, dP): dW (num_rows, C) with dy's rows added at
    idx (none for an id outside [0, num_rows)), accumulated in fp32 (fp64 for fp64 dy),
    into `dw` in place when given (of that dtype); with num_positions, dP (num_positions,
    C) with dy's row n added at position p[n] as embedding_fwd's (else None)."""
    idx = idx.contiguous()  # read with unit stride (a 1-D view may have another)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    N, C = dy.shape
    acc = stat_dtype(dy)
    if dw is None:
        dw = torch.zeros((num_rows, C), device=dy.device, dtype=acc)
    dpos = (torch.zeros((num_positions, C), device=dy.device, dtype=acc) if num_positions
            else None)
    target = stand_in(dw) if dpos is None else dpos  # not written without positions
    pid = idx if position_ids is None else position_ids.contiguous()  # nor this read
    _embedding_bwd_kernel[_grid(N, C)](
        idx, pid, dy, dw, target, N, C, seq_len, num_rows, target.shape[0], dy.stride(0),
        dw.stride(0), target.stride(0),
        POSITIONS=dpos is not None, POSITION_IDS=position_ids is not None,
        BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C, num_warps=_WARPS)
    return dw, dpos


def embedding_bwd_sweep(idx: torch.Tensor, dy: torch.Tensor, num_rows: int) -> torch.Tensor:
    """idx: (N,) row ids, N <= SWEEP_TOKENS, dy: (N, C) -> dW: (num_rows, C) in dy's dtype,
    dy's rows added at idx, summed in fp32 (fp64) and rounded once (none for an id outside
    [0, num_rows)): the same bits every run. One kernel writes the whole table, zeros and
    sums: no memset before it."""
    idx = idx.contiguous()
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    N, C = dy.shape
    dw = torch.empty((num_rows, C), device=dy.device, dtype=dy.dtype)
    _table_sweep_kernel[(ceil_div(num_rows, _SWEEP_ROWS), ceil_div(C, _BLOCK_C))](
        idx, dy, dw, N, C, num_rows, dy.stride(0), dw.stride(0), ACC=acc_dtype(dy),
        PRECISION=dot_precision(dy), BLOCK_R=_SWEEP_ROWS, BLOCK_M=_SWEEP_BLOCK,
        BLOCK_C=_BLOCK_C, num_warps=4)
    return dw


def embedding_bwd_rows(idx: torch.Tensor, dy: torch.Tensor, num_rows: int) -> torch.Tensor:
    """idx: (N,) row ids, dy: (N, C) fp16/bf16 -> dW: (num_rows, C) in dy's dtype, dy's rows
    added at idx in fp32 and rounded once (none for an id outside [0, num_rows)). For N <
    num_rows: it writes the table once in 16 bits where embedding_bwd's fp32 table and its
    cast move 5x the bytes (GPT-2's 50304 x 768: 77 MB against 385 MB)."""
    idx = idx.contiguous()
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    N, C = dy.shape
    first = torch.full((num_rows,), N, device=dy.device, dtype=torch.int32)
    acc = torch.zeros((N, C), device=dy.device, dtype=torch.float32)
    dw = torch.zeros((num_rows, C), device=dy.device, dtype=dy.dtype)
    _first_token_kernel[(ceil_div(N, 1024),)](idx, first, N, num_rows, BLOCK=1024,
                                              num_warps=4)
    grid = _grid(N, C)
    _rows_kernel[grid](idx, first, dy, acc, N, C, num_rows, dy.stride(0), C, WRITE=False,
                       BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C, num_warps=_WARPS)
    _rows_kernel[grid](idx, first, acc, dw, N, C, num_rows, C, dw.stride(0), WRITE=True,
                       BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C, num_warps=_WARPS)
    return dw
