"""Cross-entropy over a vocabulary, read straight from low-precision logits.

  cross_entropy_fwd   per row: lse = logsumexp(logits) by an online max/sum over chunks
                      of the vocabulary (fp32, fp64 for fp64 logits), loss = lse - logit[target];
                      one exp2 per element and one maximum across lanes per chunk.
  cross_entropy_bwd   per row: dlogits = (softmax(logits) - onehot(target)) * g, written
                      once in the logits' dtype; softmax recomputed from the saved lse.
  cross_entropy_fwd_grad
                      both at once, for a loss whose upstream gradient is applied later
                      (ops.linear_cross_entropy): each row's loss and its gradient of the
                      mean loss, (softmax - onehot) / count; on Hopper in one pass with the
                      row in shared memory (cross_entropy_smem, Gluon), so the logits are
                      read from HBM once.
  kept_mean           one program over the rows: how many are not ignored, 1 / that
                      count (the gradient's scale) and the mean loss over them.

Rows whose target is ignore_index get loss 0 and gradient 0. The unfused path upcasts
the (tokens x vocab) logits to fp32, writes log_softmax, and reads both back in
backward; here the logits are read once forward and once backward, nothing else the
size of the logits is written but the gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._device import acc_dtype, ceil_div, stat_dtype
from fusedtrain.kernels._launch import fast_launch, stand_in
from fusedtrain.kernels._primitives import device_fn, row_max, row_sum
from fusedtrain.kernels._tma import gluon_ok

BLOCK_V = 1024 if INTERPRET else 4096
LOG2E = tl.constexpr(1.4426950408889634)
# The forward's chunk and warps, measured on an H200 at GPT-2's 16384 x 50304 logits
# (docs/journal.md): 0.41 ms, 4.0 TB/s of the logits read.
_FWD_BLOCK_V, _FWD_WARPS = 2048, 4


@device_fn
def _row_logsumexp(base, V, cols, ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    """ln sum exp of the V logits at `base`, read once in chunks of BLOCK_V (cols)."""
    # Online logsumexp in base 2: m, the running maximum of x log2(e) (one reduction
    # across lanes a chunk), and per lane l, the sum of 2^(x log2(e) - m): an exp2 and a
    # multiply-add per element. (A maximum kept per lane instead needs no reduction in
    # the loop but two exps per element, and ran at 2.3 against 4.0 TB/s.)
    m = tl.full((), float("-inf"), ACC)
    l = tl.full((BLOCK_V,), 0.0, ACC)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V,
                    other=float("-inf")).to(ACC) * LOG2E
        m_new = tl.maximum(m, row_max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # only -inf so far
        l = l * tl.exp2(m - m_safe) + tl.exp2(x - m_safe)
        m = m_new
    return (m + tl.log2(row_sum(l, 0))) / LOG2E


@device_fn
def _store_row_loss(base, target, lse, loss_ptr, lse_ptr, row, V, ignore_index):
    """The row's loss lse - x[target] (0 if ignored, NaN for a target outside [0, V))."""
    in_range = (target >= 0) & (target < V)
    x_t = tl.load(base + tl.where(in_range, target, 0)).to(lse.dtype)
    loss = tl.where(in_range, lse - x_t, float("nan"))
    tl.store(loss_ptr + row, tl.where(target == ignore_index, 0.0, loss))
    tl.store(lse_ptr + row, lse)


