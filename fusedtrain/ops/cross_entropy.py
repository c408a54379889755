"""Differentiable cross-entropy on (tokens, vocab) logits, read in their own dtype."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from fusedtrain.kernels import cross_entropy as K
from fusedtrain.kernels._common import stat_dtype
from fusedtrain.ops._registry import backward_wanted, launcher, runs_directly
from fusedtrain.ops._validate import check_tensor

Tensor = torch.Tensor


@launcher("cross_entropy_fwd")
def _cross_entropy_fwd(logits: Tensor, targets: Tensor,
                       ignore_index: int) -> tuple[Tensor, Tensor]:
    return K.cross_entropy_fwd(logits, targets, ignore_index)


@_cross_entropy_fwd.register_fake
def _(logits, targets, ignore_index):
    stat = stat_dtype(logits)
    M = logits.shape[0]
    return logits.new_empty(M, dtype=stat), logits.new_empty(M, dtype=stat)


@launcher("cross_entropy_bwd")
def _cross_entropy_bwd(logits: Tensor, targets: Tensor, lse: Tensor, g: Tensor,
                       ignore_index: int) -> Tensor:
    return K.cross_entropy_bwd(logits, targets, lse, g, ignore_index)


@_cross_entropy_bwd.register_fake
def _(logits, targets, lse, g, ignore_index):
    return logits.new_empty(logits.shape)


@register_flop_formula(torch.ops.fusedtrain.cross_entropy_fwd)
def _(logits_shape, *args, **kwargs) -> int:
    return 0  # no matmul: FlopCounterMode counts matmul flops only


class CrossEntropyFunction(torch.autograd.Function):
    """Mean cross-entropy over the non-ignored rows; saves the logits and the fp32
    log-sum-exp per row, never a softmax or an fp32 copy of the logits. With `inplace`,
    the gradient is written over the logits, in forward already (see cross_entropy)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int, inplace: bool,
                grad_wanted: bool):
        count = (targets != ignore_index).sum()
        # The launchers are declared non-mutating for torch.compile and dispatch modes,
        # so the in-place forms run only when called directly.
        ctx.grad_made = inplace and grad_wanted and runs_directly(logits)
        if ctx.grad_made:  # the gradient of the mean for dloss = 1, over the logits
            scale = count.reciprocal().to(stat_dtype(logits)).reshape(1)
            losses, lse = K.cross_entropy_fwd(logits, targets, ignore_index, scale)
        else:
            losses, lse = _cross_entropy_fwd(logits, targets, ignore_index)
        ctx.save_for_backward(logits, targets, lse, count)
        ctx.ignore_index, ctx.inplace = ignore_index, inplace
        return losses.sum() / count

    @staticmethod
    def backward(ctx, dloss: Tensor):
        logits, targets, lse, count = ctx.saved_tensors
        if ctx.grad_made:
            return K.scale_unless_one(logits, dloss.reshape(1)), None, None, None, None
        g = (dloss / count).to(lse.dtype).reshape(1)  # stays on the device: no sync
        if ctx.inplace and runs_directly(logits):
            dlogits = K.cross_entropy_bwd(logits, targets, lse, g, ctx.ignore_index,
                                          inplace=True)
        else:
            dlogits = _cross_entropy_bwd(logits, targets, lse, g, ctx.ignore_index)
        return dlogits, None, None, None, None


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100,
                  inplace_backward: bool = False) -> Tensor:
    """Mean cross-entropy of logits (..., V) against integer targets (...): the same
    value as F.cross_entropy on the logits upcast to fp32 (fp32 result; fp64 for fp64
    logits). Rows whose target is ignore_index are left out of the mean; a target
    outside [0, V) gives NaN.

    inplace_backward: the gradient is written over the logits' memory, saving one
    logits-sized buffer (1.6 GB for GPT-2 at 16 x 1024 tokens), so use it only for logits
    nothing else reads (as GPT.loss does). Called directly with a gradient to come, the
    forward itself writes it, right after each row's loss, while the row is in cache:
    the logits' values are gone once the loss is returned, and backward only multiplies
    by the loss's gradient, and not at all when that is 1 (as in loss.backward()).
    """
    check_tensor("logits", logits, min_ndim=1)
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() \
            or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError("targets must be an integer tensor of class indices")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets has shape {tuple(targets.shape)}, expected "
                         f"{tuple(logits.shape[:-1])} (the logits' shape without the last)")
    if targets.device != logits.device:
        raise ValueError(f"targets is on {targets.device} but logits is on {logits.device}")
    if logits.shape[-1] == 0:
        raise ValueError("logits has an empty last (vocabulary) dimension")
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return CrossEntropyFunction.apply(rows, targets.reshape(-1).long(), int(ignore_index),
                                      bool(inplace_backward), backward_wanted(rows))
