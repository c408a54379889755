"""Differentiable fused QKV projection: x (B, T, C) -> q, k, v (B, H, T, D)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from fusedtrain import eager
from fusedtrain.kernels import qkv as K
from fusedtrain.ops._registry import launcher
from fusedtrain.ops._validate import autocast_cast, check_same, check_tensor

Tensor = torch.Tensor


@launcher("qkv_fwd")
def _qkv_fwd(x: Tensor, weight: Tensor, bias: Tensor | None,
             n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    return K.qkv_fwd(x, weight, bias, n_heads)


@_qkv_fwd.register_fake
def _(x, weight, bias, n_heads):
    B, T, C = x.shape
    return tuple(x.new_empty((B, n_heads, T, C // n_heads)) for _ in range(3))


@launcher("qkv_dx")
def _qkv_dx(dq: Tensor, dk: Tensor, dv: Tensor, weight: Tensor) -> Tensor:
    return K.qkv_dx(dq, dk, dv, weight)


@_qkv_dx.register_fake
def _(dq, dk, dv, weight):
    B, H, T, D = dq.shape
    return dq.new_empty((B, T, H * D))


@launcher("qkv_dw")
def _qkv_dw(dq: Tensor, dk: Tensor, dv: Tensor, x: Tensor) -> Tensor:
    return K.qkv_dw(dq, dk, dv, x)


@_qkv_dw.register_fake
def _(dq, dk, dv, x):
    C = x.shape[-1]
    return dq.new_empty((3 * C, C))


@register_flop_formula(torch.ops.fusedtrain.qkv_fwd)
def _(x_shape, w_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * x_shape[2] * w_shape[0]


@register_flop_formula([torch.ops.fusedtrain.qkv_dx, torch.ops.fusedtrain.qkv_dw])
def _(dq_shape, *args, **kwargs) -> int:
    B, H, T, D = dq_shape
    return 2 * B * T * (3 * H * D) * (H * D)


def _same_layout(dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernels index dq, dk, dv with one set of strides."""
    if dq.stride() == dk.stride() == dv.stride():
        return dq, dk, dv
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def _consecutive(*ts: Tensor) -> bool:
    """Contiguous tensors of one shape in one storage, each starting where the previous one
    ends. (Separate allocations can also lie back to back; a view over them would reach
    past the first one's storage.)"""
    size = ts[0].numel() * ts[0].element_size()
    storage = ts[0].untyped_storage().data_ptr()
    return all(t.is_contiguous() and t.shape == ts[0].shape
               and t.untyped_storage().data_ptr() == storage for t in ts) and all(
        b.data_ptr() - a.data_ptr() == size for a, b in zip(ts, ts[1:]))


def _bias_grad(dq: Tensor, dk: Tensor, dv: Tensor) -> Tensor:
    """db = [sum of dq | dk | dv over (batch, time)]: (3C,), accumulated in fp32 (fp64 for
    fp64 gradients). One reduction when the three lie one after another in one buffer, as
    the fused attention backward writes them; otherwise (and under torch.compile, which
    fuses the reductions itself) three and a concatenation."""
    if not torch.compiler.is_compiling() and _consecutive(dq, dk, dv):
        stacked = dq.as_strided((3, *dq.shape), (dq.numel(), *dq.stride()))
        # Time first, then batch: 43 us against 65 for .sum((1, 3)) at gpt2's shape on an
        # H200 (PyTorch's reduction is slow over two non-adjacent dimensions); the partial
        # sums stay in fp32, so the two steps round once, as one would.
        partial = stacked.sum(3, dtype=torch.promote_types(dq.dtype, torch.float32))
        return partial.sum(1).flatten()
    return torch.cat([g.sum((0, 2)).flatten() for g in (dq, dk, dv)])


class QKVProjectionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, n_heads: int):
        q, k, v = _qkv_fwd(x, weight, bias, n_heads)
        ctx.save_for_backward(x, weight, bias)
        return q, k, v

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        x, weight, bias = ctx.saved_tensors
        dq, dk, dv = _same_layout(dq, dk, dv)
        dx = _qkv_dx(dq, dk, dv, weight)
        dw = _qkv_dw(dq, dk, dv, x)
        db = None if bias is None else _bias_grad(dq, dk, dv).to(bias.dtype)
        return dx, dw, db, None


def qkv_projection(x: Tensor, weight: Tensor, bias: Tensor | None,
                   n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """One GEMM over weight = [Wq|Wk|Wv] writing q, k, v head-split.

    x: (B, T, C), weight: (3C, C), bias: (3C,) -> q, k, v: (B, n_heads, T, C // n_heads).
    """
    check_tensor("x", x, ndim=3)
    check_tensor("weight", weight, ndim=2)
    if not isinstance(n_heads, int) or n_heads <= 0:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    C = x.shape[-1]
    if C % n_heads:
        raise ValueError(f"x's last dimension C={C} is not divisible by n_heads={n_heads}")
    if tuple(weight.shape) != (3 * C, C):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected (3C, C) = "
                         f"({3 * C}, {C})")
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != 3 * C:
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({3 * C},)")
    x, weight, bias = autocast_cast(x, weight, bias)
    check_same("x", x, weight=weight, bias=bias)
    if x.numel() == 0:
        return eager.qkv_projection(x, weight, bias, n_heads)
    return QKVProjectionFunction.apply(x, weight, bias, n_heads)
