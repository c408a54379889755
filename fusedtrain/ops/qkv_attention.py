"""The QKV projection and flash attention as one differentiable op: x (B, T, C) -> o.

The forward is the two fused ops' kernels back to back (the projection's epilogue adds
the bias, and rotates q and k with a rope_base), under one autograd Function: one op's
host cost, not two. With equal head counts and no rotation the pairing pays in the
backward too: the projection alone gets its bias gradient from a column-sum pass over the
(B*T, 3C) gradient [dq | dk | dv]; here the attention's dq kernel sums it on the way
(kernels.attention.attention_bwd), and the projection's backward is its two GEMMs.
"""

from __future__ import annotations

import torch

from fusedtrain.casts import cast_params
from fusedtrain.kernels import attention_bwd as KB
from fusedtrain.ops._registry import function_apply
from fusedtrain.ops.attention import (
    attention_bwd,
    attention_bwd_grouped,
    attention_fwd,
    checked_scale,
    checked_window,
    flash_attention,
)
from fusedtrain.ops.qkv import checked_args, qkv_bwd, qkv_fwd, qkv_projection
from fusedtrain.ops.rope import checked_rope

Tensor = torch.Tensor


class QKVAttentionFunction(torch.autograd.Function):
    """Saves what the two ops save: x, the weight and the positions (the projection), q,
    k, v, o and the row log-sum-exp (the attention)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, n_heads: int,
                n_kv_heads: int, rope_base: float | None, positions: Tensor | None,
                causal: bool, softmax_scale: float, window: tuple[int, int],
                compute_dtype: torch.dtype | None):
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        weight, bias = cast_params(compute_dtype, weight, bias)
        q, k, v = qkv_fwd(x, weight, bias, n_heads, n_kv_heads, rope_base, positions)
        o, lse = attention_fwd(q, k, v, causal, softmax_scale, *window)
        ctx.save_for_backward(x, weight, positions, q, k, v, o, lse)
        ctx.args = (causal, softmax_scale, *window, 0.0)
        ctx.rope_base = rope_base
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        x, weight, positions, q, k, v, o, lse = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        if KB.packed_grads(q, k, v) and ctx.rope_base is None:
            # the dq kernel sums the bias gradient: the bias met the gradients unrotated
            grads, db = attention_bwd(do, q, k, v, o, lse, *ctx.args, b_dtype)
            dx, dw, _ = qkv_bwd(*grads.unbind(0), x, weight, w_dtype, None, None, None)
        else:
            grads = (attention_bwd(do, q, k, v, o, lse, *ctx.args)[0].unbind(0)
                     if KB.packed_grads(q, k, v)
                     else attention_bwd_grouped(do, q, k, v, o, lse, *ctx.args))
            dx, dw, db = qkv_bwd(*grads, x, weight, w_dtype, b_dtype, ctx.rope_base, positions)
        return (dx, dw, None if b_dtype is None else db, *(None,) * 8)


_apply_qkv_attention = function_apply(QKVAttentionFunction)


def qkv_attention(x: Tensor, weight: Tensor, bias: Tensor | None, n_heads: int,
                  causal: bool = True, softmax_scale: float | None = None,
                  window: tuple[int, int] | None = None, n_kv_heads: int | None = None,
                  rope_base: float | None = None, positions: Tensor | None = None) -> Tensor:
    """flash_attention(*qkv_projection(x, weight, bias, n_heads, n_kv_heads, rope_base,
    positions), causal, softmax_scale, window).

    x: (B, T, C), weight: ((n_heads + 2 n_kv_heads) D, C), D = C // n_heads, bias: its
    rows -> o: (B, n_heads, T, D), stored as (B, T, n_heads, D) (see flash_attention).
    """
    x, weight, bias, compute_dtype = checked_args(x, weight, bias, n_heads, n_kv_heads)
    B, T, C = x.shape
    scale = checked_scale(C // n_heads, softmax_scale)
    window = checked_window(window)
    if positions is not None and rope_base is None:
        raise ValueError("positions are read only with rope_base (rotary embeddings)")
    if rope_base is not None:
        rope_base = checked_rope(rope_base, positions, B, T, C // n_heads, x)
    if x.numel() == 0:
        return flash_attention(*qkv_projection(x, weight, bias, n_heads, n_kv_heads, rope_base,
                                               positions), causal, scale, window)
    return _apply_qkv_attention(x, weight, bias, n_heads, n_kv_heads or n_heads, rope_base,
                                positions, bool(causal), scale, window, compute_dtype)
