"""Differentiable Linear+GELU and fused MLP ops over the Triton kernels.

Kernel launchers are torch.library custom ops (with fake implementations and flop
formulas), so torch.compile treats them as opaque nodes; the autograd.Functions
call them in forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from fusedtrain import eager
from fusedtrain.casts import cast_params
from fusedtrain.kernels import linear_gelu as K
from fusedtrain.ops._registry import backward_wanted, function_apply, launcher
from fusedtrain.ops._validate import (
    autocast_cast,
    autocast_params,
    check_approximate,
    check_linear,
    check_tensor,
)
from fusedtrain.ops.bias_grad import column_sums
from fusedtrain.ops.linear import weight_grad

Tensor = torch.Tensor

# ---------------------------------------------------------------- registered launchers


@launcher("linear_gelu_fwd", traceable=True)
def _linear_gelu_fwd(x: Tensor, weight: Tensor, bias: Tensor | None,
                     approximate: str) -> tuple[Tensor, Tensor]:
    y, h = K.linear_gelu_fwd(x, weight, bias, approximate, store_h=True)
    return y, h


@_linear_gelu_fwd.register_fake
def _(x, weight, bias, approximate):
    out = x.new_empty((x.shape[0], weight.shape[0]))
    return out, torch.empty_like(out)


@launcher("linear_gelu_infer", traceable=True)
def _linear_gelu_infer(x: Tensor, weight: Tensor, bias: Tensor | None,
                       approximate: str) -> Tensor:
    """The forward when no gradient is wanted: y only, h not written."""
    return K.linear_gelu_fwd(x, weight, bias, approximate, store_h=False)[0]


@_linear_gelu_infer.register_fake
def _(x, weight, bias, approximate):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _with_sums(dh: Tensor, db: Tensor | None) -> tuple[Tensor, Tensor]:
    """A launcher's (dh, db) with db empty when not asked for (an op returns tensors)."""
    return dh, db if db is not None else dh.new_empty(0)


