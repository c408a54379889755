"""Differentiable cross-entropy on (tokens, vocab) logits, read in their own dtype, and the
LM head and its loss as one op (linear_cross_entropy)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from fusedtrain.casts import cast_params
from fusedtrain.kernels import cross_entropy as K
from fusedtrain.kernels._device import stat_dtype
from fusedtrain.ops._registry import function_apply, launcher, runs_directly
from fusedtrain.ops._validate import (
    autocast_params,
    check_index_tensor,
    check_linear,
    check_tensor,
)
from fusedtrain.ops.linear import weight_grad

Tensor = torch.Tensor


@launcher("cross_entropy_fwd", traceable=True)
def _cross_entropy_fwd(logits: Tensor, targets: Tensor,
                       ignore_index: int) -> tuple[Tensor, Tensor]:
    return K.cross_entropy_fwd(logits, targets, ignore_index)


@_cross_entropy_fwd.register_fake
def _(logits, targets, ignore_index):
    stat = stat_dtype(logits)
    M = logits.shape[0]
    return logits.new_empty(M, dtype=stat), logits.new_empty(M, dtype=stat)


@launcher("kept_mean", traceable=True)
def _kept_mean(loss: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(mean loss over the rows not ignored, 1 / their count): see K.kept_mean."""
    return K.kept_mean(loss, targets, ignore_index)


@_kept_mean.register_fake
def _(loss, targets, ignore_index):
    return loss.new_empty(()), loss.new_empty(())


@launcher("cross_entropy_bwd", traceable=True)
def _cross_entropy_bwd(logits: Tensor, targets: Tensor, lse: Tensor, g: Tensor,
                       ignore_index: int) -> Tensor:
    return K.cross_entropy_bwd(logits, targets, lse, g, ignore_index)


@_cross_entropy_bwd.register_fake
def _(logits, targets, lse, g, ignore_index):
    return logits.new_empty(logits.shape)


@launcher("cross_entropy_fwd_grad_into", mutates=("logits",), traceable=True)
def _cross_entropy_fwd_grad_into(logits: Tensor, targets: Tensor,
                                 ignore_index: int) -> tuple[Tensor, Tensor]:
    """(loss per row, count of rows not ignored); the mean loss's gradient written over the
    logits. Declared as a write, so that under torch.compile Inductor too writes it into
    the logits' buffer rather than a second one (1.6 GB at GPT-2's 16 x 1024 tokens)."""
    losses, count, _ = K.cross_entropy_fwd_grad(logits, targets, ignore_index, inplace=True)
    return losses, count


@_cross_entropy_fwd_grad_into.register_fake
def _(logits, targets, ignore_index):
    return (logits.new_empty(logits.shape[0], dtype=stat_dtype(logits)),
            targets.new_empty((), dtype=torch.int64))


@register_flop_formula(torch.ops.fusedtrain.cross_entropy_fwd)
def _(logits_shape, *args, **kwargs) -> int:
    return 0  # no matmul: FlopCounterMode counts matmul flops only


