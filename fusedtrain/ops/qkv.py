"""Differentiable fused QKV projection: x (B, T, C) -> q (B, H, T, D), k, v (B, HK, T, D),
q and k rotated with rotary embeddings on request."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from fusedtrain import eager
from fusedtrain.casts import cast_params
from fusedtrain.kernels import qkv as K
from fusedtrain.kernels import rope as rope_kernel
from fusedtrain.kernels._device import stat_dtype
from fusedtrain.kernels._launch import tracing
from fusedtrain.kernels.bias_grad import bias_grad
from fusedtrain.ops._registry import function_apply, launcher
from fusedtrain.ops._validate import autocast_cast, autocast_params, check_same, check_tensor
from fusedtrain.ops.linear import weight_grad
from fusedtrain.ops.rope import checked_rope

Tensor = torch.Tensor


@launcher("qkv_fwd", traceable=True)
def qkv_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, n_heads: int, n_kv_heads: int,
            rope_base: float | None, positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return K.qkv_fwd(x, weight, bias, n_heads, n_kv_heads, rope_base, positions)


@qkv_fwd.register_fake
def _(x, weight, bias, n_heads, n_kv_heads, rope_base, positions):
    B, T, C = x.shape
    D = C // n_heads
    return (x.new_empty((B, n_heads, T, D)), x.new_empty((B, n_kv_heads, T, D)),
            x.new_empty((B, n_kv_heads, T, D)))


@register_flop_formula(torch.ops.fusedtrain.qkv_fwd)
def _(x_shape, w_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * x_shape[2] * w_shape[0]


def _same_layout(dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernels index dq, dk, dv with one set of strides."""
    if dq.stride() == dk.stride() == dv.stride():
        return dq, dk, dv
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def _head_sums(g: Tensor) -> Tensor:
    """g: (B, H, T, D) -> its sums over batch and time, (H * D,), accumulated in fp32 (fp64
    for fp64 g): over time first, then batch (a third of the time of one reduction over
    both, non-adjacent, dimensions on an H200: 43 vs 133 us for gpt2's q, k and v)."""
    return g.sum(2, dtype=stat_dtype(g)).sum(0).flatten()


def _packed(dq: Tensor, dk: Tensor, dv: Tensor) -> Tensor | None:
    """The (B*T, (H + 2 HK) D) matrix [dq | dk | dv] (token rows, features (segment, head,
    d)) when the three are slices of one (B, T, H + 2 HK, D) buffer, as the fused
    attention's backward writes them for equal head counts (kernels.attention.grad_buffer);
    else None. None while traced for torch.compile: the traced gradients are three values,
    whose memory Inductor places (the strided kernels read them in place)."""
    if tracing():
        return None
    B, H, T, D = dq.shape
    width = (H + 2 * dk.shape[1]) * D
    packed = (T * width, D, width, 1)
    storage = dq.untyped_storage().data_ptr()
    if any(g.stride() != packed or g.untyped_storage().data_ptr() != storage
           for g in (dq, dk, dv)):
        return None
    size = dq.element_size()
    if (dk.data_ptr() - dq.data_ptr(), dv.data_ptr() - dk.data_ptr()) != (
            H * D * size, dk.shape[1] * D * size):
        return None
    return dq.as_strided((B * T, width), (width, 1))


def _gathered(dq: Tensor, dk: Tensor, dv: Tensor, rope_base: float | None,
              positions: Tensor | None) -> Tensor:
    """The (B*T, (H + 2 HK) D) matrix [dq | dk | dv] in a new buffer, dq and dk rotated back
    with a rope_base (the gradients before the rotation: its transpose is the rotation by
    the opposite angles)."""
    B, H, T, D = dq.shape
    HK = dk.shape[1]
    if rope_base is None:
        return torch.cat([g.transpose(1, 2) for g in (dq, dk, dv)], dim=2).view(B * T, -1)
    buf = dq.new_empty((B, T, H + 2 * HK, D))
    heads = buf.transpose(1, 2)
    rope_kernel.rope(dq, rope_base, positions, inverse=True, out=heads[:, :H])
    rope_kernel.rope(dk, rope_base, positions, inverse=True, out=heads[:, H:H + HK])
    heads[:, H + HK:].copy_(dv)
    return buf.view(B * T, -1)


