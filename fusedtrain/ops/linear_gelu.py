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
from fusedtrain.kernels import linear_gelu as K
from fusedtrain.ops._registry import backward_wanted, launcher
from fusedtrain.ops._validate import (
    autocast_cast,
    check_approximate,
    check_linear,
    check_tensor,
)
from fusedtrain.ops.bias_grad import column_sums

Tensor = torch.Tensor

# ---------------------------------------------------------------- registered launchers


@launcher("linear_gelu_fwd")
def _linear_gelu_fwd(x: Tensor, weight: Tensor, bias: Tensor | None,
                     approximate: str) -> tuple[Tensor, Tensor]:
    y, h = K.linear_gelu_fwd(x, weight, bias, approximate, store_h=True)
    return y, h


@_linear_gelu_fwd.register_fake
def _(x, weight, bias, approximate):
    out = x.new_empty((x.shape[0], weight.shape[0]))
    return out, torch.empty_like(out)


@launcher("linear_gelu_infer")
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


def _fake_with_sums(h: Tensor, col_sums: bool) -> tuple[Tensor, Tensor]:
    return h.new_empty(h.shape), h.new_empty(h.shape[1] if col_sums else 0)


@launcher("matmul_dgelu")
def _matmul_dgelu(dy: Tensor, w2: Tensor, h: Tensor, approximate: str,
                  col_sums: bool) -> tuple[Tensor, Tensor]:
    """(dh, db): db = dh.sum(0) in dh's dtype with col_sums, else empty."""
    return _with_sums(*K.matmul_dgelu(dy, w2, h, approximate, col_sums))


@_matmul_dgelu.register_fake
def _(dy, w2, h, approximate, col_sums):
    return _fake_with_sums(h, col_sums)


@launcher("matmul_gelu_rhs")
def _matmul_gelu_rhs(dy: Tensor, h: Tensor, approximate: str) -> Tensor:
    return K.matmul_gelu_rhs(dy, h, approximate)


@_matmul_gelu_rhs.register_fake
def _(dy, h, approximate):
    return dy.new_empty((dy.shape[1], h.shape[1]))


@launcher("gelu_bwd")
def _gelu_bwd(dy: Tensor, h: Tensor, approximate: str, col_sums: bool) -> tuple[Tensor, Tensor]:
    """(dh, db): db = dh.sum(0) in dh's dtype with col_sums, else empty."""
    return _with_sums(*K.gelu_bwd(dy, h, approximate, col_sums))


@_gelu_bwd.register_fake
def _(dy, h, approximate, col_sums):
    return _fake_with_sums(h, col_sums)


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


# The bias gradients below come in the gradient's dtype, which the inputs' checks make
# the bias's: summed in fp32, rounded once, with no cast kernel of their own.


def _bias_grad(dh: Tensor, bias: Tensor | None) -> Tensor | None:
    """dh: (M, N) -> dh.sum(0) (None without a bias)."""
    return None if bias is None else column_sums(dh)


class LinearGELUFunction(torch.autograd.Function):
    """y = gelu(x @ W.T + b); saves x and h = x @ W.T + b, recomputes gelu'(h)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str):
        y, h = _linear_gelu_fwd(x, weight, bias, approximate)
        ctx.save_for_backward(x, weight, bias, h)
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, bias, h = ctx.saved_tensors
        dh, db = _gelu_bwd(dy, h, ctx.approximate, bias is not None)
        return dh @ weight, dh.t() @ x, db if bias is not None else None, None


class FusedMLPFunction(torch.autograd.Function):
    """y = gelu(x @ W1.T + b1) @ W2.T + b2, saving only x and h (never gelu(h))."""

    @staticmethod
    def forward(ctx, x, fc_weight, fc_bias, proj_weight, proj_bias, approximate: str):
        g, h = _linear_gelu_fwd(x, fc_weight, fc_bias, approximate)
        y = F.linear(g, proj_weight, proj_bias)  # g is dropped here, not saved
        ctx.save_for_backward(x, fc_weight, fc_bias, proj_weight, proj_bias, h)
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w1, b1, w2, b2, h = ctx.saved_tensors
        a = ctx.approximate
        # dW2 first: its split-K partial sums are freed before dh is allocated.
        dw2 = _matmul_gelu_rhs(dy, h, a)      # dy.T @ gelu(h)
        dh, db1 = _matmul_dgelu(dy, w2, h, a, b1 is not None)  # (dy @ W2) * gelu'(h)
        return dh @ w1, dh.t() @ x, db1 if b1 is not None else None, dw2, _bias_grad(dy, b2), None


# ---------------------------------------------------------------- public ops


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                approximate: str = "none") -> Tensor:
    """y = gelu(x @ weight.T + bias).  x: (..., K), weight: (N, K), bias: (N,) -> (..., N)."""
    check_approximate(approximate)
    check_tensor("x", x, min_ndim=1)
    x, weight, bias = autocast_cast(x, weight, bias)
    check_linear(x, weight, bias, "weight", "bias", x.shape[-1])
    if x.numel() == 0:
        return eager.linear_gelu(x, weight, bias, approximate)
    x2 = x.reshape(-1, x.shape[-1])
    y = (LinearGELUFunction.apply(x2, weight, bias, approximate) if backward_wanted(x, weight, bias)
         else _linear_gelu_infer(x2, weight, bias, approximate))
    return y.view(*x.shape[:-1], weight.shape[0])


def fused_mlp(x: Tensor, fc_weight: Tensor, fc_bias: Tensor | None, proj_weight: Tensor,
              proj_bias: Tensor | None, approximate: str = "none") -> Tensor:
    """y = gelu(x @ fc_weight.T + fc_bias) @ proj_weight.T + proj_bias.

    x: (..., C), fc_weight: (H, C), proj_weight: (C_out, H) -> (..., C_out).
    Saves for backward only x and the pre-activation h.
    """
    check_approximate(approximate)
    check_tensor("x", x, min_ndim=1)
    x, fc_weight, fc_bias, proj_weight, proj_bias = autocast_cast(
        x, fc_weight, fc_bias, proj_weight, proj_bias)
    check_linear(x, fc_weight, fc_bias, "fc_weight", "fc_bias", x.shape[-1])
    check_linear(x, proj_weight, proj_bias, "proj_weight", "proj_bias", fc_weight.shape[0])
    if x.numel() == 0:
        return eager.fused_mlp(x, fc_weight, fc_bias, proj_weight, proj_bias, approximate)
    x2 = x.reshape(-1, x.shape[-1])
    if backward_wanted(x, fc_weight, fc_bias, proj_weight, proj_bias):
        y = FusedMLPFunction.apply(x2, fc_weight, fc_bias, proj_weight, proj_bias, approximate)
    else:
        y = F.linear(_linear_gelu_infer(x2, fc_weight, fc_bias, approximate), proj_weight,
                     proj_bias)
    return y.view(*x.shape[:-1], proj_weight.shape[0])