class CrossEntropyFunction(torch.autograd.Function):
    """Mean cross-entropy over the non-ignored rows; saves the logits and the fp32
    log-sum-exp per row, never a softmax or an fp32 copy of the logits."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int, inplace: bool):
        losses, lse = _cross_entropy_fwd(logits, targets, ignore_index)
        loss, inv_count = _kept_mean(losses, targets, ignore_index)
        ctx.save_for_backward(logits, targets, lse, inv_count)
        ctx.ignore_index, ctx.inplace = ignore_index, inplace
        return loss

    @staticmethod
    def backward(ctx, dloss: Tensor):
        logits, targets, lse, inv_count = ctx.saved_tensors
        g = dloss * inv_count  # () in the loss's dtype, on the device: no sync
        if ctx.inplace and runs_directly(logits):
            # The launcher is declared non-mutating for torch.compile and dispatch modes,
            # so the in-place form runs only when it is called directly.
            dlogits = K.cross_entropy_bwd(logits, targets, lse, g, ctx.ignore_index,
                                          inplace=True)
        else:
            dlogits = _cross_entropy_bwd(logits, targets, lse, g, ctx.ignore_index)
        return dlogits, None, None, None


_apply_cross_entropy = function_apply(CrossEntropyFunction)


def _check_targets(targets: Tensor, rows: Tensor, name: str) -> None:
    """targets: integer class ids of rows' shape without its last dimension, on its device."""
    check_index_tensor("targets", targets, "class indices")
    if tuple(targets.shape) != tuple(rows.shape[:-1]):
        raise ValueError(f"targets has shape {tuple(targets.shape)}, expected "
                         f"{tuple(rows.shape[:-1])} ({name}'s shape without its last dimension)")
    if targets.device != rows.device:
        raise ValueError(f"targets is on {targets.device} but {name} is on {rows.device}")


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100,
                  inplace_backward: bool = False) -> Tensor:
    """Mean cross-entropy of logits (..., V) against integer targets (...): the same
    value as F.cross_entropy on the logits upcast to fp32 (fp32 result; fp64 for fp64
    logits). Rows whose target is ignore_index are left out of the mean; a target
    outside [0, V) gives NaN.

    inplace_backward: backward writes the gradient over the logits' memory, saving one
    logits-sized buffer (1.6 GB for GPT-2 at 16 x 1024 tokens); the logits' values are
    gone after backward, so use it only for logits nothing else reads.
    """
    check_tensor("logits", logits, min_ndim=1)
    _check_targets(targets, logits, "logits")
    if logits.shape[-1] == 0:
        raise ValueError("logits has an empty last (vocabulary) dimension")
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return _apply_cross_entropy(rows, targets.reshape(-1).long(), int(ignore_index),
                                      bool(inplace_backward))


@launcher("scaled", traceable=True)
def _scaled(x: Tensor, s: Tensor) -> Tensor:
    return K.scaled(x, s)


@_scaled.register_fake
def _(x, s):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Mean cross-entropy of x @ W.T. Forward writes the gradient G of the mean loss with
    respect to the logits over the logits themselves (on Hopper one kernel that reads the
    logits from HBM once, not once in forward and again in backward); backward applies the
    upstream gradient g to the two small GEMM products instead of the (tokens x vocab) G:
    dx = g (G @ W), dW = G.T @ (g x). compute_dtype: as LinearFunction's."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int,
                compute_dtype: torch.dtype | None):
        ctx.w_dtype = weight.dtype
        (weight,) = cast_params(compute_dtype, weight)
        x2 = x.reshape(-1, x.shape[-1])
        logits = x2 @ weight.t()
        if not any(ctx.needs_input_grad[:2]):
            losses, _ = _cross_entropy_fwd(logits, targets, ignore_index)
            return _kept_mean(losses, targets, ignore_index)[0]
        # The logits are this op's own: their gradient is written over them.
        losses, _ = _cross_entropy_fwd_grad_into(logits, targets, ignore_index)
        ctx.save_for_backward(x2, weight, logits)
        ctx.x_shape = x.shape
        return _kept_mean(losses, targets, ignore_index)[0]

    @staticmethod
    def backward(ctx, dloss: Tensor):
        x2, weight, dlogits = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[:2]
        dx = _scaled(dlogits @ weight, dloss).view(ctx.x_shape) if want_x else None
        dw = weight_grad(dlogits, _scaled(x2, dloss), ctx.w_dtype) if want_w else None
        return dx, dw, None, None, None


_apply_linear_cross_entropy = function_apply(LinearCrossEntropyFunction)


def linear_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor,
                         ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of the logits x @ weight.T against targets: x: (..., C), weight:
    (V, C), targets: (...) integer ids -> () fp32 (fp64 for fp64 x), the value of
    cross_entropy(F.linear(x, weight), targets). A language model's head and loss in one:
    its (tokens x V) logits never leave the op, and their gradient is computed with the loss,
    in the logits' memory. Under autocast the weight is cast here and its gradient returned
    in its own dtype (as ops.linear)."""
    check_tensor("x", x, min_ndim=1)
    _check_targets(targets, x, "x")
    x, compute_dtype = autocast_params(x, weight)
    check_linear(x, weight, None, "weight", "bias", x.shape[-1],
                 same_dtype=compute_dtype is None)
    if weight.shape[0] == 0:
        raise ValueError("weight has no rows: an empty vocabulary")
    return _apply_linear_cross_entropy(x, weight, targets.reshape(-1).long(),
                                            int(ignore_index), compute_dtype)