@device_fn
def _store_row_grad(src, dst, V, cols, target, lse, g, ACC: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    """dst[j] = (softmax(src)[j] - [j == target]) * g over the row, chunk by chunk; src
    and dst may be the same row (each chunk is read before it is written)."""
    for start in range(0, V, BLOCK_V):
        idx = start + cols
        ok = idx < V
        x = tl.load(src + idx, mask=ok, other=0.0).to(ACC)
        d = (tl.exp2((x - lse) * LOG2E) - tl.where(idx == target, 1.0, 0.0)) * g
        tl.store(dst + idx, d.to(dst.dtype.element_ty), mask=ok)


@fast_launch
@triton.jit
def _ce_fwd_kernel(logits_ptr, target_ptr, loss_ptr, lse_ptr, V, s_row, ignore_index,
                   ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * s_row
    lse = _row_logsumexp(base, V, tl.arange(0, BLOCK_V), ACC, BLOCK_V)
    _store_row_loss(base, tl.load(target_ptr + row), lse, loss_ptr, lse_ptr, row, V,
                    ignore_index)


@fast_launch
@triton.jit
def _ce_bwd_kernel(logits_ptr, target_ptr, lse_ptr, g_ptr, dlogits_ptr, V, s_row, s_drow,
                   ignore_index, ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    # g: the loss gradient per row (d mean / d row loss), zero for ignored rows
    g = tl.where(target != ignore_index, tl.load(g_ptr).to(ACC), 0.0)
    _store_row_grad(logits_ptr + row * s_row, dlogits_ptr + row * s_drow, V,
                    tl.arange(0, BLOCK_V), target, tl.load(lse_ptr + row), g, ACC, BLOCK_V)


@fast_launch
@triton.jit
def _kept_rows_kernel(loss_ptr, target_ptr, mean_ptr, inv_ptr, count_ptr, M, ignore_index,
                      HAS_LOSS: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    # One program: the kept rows counted (int32: exact), written as the count and 1 / count;
    # with HAS_LOSS also the rows' losses summed and their mean (0 / 0 = NaN with every row
    # ignored, as in PyTorch).
    total = tl.full((BLOCK,), 0.0, ACC)
    kept = tl.full((BLOCK,), 0, tl.int32)
    for start in tl.range(0, M, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < M
        if HAS_LOSS:  # ignored rows hold 0
            total += tl.load(loss_ptr + offs, mask=ok, other=0.0).to(ACC)
        kept += (tl.load(target_ptr + offs, mask=ok, other=ignore_index) != ignore_index).to(
            tl.int32)
    count = row_sum(kept, 0)
    n = count.to(ACC)
    tl.store(count_ptr, count.to(tl.int64))
    tl.store(inv_ptr, (1.0 / n).to(inv_ptr.dtype.element_ty))
    if HAS_LOSS:
        tl.store(mean_ptr, (row_sum(total, 0) / n).to(mean_ptr.dtype.element_ty))


@fast_launch
@triton.jit
def _scale_kernel(x_ptr, s_ptr, y_ptr, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
    tl.store(y_ptr + offs, (x * tl.load(s_ptr).to(ACC)).to(y_ptr.dtype.element_ty), mask=mask)


def scaled(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x * s for a one-element tensor s (an upstream gradient, on x's device): the product
    in fp32 (fp64 for fp64 x) rounded once to x's dtype, as PyTorch's x * s, in one
    vectorised pass (PyTorch's mixed-dtype kernel for a bf16 (16384, 768) x takes 46 us
    on an H200; docs/journal.md)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    block = 1024 if INTERPRET else 4096
    _scale_kernel[(ceil_div(x.numel(), block),)](x, s, y, x.numel(), ACC=acc_dtype(x),
                                                    BLOCK=block, num_warps=4)
    return y


def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor,
                      ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (M, V) with unit column stride, targets: (M,) int64 ->
    (loss per row, lse per row), both (M,) fp32 (fp64 for fp64 logits)."""
    M, V = logits.shape
    s_row = logits.stride(0)
    loss = torch.empty(M, device=logits.device, dtype=stat_dtype(logits))
    lse = torch.empty(M, device=logits.device, dtype=loss.dtype)
    _ce_fwd_kernel.planned(
        (M, V, s_row, logits.dtype, targets.dtype, ignore_index),
        (logits, targets, loss, lse, V, s_row, ignore_index),
        lambda: ((M,), dict(ACC=acc_dtype(logits),
                            BLOCK_V=BLOCK_V if INTERPRET else _FWD_BLOCK_V,
                            num_warps=_FWD_WARPS)))
    return loss, lse


def _kept_rows(loss: torch.Tensor | None, targets: torch.Tensor, ignore_index: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(count (), int64; 1 / count (), dtype; mean of loss over the kept rows (), dtype, or
    None without loss) from one launch."""
    M = targets.shape[0]
    count = torch.empty((), device=targets.device, dtype=torch.int64)
    inv = torch.empty((), device=targets.device, dtype=dtype)
    has_loss = loss is not None
    mean = torch.empty((), device=targets.device, dtype=dtype) if has_loss else None
    _kept_rows_kernel.planned(
        (M, dtype, targets.dtype, ignore_index, has_loss),
        (loss if has_loss else stand_in(inv), targets, mean if has_loss else stand_in(inv), inv,
         count, M, ignore_index),
        lambda: ((1,), dict(HAS_LOSS=has_loss, ACC=acc_dtype(inv), BLOCK=1024, num_warps=4)))
    return count, inv, mean


def kept_mean(loss: torch.Tensor, targets: torch.Tensor,
              ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """loss: (M,) per row (0 on ignored rows), targets: (M,) int64 -> (the mean over the rows
    whose target is not ignore_index, 1 / their count), both () in loss's dtype, from one
    launch: where sum, count and division took four PyTorch kernels."""
    _, inv, mean = _kept_rows(loss, targets, ignore_index, loss.dtype)
    return mean, inv


def cross_entropy_bwd(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                      g: torch.Tensor, ignore_index: int, inplace: bool = False) -> torch.Tensor:
    """dlogits: (M, V) in the logits' dtype; g is a one-element tensor, the gradient of
    the loss with respect to each (non-ignored) row's loss. inplace: written over the
    logits (each program reads a chunk of its row before writing the same chunk)."""
    M, V = logits.shape
    dlogits = logits if inplace else torch.empty(M, V, device=logits.device,
                                                 dtype=logits.dtype)
    s_row, s_drow = logits.stride(0), dlogits.stride(0)
    _ce_bwd_kernel.planned(
        (M, V, s_row, s_drow, logits.dtype, targets.dtype, lse.dtype, g.dtype, ignore_index),
        (logits, targets, lse, g, dlogits, V, s_row, s_drow, ignore_index),
        lambda: ((M,), dict(ACC=acc_dtype(logits), BLOCK_V=BLOCK_V, num_warps=8)))
    return dlogits


def cross_entropy_fwd_grad(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                           inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """logits: (M, V) with unit column stride, targets: (M,) int64 -> (loss per row: (M,)
    fp32 (fp64), count: () int64, the rows not ignored, dlogits: (M, V) in the logits' dtype),
    dlogits = d(loss.sum() / count) / d logits = (softmax(logits) - onehot(target)) / count,
    0 on ignored rows. inplace: dlogits written over the logits (each row's loss is taken
    before its gradient is written).

    On an sm_90 GPU, where cross_entropy_smem.fits, one pass with each row in shared memory
    (the logits read once); elsewhere the forward kernel, then the backward one."""
    count, inv, _ = _kept_rows(None, targets, ignore_index, stat_dtype(logits))
    if gluon_ok(logits):
        from fusedtrain.kernels import cross_entropy_smem  # Gluon: imported where it compiles

        if cross_entropy_smem.fits(logits):
            loss = torch.empty(logits.shape[0], device=logits.device, dtype=stat_dtype(logits))
            dlogits = logits if inplace else torch.empty_like(logits)
            cross_entropy_smem.cross_entropy_fwd_grad(logits, targets, count, loss, dlogits,
                                                      ignore_index)
            return loss, count, dlogits
    loss, lse = cross_entropy_fwd(logits, targets, ignore_index)
    return loss, count, cross_entropy_bwd(logits, targets, lse, inv, ignore_index, inplace)
