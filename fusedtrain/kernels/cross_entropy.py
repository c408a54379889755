"""Cross-entropy over a vocabulary, read straight from low-precision logits.

  cross_entropy_fwd   per row: lse = logsumexp(logits) by an online max/sum over chunks
                      of the vocabulary (fp32, fp64 for fp64 logits), loss = lse - logit[target];
                      optionally (grad_scale) then the gradient, over the logits in place.
  cross_entropy_bwd   per row: dlogits = (softmax(logits) - onehot(target)) * g, written
                      once in the logits' dtype; softmax recomputed from the saved lse.
  scale_unless_one    dlogits *= g in place, where a one-element g on the device is not 1.

Rows whose target is ignore_index get loss 0 and gradient 0. The unfused path upcasts
the (tokens x vocab) logits to fp32, writes log_softmax, and reads both back in
backward; here the logits are read once forward and once backward, nothing else the
size of the logits is written but the gradient. With the gradient made in the forward
(for logits nothing else reads, as a training step's), each row's second pass runs
right after its first, while the row is still in L2, and backward has nothing left to
do but the loss gradient's factor, which in training is exactly 1 (docs/perf-notes.md,
fourteenth round).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._common import acc_dtype, device_fn, row_max, row_sum, sm_count, stat_dtype

BLOCK_V = 1024 if INTERPRET else 4096


@device_fn
def _write_row_grad(x_row, d_row, V, lse, target, g, ACC: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    """d_row[:V] = (softmax(x_row) - onehot(target)) * g, softmax from the row's lse;
    d_row may be x_row (each chunk is read before it is written)."""
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        idx = start + cols
        ok = idx < V
        x = tl.load(x_row + idx, mask=ok, other=0.0).to(ACC)
        d = (tl.exp(x - lse) - tl.where(idx == target, 1.0, 0.0)) * g
        tl.store(d_row + idx, d.to(d_row.dtype.element_ty), mask=ok)


@triton.jit
def _ce_fwd_kernel(logits_ptr, target_ptr, loss_ptr, lse_ptr, scale_ptr, V, s_row,
                   ignore_index, GRAD: tl.constexpr, ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * s_row
    cols = tl.arange(0, BLOCK_V)
    # Running max m and sum l of exp(x - m), kept per lane and combined at the end, so
    # the loop body has no cross-lane reduction. One exp per element: of the two factors
    # exp(m - m_new) and exp(x - m_new), one is exp(0).
    m = tl.full((BLOCK_V,), float("-inf"), ACC)
    l = tl.full((BLOCK_V,), 0.0, ACC)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(ACC)
        rises = x > m
        # exp(-|x - m|), 0 while both are -inf (a lane with nothing yet)
        e = tl.where(m == x, 1.0, tl.exp(tl.where(rises, m - x, x - m)))
        e = tl.where(x == float("-inf"), 0.0, e)
        l = tl.where(rises, l * e + 1.0, l + e)
        m = tl.maximum(m, x)
    m_row = row_max(m, 0)
    m_safe = tl.where(m == float("-inf"), m_row, m)  # lanes that saw only -inf have l = 0
    lse = m_row + tl.log(row_sum(l * tl.exp(m_safe - m_row), 0))
    target = tl.load(target_ptr + row)
    in_range = (target >= 0) & (target < V)
    x_t = tl.load(base + tl.where(in_range, target, 0)).to(ACC)
    # an ignored row adds 0; a target outside [0, V) gives NaN rather than a stray read
    loss = tl.where(in_range, lse - x_t, float("nan"))
    tl.store(loss_ptr + row, tl.where(target == ignore_index, 0.0, loss))
    tl.store(lse_ptr + row, lse)
    if GRAD:
        g = tl.where(target != ignore_index, tl.load(scale_ptr).to(ACC), 0.0)
        _write_row_grad(base, base, V, lse, target, g, ACC, BLOCK_V)


@triton.jit
def _ce_bwd_kernel(logits_ptr, target_ptr, lse_ptr, g_ptr, dlogits_ptr, V, s_row, s_drow,
                   ignore_index, ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    # g: the loss gradient per row (d mean / d row loss), zero for ignored rows
    g = tl.where(target != ignore_index, tl.load(g_ptr).to(ACC), 0.0)
    _write_row_grad(logits_ptr + row * s_row, dlogits_ptr + row * s_drow, V,
                    tl.load(lse_ptr + row), target, g, ACC, BLOCK_V)


@triton.jit
def _scale_unless_one_kernel(d_ptr, g_ptr, M, V, s_row, ACC: tl.constexpr,
                             BLOCK_V: tl.constexpr):
    g = tl.load(g_ptr).to(ACC)
    if g != 1.0:  # training's loss.backward(): every program returns at once
        cols = tl.arange(0, BLOCK_V)
        row_ptr = d_ptr + tl.program_id(0).to(tl.int64) * s_row
        for _ in range(tl.program_id(0), M, tl.num_programs(0)):
            for start in range(0, V, BLOCK_V):
                ptrs = row_ptr + start + cols
                ok = start + cols < V
                d = tl.load(ptrs, mask=ok, other=0.0).to(ACC)
                tl.store(ptrs, (d * g).to(d_ptr.dtype.element_ty), mask=ok)
            row_ptr += tl.num_programs(0).to(tl.int64) * s_row


def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                      grad_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (M, V) with unit column stride, targets: (M,) int64 ->
    (loss per row, lse per row), both (M,) fp32 (fp64 for fp64 logits).

    grad_scale (a one-element tensor, g): also writes the gradient of g * sum(row losses),
    (softmax - onehot(target)) * g, zero on ignored rows, over the logits: in place, the
    logits' values are gone after the call."""
    M, V = logits.shape
    loss = torch.empty(M, device=logits.device, dtype=stat_dtype(logits))
    lse = torch.empty_like(loss)
    grad = grad_scale is not None
    _ce_fwd_kernel[(M,)](logits, targets, loss, lse, grad_scale if grad else loss, V,
                         logits.stride(0), ignore_index, GRAD=grad, ACC=acc_dtype(logits),
                         BLOCK_V=BLOCK_V, num_warps=8)
    return loss, lse


def cross_entropy_bwd(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                      g: torch.Tensor, ignore_index: int, inplace: bool = False) -> torch.Tensor:
    """dlogits: (M, V) in the logits' dtype; g is a one-element tensor, the gradient of
    the loss with respect to each (non-ignored) row's loss. inplace: written over the
    logits (each program reads a chunk of its row before writing the same chunk)."""
    M, V = logits.shape
    dlogits = logits if inplace else torch.empty((M, V), device=logits.device,
                                                 dtype=logits.dtype)
    _ce_bwd_kernel[(M,)](logits, targets, lse, g, dlogits, V, logits.stride(0),
                         dlogits.stride(0), ignore_index, ACC=acc_dtype(logits),
                         BLOCK_V=BLOCK_V, num_warps=8)
    return dlogits


def scale_unless_one(d: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d: (M, V) with unit column stride, g: one element -> d * g, in place; a launch that
    returns at once when g is 1 (decided on the device: no host synchronisation)."""
    M, V = d.shape
    programs = 4 if INTERPRET else 4 * sm_count(d.device)
    _scale_unless_one_kernel[(max(1, min(M, programs)),)](
        d, g, M, V, d.stride(0), ACC=acc_dtype(d), BLOCK_V=BLOCK_V, num_warps=8)
    return d
