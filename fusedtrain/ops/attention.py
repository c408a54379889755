"""Differentiable flash attention: q, k, v (B, H, T, D) -> o (B, H, T, D)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from fusedtrain.kernels import attention as K
from fusedtrain.kernels import attention_bwd as KB
from fusedtrain.kernels._device import stat_dtype
from fusedtrain.ops._registry import function_apply, launcher
from fusedtrain.ops._validate import autocast_cast, check_same, check_tensor

Tensor = torch.Tensor


@launcher("attention_fwd")
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool,
                   softmax_scale: float) -> tuple[Tensor, Tensor]:
    return K.attention_fwd(q, k, v, causal, softmax_scale)


@attention_fwd.register_fake
def _(q, k, v, causal, softmax_scale):
    return K.output_buffer(q), q.new_empty(q.shape[:3], dtype=stat_dtype(q))


@launcher("attention_bwd")
def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   causal: bool, softmax_scale: float,
                   bias_grad_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(3, B, H, T, D): dq, dk, dv in one buffer laid out as K.grad_buffer (a custom op's
    outputs may not alias, so the three views are taken by the caller); and the gradient
    (3C,) of a bias added to q, k, v before the attention, in bias_grad_dtype, or an empty
    tensor without one (see KB.attention_bwd)."""
    grads, db = KB.attention_bwd(do, q, k, v, o, lse, causal, softmax_scale, bias_grad_dtype)
    return grads, db if db is not None else q.new_empty(0)


@attention_bwd.register_fake
def _(do, q, k, v, o, lse, causal, softmax_scale, bias_grad_dtype=None):
    B, H, T, D = q.shape
    db = (q.new_empty(3 * H * D, dtype=bias_grad_dtype) if bias_grad_dtype is not None
          else q.new_empty(0))
    return K.grad_buffer(q), db


def _attention_flops(q_shape, causal: bool, matmuls: int) -> int:
    B, H, T, D = q_shape
    flops = matmuls * 2 * B * H * T * T * D
    return flops // 2 if causal else flops  # causal: only the lower triangle is computed


@register_flop_formula(torch.ops.fusedtrain.attention_fwd)
def _(q_shape, k_shape, v_shape, causal, *args, **kwargs) -> int:
    return _attention_flops(q_shape, causal, matmuls=2)


@register_flop_formula(torch.ops.fusedtrain.attention_bwd)
def _(do_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, causal, *args, **kwargs) -> int:
    return _attention_flops(q_shape, causal, matmuls=5)  # s recomputed, dv, dp, dq, dk


class FlashAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, o and the fp32 row log-sum-exp; never the (T, T) matrix."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float):
        o, lse = attention_fwd(q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.softmax_scale = causal, softmax_scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        grads, _ = attention_bwd(do, q, k, v, o, lse, ctx.causal, ctx.softmax_scale)
        dq, dk, dv = grads.unbind(0)
        return dq, dk, dv, None, None


_apply_flash_attention = function_apply(FlashAttentionFunction)


def checked_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The softmax scale for a head dim the kernels take (ValueError otherwise);
    softmax_scale defaults to 1 / sqrt(head_dim)."""
    if not 1 <= head_dim <= K.MAX_HEAD_DIM:
        raise ValueError(f"head dim D={head_dim} is not supported: the kernel takes 1 <= D <= "
                         f"{K.MAX_HEAD_DIM}")
    scale = K.default_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    if not scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    return scale


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                    softmax_scale: float | None = None) -> Tensor:
    """softmax(q k^T * scale [+ causal mask]) v without the (T, T) matrix in memory.

    q, k, v: (B, H, T, D), D <= 128, any strides -> o: (B, H, T, D), stored as
    (B, T, H, D) so that merging the heads back, o.transpose(1, 2).reshape(B, T, H * D),
    is a view.
    softmax_scale defaults to 1 / sqrt(D).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have the same shape (B, H, T, D); got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = checked_scale(q.shape[-1], softmax_scale)
    q, k, v = autocast_cast(q, k, v)
    check_same("q", q, k=k, v=v)
    if q.numel() == 0:
        return torch.empty_like(q)
    return _apply_flash_attention(q, k, v, bool(causal), scale)