@launcher("qkv_bwd", traceable=True)
def qkv_bwd(dq: Tensor, dk: Tensor, dv: Tensor, x: Tensor, weight: Tensor,
            weight_grad_dtype: torch.dtype, bias_grad_dtype: torch.dtype | None,
            rope_base: float | None, positions: Tensor | None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW, db): dW in weight_grad_dtype, db the sums (accumulated in fp32, fp64) in
    bias_grad_dtype, empty without one. The layout is looked at here, inside the op, so
    that torch.compile (whose fake tensors have no addresses) makes the same choice at run
    time. Two cuBLAS GEMMs and a column sum on the (B*T, (H + 2 HK) D) matrix [dq | dk |
    dv]: the fused attention's buffer itself where it is one (_packed), else gathered
    (grouped heads, whose gradients come as three tensors, and rotated q and k, rotated
    back into it). Equal head counts without rotation in any other layout go through the
    strided Triton kernels, which read them in place."""
    g = _packed(dq, dk, dv) if rope_base is None else None
    if g is None and (rope_base is not None or dk.shape != dq.shape):
        g = _gathered(dq, dk, dv, rope_base, positions)
    if g is not None:
        dx = (g @ weight).view(x.shape)
        dw = weight_grad(g, x.reshape(-1, x.shape[-1]), weight_grad_dtype)
        db = bias_grad(g, bias_grad_dtype) if bias_grad_dtype else None
    else:
        dq, dk, dv = _same_layout(dq, dk, dv)
        dx, dw = K.qkv_dx(dq, dk, dv, weight), K.qkv_dw(dq, dk, dv, x, weight_grad_dtype)
        db = (torch.cat([_head_sums(t) for t in (dq, dk, dv)]).to(bias_grad_dtype)
              if bias_grad_dtype else None)
    return dx, dw, db if db is not None else dq.new_empty(0)


@qkv_bwd.register_fake
def _(dq, dk, dv, x, weight, weight_grad_dtype, bias_grad_dtype, rope_base, positions):
    rows = weight.shape[0]
    return (dq.new_empty(x.shape), dq.new_empty(weight.shape, dtype=weight_grad_dtype),
            dq.new_empty(rows if bias_grad_dtype else 0, dtype=bias_grad_dtype))


@register_flop_formula(torch.ops.fusedtrain.qkv_bwd)
def _(dq_shape, dk_shape, dv_shape, x_shape, w_shape, *args, **kwargs) -> int:
    return 2 * (2 * x_shape[0] * x_shape[1] * w_shape[0] * w_shape[1])  # dx and dW


class QKVProjectionFunction(torch.autograd.Function):
    """compute_dtype: weight and bias cast to it here (None: they come in x's dtype); their
    gradients leave in their own dtypes (fusedtrain.casts). Saves x, the weight and the
    positions: the backward rotates dq and dk back itself."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, n_heads: int,
                n_kv_heads: int, rope_base: float | None, positions: Tensor | None,
                compute_dtype: torch.dtype | None):
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        weight, bias = cast_params(compute_dtype, weight, bias)
        q, k, v = qkv_fwd(x, weight, bias, n_heads, n_kv_heads, rope_base, positions)
        ctx.save_for_backward(x, weight, positions)
        ctx.rope_base = rope_base
        return q, k, v

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        x, weight, positions = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        dx, dw, db = qkv_bwd(dq, dk, dv, x, weight, w_dtype, b_dtype, ctx.rope_base, positions)
        return dx, dw, None if b_dtype is None else db, None, None, None, None, None


_apply_qkv_projection = function_apply(QKVProjectionFunction)


def checked_args(x: Tensor, weight: Tensor, bias: Tensor | None, n_heads: int,
                 n_kv_heads: int | None = None
                 ) -> tuple[Tensor, Tensor, Tensor | None, torch.dtype | None]:
    """qkv_projection's arguments validated (ValueError/TypeError naming the argument),
    x cast as autocast would cast it, and the dtype the op casts weight and bias to
    (None: none; ops._validate.autocast_params)."""
    check_tensor("x", x, ndim=3)
    check_tensor("weight", weight, ndim=2)
    if not isinstance(n_heads, int) or n_heads <= 0:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    C = x.shape[-1]
    if C % n_heads:
        raise ValueError(f"x's last dimension C={C} is not divisible by n_heads={n_heads}")
    kv = n_heads if n_kv_heads is None else n_kv_heads
    if not isinstance(kv, int) or kv <= 0 or n_heads % kv:
        raise ValueError(f"n_kv_heads must be a positive divisor of n_heads={n_heads}, got "
                         f"{n_kv_heads!r}")
    rows = C + 2 * kv * (C // n_heads)
    if tuple(weight.shape) != (rows, C):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ((n_heads + 2 "
                         f"n_kv_heads) D, C) = ({rows}, {C})")
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != rows:
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({rows},)")
    x, compute_dtype = autocast_params(x, weight, bias)
    check_same("x", x, compute_dtype is None, weight=weight, bias=bias)
    return x, weight, bias, compute_dtype


def qkv_projection(x: Tensor, weight: Tensor, bias: Tensor | None, n_heads: int,
                   n_kv_heads: int | None = None, rope_base: float | None = None,
                   positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v head-split from one weight [Wq | Wk | Wv] by one GEMM, q and k rotated in its
    epilogue with a rope_base.

    x: (B, T, C), weight: ((n_heads + 2 n_kv_heads) D, C), D = C // n_heads, bias: its rows
    -> q: (B, n_heads, T, D), k, v: (B, n_kv_heads, T, D) (n_kv_heads defaults to
    n_heads), contiguous. rope_base, positions ((B, T) ints, default t): q and k rotated as
    ops.rotary rotates them, from the fp32 accumulator.
    """
    x, weight, bias, compute_dtype = checked_args(x, weight, bias, n_heads, n_kv_heads)
    if positions is not None and rope_base is None:
        raise ValueError("positions are read only with rope_base (rotary embeddings)")
    B, T, C = x.shape
    if rope_base is not None:
        rope_base = checked_rope(rope_base, positions, B, T, C // n_heads, x)
    if x.numel() == 0:
        return eager.qkv_projection(*autocast_cast(x, weight, bias), n_heads, n_kv_heads,
                                    rope_base, positions)
    return _apply_qkv_projection(x, weight, bias, n_heads, n_kv_heads or n_heads, rope_base,
                                 positions, compute_dtype)
