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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._common import acc_dtype, device_fn, row_max, row_sum, sm_count, stat_dtype

BLOCK_V = 1024 if INTERPRET else 4096
LOG2E = tl.constexpr(1.4426950408889634)


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
def _ce_fwd_kernel(logits_ptr, target_ptr, loss_ptr, lse_ptr, scale_ptr, M, V, s_row,
                   ignore_index, GRAD: tl.constexpr, ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    # Rows pid, pid + P, ... of the (M, V) logits for P programs.
    cols = tl.arange(0, BLOCK_V)
    base = logits_ptr + tl.program_id(0).to(tl.int64) * s_row
    for row in range(tl.program_id(0), M, tl.num_programs(0)):
        # Online logsumexp in base 2 over chunks: m, the running maximum of x log2(e)
        # (one reduction across lanes a chunk), and per lane l, the sum of 2^(x log2(e) - m).
        # One exp2 per element, and a multiply-add.
        m = tl.full((), float("-inf"), ACC)
        l = tl.full((BLOCK_V,), 0.0, ACC)
        for start in range(0, V, BLOCK_V):
            x = tl.load(base + start + cols, mask=start + cols < V,
                        other=float("-inf")).to(ACC) * LOG2E
            m_new = tl.maximum(m, row_max(x, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # only -inf so far
            l = l * tl.exp2(m - m_safe) + tl.exp2(x - m_safe)
            m = m_new
        lse = (m + tl.log2(row_sum(l, 0))) / LOG2E
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
        base += tl.num_programs(0).to(tl.int64) * s_row


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


@dataclass(frozen=True)
class CeForwardConfig:
    """Launch of the forward kernel: `per_sm` programs per SM, each walking rows."""

    block_v: int = 4096
    num_warps: int = 8
    per_sm: int = 4


def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                      grad_scale: torch.Tensor | None = None,
                      config: CeForwardConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (M, V) with unit column stride, targets: (M,) int64 ->
    (loss per row, lse per row), both (M,) fp32 (fp64 for fp64 logits).

    grad_scale (a one-element tensor, g): also writes the gradient of g * sum(row losses),
    (softmax - onehot(target)) * g, zero on ignored rows, over the logits: in place, the
    logits' values are gone after the call. `config` overrides the launch (for tuning)."""
    M, V = logits.shape
    loss = torch.empty(M, device=logits.device, dtype=stat_dtype(logits))
    lse = torch.empty_like(loss)
    grad = grad_scale is not None
    cfg = config or CeForwardConfig()
    programs = 4 if INTERPRET else cfg.per_sm * sm_count(logits.device)
    _ce_fwd_kernel[(max(1, min(M, programs)),)](
        logits, targets, loss, lse, grad_scale if grad else loss, M, V, logits.stride(0),
        ignore_index, GRAD=grad, ACC=acc_dtype(logits),
        BLOCK_V=BLOCK_V if INTERPRET else cfg.block_v, num_warps=cfg.num_warps)
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
