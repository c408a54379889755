"""Embedding backward: dW[idx[t]] += dy[t] for every token t, by fp32 atomic adds.

PyTorch's CUDA backward of an embedding sorts the token ids, then sums each id's rows
(radix sorts, a segment scan and two more kernels: ~0.3 ms a GPT-2 step on an H200);
here one kernel adds each token's row into a zeroed fp32 gradient, the additions to one
row meeting in L2. Their order, and so the last bits of a row shared by several tokens,
vary run to run: under torch.use_deterministic_algorithms(True) the op keeps PyTorch's
sorted backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels._common import stat_dtype

# 16 tokens x 256 columns a program: 4K fp32 additions, 16 per thread at 8 warps (each
# with its own 64-bit address).
_BLOCK_T, _BLOCK_C, _WARPS = 16, 256, 8


@triton.jit
def _embedding_bwd_kernel(idx_ptr, dy_ptr, dw_ptr, N, C, s_dy, s_dw,
                          BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (tokens < N)[:, None] & (cols < C)[None, :]
    rows = tl.load(idx_ptr + tokens, mask=tokens < N, other=0).to(tl.int64)
    g = tl.load(dy_ptr + tokens.to(tl.int64)[:, None] * s_dy + cols[None, :], mask=mask,
                other=0.0)
    tl.atomic_add(dw_ptr + rows[:, None] * s_dw + cols[None, :], g.to(dw_ptr.dtype.element_ty),
                  mask=mask, sem="relaxed")


def embedding_bwd(idx: torch.Tensor, dy: torch.Tensor, num_rows: int) -> torch.Tensor:
    """idx: (N,) row ids in [0, num_rows), dy: (N, C) -> dW: (num_rows, C), accumulated in
    fp32 (fp64 for fp64 dy) and returned in that dtype."""
    idx = idx.contiguous()  # read with unit stride (a 1-D view may have another)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    N, C = dy.shape
    dw = torch.zeros((num_rows, C), device=dy.device, dtype=stat_dtype(dy))
    grid = (triton.cdiv(N, _BLOCK_T), triton.cdiv(C, _BLOCK_C))
    _embedding_bwd_kernel[grid](idx, dy, dw, N, C, dy.stride(0), dw.stride(0),
                                BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C, num_warps=_WARPS)
    return dw