def _fake_with_sums(h: Tensor, sums_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    return h.new_empty(h.shape), h.new_empty(h.shape[1] if sums_dtype else 0, dtype=sums_dtype)


@launcher("matmul_dgelu", traceable=True)
def _matmul_dgelu(dy: Tensor, w2: Tensor, h: Tensor, approximate: str,
                  sums_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """(dh, db): db = dh.sum(0) in sums_dtype, or empty without one."""
    return _with_sums(*K.matmul_dgelu(dy, w2, h, approximate, sums_dtype))


@_matmul_dgelu.register_fake
def _(dy, w2, h, approximate, sums_dtype):
    return _fake_with_sums(h, sums_dtype)


@launcher("matmul_gelu_rhs", traceable=True)
def _matmul_gelu_rhs(dy: Tensor, h: Tensor, approximate: str, out_dtype: torch.dtype) -> Tensor:
    return K.matmul_gelu_rhs(dy, h, approximate, out_dtype)


@_matmul_gelu_rhs.register_fake
def _(dy, h, approximate, out_dtype):
    return dy.new_empty((dy.shape[1], h.shape[1]), dtype=out_dtype)


@launcher("gelu_bwd", traceable=True)
def _gelu_bwd(dy: Tensor, h: Tensor, approximate: str,
              sums_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """(dh, db): db = dh.sum(0) in sums_dtype, or empty without one."""
    return _with_sums(*K.gelu_bwd(dy, h, approximate, sums_dtype))


@_gelu_bwd.register_fake
def _(dy, h, approximate, sums_dtype):
    return _fake_with_sums(h, sums_dtype)


@register_flop_formula([torch.ops.fusedtrain.linear_gelu_fwd,
                        torch.ops.fusedtrain.linear_gelu_infer])
def _(x_shape, w_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[0]


@register_flop_formula(torch.ops.fusedtrain.matmul_dgelu)
def _(dy_shape, w2_shape, *args, **kwargs) -> int:
    return 2 * dy_shape[0] * dy_shape[1] * w2_shape[1]


@register_flop_formula(torch.ops.fusedtrain.matmul_gelu_rhs)
def _(dy_shape, h_shape, *args, **kwargs) -> int:
    return 2 * dy_shape[0] * dy_shape[1] * h_shape[1]


# ---------------------------------------------------------------- autograd


# The Functions take the parameters in their own dtypes with a compute dtype (None: the
# inputs' dtype), cast them in forward (fusedtrain.casts) and return their gradients in
# those dtypes: weight gradients from the GEMMs' fp32 accumulators, bias gradients summed
# in fp32, each rounded once, with no cast kernel of their own.


def _dtypes(*params: Tensor | None) -> tuple[torch.dtype | None, ...]:
    return tuple(None if p is None else p.dtype for p in params)


def _none_if_empty(db: Tensor, dtype: torch.dtype | None) -> Tensor | None:
    return None if dtype is None else db


class LinearGELUFunction(torch.autograd.Function):
    """y = gelu(x @ W.T + b); saves x and h = x @ W.T + b, recomputes gelu'(h)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str,
                compute_dtype: torch.dtype | None):
        ctx.dtypes = _dtypes(weight, bias)
        weight, bias = cast_params(compute_dtype, weight, bias)
        y, h = _linear_gelu_fwd(x, weight, bias, approximate)
        ctx.save_for_backward(x, weight, h)
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, h = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        dh, db = _gelu_bwd(dy, h, ctx.approximate, b_dtype)
        return (dh @ weight, weight_grad(dh, x, w_dtype), _none_if_empty(db, b_dtype),
                None, None)


_apply_linear_gelu = function_apply(LinearGELUFunction)


class FusedMLPFunction(torch.autograd.Function):
    """y = gelu(x @ W1.T + b1) @ W2.T + b2, saving only x and h (never gelu(h))."""

    @staticmethod
    def forward(ctx, x, fc_weight, fc_bias, proj_weight, proj_bias, approximate: str,
                compute_dtype: torch.dtype | None):
        ctx.dtypes = _dtypes(fc_weight, fc_bias, proj_weight, proj_bias)
        w1, b1, w2, b2 = cast_params(compute_dtype, fc_weight, fc_bias, proj_weight, proj_bias)
        g, h = _linear_gelu_fwd(x, w1, b1, approximate)
        y = F.linear(g, w2, b2)  # g is dropped here, not saved
        ctx.save_for_backward(x, w1, w2, h)
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w1, w2, h = ctx.saved_tensors
        w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.dtypes
        a = ctx.approximate
        # dW2 first: its split-K partial sums are freed before dh is allocated.
        dw2 = _matmul_gelu_rhs(dy, h, a, w2_dtype)  # dy.T @ gelu(h)
        dh, db1 = _matmul_dgelu(dy, w2, h, a, b1_dtype)  # (dy @ W2) * gelu'(h)
        db2 = None if b2_dtype is None else column_sums(dy, b2_dtype)
        return (dh @ w1, weight_grad(dh, x, w1_dtype), _none_if_empty(db1, b1_dtype), dw2, db2,
                None, None)


_apply_fused_mlp = function_apply(FusedMLPFunction)


# ---------------------------------------------------------------- public ops


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                approximate: str = "none") -> Tensor:
    """y = gelu(x @ weight.T + bias).  x: (..., K), weight: (N, K), bias: (N,) -> (..., N)."""
    check_approximate(approximate)
    check_tensor("x", x, min_ndim=1)
    x, compute_dtype = autocast_params(x, weight, bias)
    check_linear(x, weight, bias, "weight", "bias", x.shape[-1], compute_dtype is None)
    if x.numel() == 0:
        return eager.linear_gelu(*autocast_cast(x, weight, bias), approximate)
    x2 = x.reshape(-1, x.shape[-1])
    if backward_wanted(x, weight, bias):
        y = _apply_linear_gelu(x2, weight, bias, approximate, compute_dtype)
    else:
        y = _linear_gelu_infer(x2, *cast_params(compute_dtype, weight, bias), approximate)
    return y.view(*x.shape[:-1], weight.shape[0])


def fused_mlp(x: Tensor, fc_weight: Tensor, fc_bias: Tensor | None, proj_weight: Tensor,
              proj_bias: Tensor | None, approximate: str = "none") -> Tensor:
    """y = gelu(x @ fc_weight.T + fc_bias) @ proj_weight.T + proj_bias.

    x: (..., C), fc_weight: (H, C), proj_weight: (C_out, H) -> (..., C_out).
    Saves for backward only x and the pre-activation h.
    """
    check_approximate(approximate)
    check_tensor("x", x, min_ndim=1)
    params = (fc_weight, fc_bias, proj_weight, proj_bias)
    x, compute_dtype = autocast_params(x, *params)
    same = compute_dtype is None
    check_linear(x, fc_weight, fc_bias, "fc_weight", "fc_bias", x.shape[-1], same)
    check_linear(x, proj_weight, proj_bias, "proj_weight", "proj_bias", fc_weight.shape[0], same)
    if x.numel() == 0:
        return eager.fused_mlp(*autocast_cast(x, *params), approximate)
    x2 = x.reshape(-1, x.shape[-1])
    if backward_wanted(x, *params):
        y = _apply_fused_mlp(x2, *params, approximate, compute_dtype)
    else:
        w1, b1, w2, b2 = cast_params(compute_dtype, *params)
        y = F.linear(_linear_gelu_infer(x2, w1, b1, approximate), w2, b2)
    return y.view(*x.shape[:-1], proj_weight.shape[0])
