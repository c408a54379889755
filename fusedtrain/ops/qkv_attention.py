"""The QKV projection and flash attention as one differentiable op: x (B, T, C) -> o.

The forward is the two fused ops' kernels back to back (the projection's epilogue adds
the bias). The pairing pays in the backward: the projection alone gets its bias gradient
from a column-sum pass over the (B*T, 3C) gradient [dq | dk | dv]; here the attention's
dq kernel sums it on the way (kernels.attention.attention_bwd), and the projection's
backward is its two GEMMs.
"""

from __future__ import annotations

import torch

from fusedtrain.casts import cast_params
from fusedtrain.ops._registry import function_apply
from fusedtrain.ops.attention import (
    attention_bwd,
    attention_fwd,
    checked_scale,
    checked_window,
    flash_attention,
)
from fusedtrain.ops.qkv import checked_args, qkv_bwd, qkv_fwd, qkv_projection

Tensor = torch.Tensor


class QKVAttentionFunction(torch.autograd.Function):
    """Saves what the two ops save: x and the weight (the projection), q, k, v, o and the
    row log-sum-exp (the attention)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, n_heads: int,
                causal: bool, softmax_scale: float, window: tuple[int, int],
                compute_dtype: torch.dtype | None):
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        weight, bias = cast_params(compute_dtype, weight, bias)
        q, k, v = qkv_fwd(x, weight, bias, n_heads, n_heads, None, None)
        o, lse = attention_fwd(q, k, v, causal, softmax_scale, *window)
        ctx.save_for_backward(x, weight, q, k, v, o, lse)
        ctx.args = (causal, softmax_scale, *window)
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        x, weight, q, k, v, o, lse = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        grads, db = attention_bwd(do, q, k, v, o, lse, *ctx.args, 0.0, b_dtype)
        dx, dw, _ = qkv_bwd(*grads.unbind(0), x, weight, w_dtype, None, None, None)
        return dx, dw, None if b_dtype is None else db, None, None, None, None, None


_apply_qkv_attention = function_apply(QKVAttentionFunction)


def qkv_attention(x: Tensor, weight: Tensor, bias: Tensor | None, n_heads: int,
                  causal: bool = True, softmax_scale: float | None = None,
                  window: tuple[int, int] | None = None) -> Tensor:
    """flash_attention(*qkv_projection(x, weight, bias, n_heads), causal, softmax_scale,
    window).

    x: (B, T, C), weight: (3C, C), bias: (3C,) -> o: (B, n_heads, T, C // n_heads), stored
    as (B, T, n_heads, C // n_heads) (see flash_attention).
    """
    x, weight, bias, compute_dtype = checked_args(x, weight, bias, n_heads)
    scale = checked_scale(x.shape[-1] // n_heads, softmax_scale)
    window = checked_window(window)
    if x.numel() == 0:
        return flash_attention(*qkv_projection(x, weight, bias, n_heads), causal, scale, window)
    return _apply_qkv_attention(x, weight, bias, n_heads, bool(causal), scale, window,
                                compute_dtype)
