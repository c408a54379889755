"""The QKV projection and flash attention over packed documents as one differentiable op:
x (B, T, C) -> o (B * T, H, D), no token attending across a cu_seqlens boundary.

Composed of ops.linear, views, ops.rotary and ops.flash_attention_varlen, the backward
concatenates dq, dk and dv into the projection's (B * T, 3C) output gradient (autograd's
split backward): at gpt2's B = 16, T = 1024 that is 150 MB moved a layer. Here the
attention's backward kernels write dq, dk and dv side by side in that gradient
(attention_bwd_varlen_packed), and the projection's backward reads it whole. With a
rope_base, q and k are rotated into their own tensors in the forward, and their gradients
rotated back in place in that buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedtrain.casts import cast_params
from fusedtrain.ops._registry import function_apply
from fusedtrain.ops.attention import (
    attention_bwd_varlen_packed,
    attention_fwd_varlen,
    checked_cu_seqlens,
    checked_scale,
    checked_window,
    head_major,
)
from fusedtrain.ops.linear import linear_grads
from fusedtrain.ops.qkv import checked_args
from fusedtrain.ops.rope import _rope, checked_rope

Tensor = torch.Tensor


def sequence_positions(cu_seqlens: Tensor, n: int) -> Tensor:
    """int32 (batch + 1,) sequence starts -> (n,) int64: each token's place in its
    sequence, computed on the device (no host read)."""
    token = torch.arange(n, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens, token, right=True) - 1  # the last start at or before
    return (token - cu_seqlens[seq]).long()


class QKVAttentionVarlenFunction(torch.autograd.Function):
    """Saves x, the weight, the (rotated) projection y = [q | k | v], o, the row
    log-sum-exp, cu_seqlens and the positions; never the gradient's three parts."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, heads: tuple[int, int],
                rope_base: float | None, positions: Tensor | None, cu_seqlens: Tensor,
                max_seqlen: int, causal: bool, softmax_scale: float, window: tuple[int, int],
                compute_dtype: torch.dtype | None):
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        weight, bias = cast_params(compute_dtype, weight, bias)
        H, HK = heads
        N = x.shape[0] * x.shape[1]
        y = F.linear(x.reshape(N, -1), weight, bias).view(N, H + 2 * HK, -1)
        q, k, v = y.split([H, HK, HK], dim=1)
        if rope_base is not None:  # q and k adjacent in y: one rotation into (N, H + HK, D)
            qk = _rope(head_major(y[:, :H + HK]), rope_base, positions, False)[0].transpose(0, 1)
            q, k = qk.split([H, HK], dim=1)
        o, lse = attention_fwd_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      causal, softmax_scale, *window, 0.0)
        ctx.save_for_backward(x, weight, q, k, v, o, lse, cu_seqlens, positions)
        ctx.args = (max_seqlen, max_seqlen, causal, softmax_scale, *window, 0.0)
        ctx.rope_base = rope_base
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        x, weight, q, k, v, o, lse, cu, positions = ctx.saved_tensors
        g = attention_bwd_varlen_packed(do, q, k, v, o, lse, cu, cu, *ctx.args, ctx.rope_base,
                                        positions)
        return (*linear_grads(g.view(g.shape[0], -1), x, weight, ctx.dtypes,
                              ctx.needs_input_grad[:3]), *(None,) * 9)


_apply_qkv_attention_varlen = function_apply(QKVAttentionVarlenFunction)


def qkv_attention_varlen(x: Tensor, weight: Tensor, bias: Tensor | None, n_heads: int,
                         cu_seqlens: Tensor, max_seqlen: int, causal: bool = True,
                         softmax_scale: float | None = None,
                         window: tuple[int, int] | None = None, n_kv_heads: int | None = None,
                         rope_base: float | None = None, positions: Tensor | None = None
                         ) -> Tensor:
    """flash_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
    causal, softmax_scale, window) of the projection x @ weight.T + bias of packed tokens.

    x: (B, T, C), its B * T tokens the packed sequences (cu_seqlens: int32 (batch + 1,)
    over the flattened tokens, flash_attention_varlen's rules; a sequence may cross a row).
    weight: ((n_heads + 2 n_kv_heads) D, C), D = C // n_heads, bias: its rows; the
    projection's columns are [q | k | v], each head's D in a row. With rope_base, q and k
    rotated (ops.rotary) at positions: (B, T) ints, default each token's place in its
    sequence. -> o: (B * T, n_heads, D).
    """
    x, weight, bias, compute_dtype = checked_args(x, weight, bias, n_heads, n_kv_heads)
    B, T, C = x.shape
    H, HK = n_heads, n_kv_heads or n_heads
    D = C // H
    scale = checked_scale(D, softmax_scale)
    window = checked_window(window)
    checked_cu_seqlens(x, cu_seqlens, cu_seqlens, B * T, B * T, max_seqlen, max_seqlen,
                       names=("", ""))
    if positions is not None and rope_base is None:
        raise ValueError("positions are read only with rope_base (rotary embeddings)")
    if rope_base is not None:
        rope_base = checked_rope(rope_base, positions, B, T, D, x)
        positions = (sequence_positions(cu_seqlens, B * T) if positions is None
                     else positions.reshape(B * T))[None]
    if x.numel() == 0:
        return x.new_zeros((B * T, H, D))
    return _apply_qkv_attention_varlen(x, weight, bias, (H, HK), rope_base, positions,
                                       cu_seqlens, max_seqlen, bool(causal), scale, window,
                                       compute_dtype)
