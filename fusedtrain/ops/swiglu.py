"""Differentiable SwiGLU MLP over the Triton kernels: y = (silu(x Wg^T) * (x Wu^T)) Wd^T,
saving x and the two pre-activations only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from fusedtrain import eager
from fusedtrain.casts import cast_params
from fusedtrain.kernels import swiglu as K
from fusedtrain.ops._registry import backward_wanted, function_apply, launcher
from fusedtrain.ops._validate import autocast_cast, autocast_params, check_linear, check_tensor
from fusedtrain.ops.linear import weight_grad

Tensor = torch.Tensor


@launcher("swiglu_fwd", traceable=True)
def _swiglu_fwd(x: Tensor, gate_weight: Tensor, up_weight: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(g, u, h): the pre-activations, for backward, and h = silu(g) * u."""
    return K.swiglu_fwd(x, gate_weight, up_weight)


@_swiglu_fwd.register_fake
def _(x, gate_weight, up_weight):
    h = x.new_empty((x.shape[0], gate_weight.shape[0]))
    return torch.empty_like(h), torch.empty_like(h), h


@launcher("swiglu_bwd", traceable=True)
def _swiglu_bwd(dy: Tensor, down_weight: Tensor, g: Tensor,
                u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dg, du, h): see K.swiglu_bwd."""
    return K.swiglu_bwd(dy, down_weight, g, u)


@_swiglu_bwd.register_fake
def _(dy, down_weight, g, u):
    return torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)


@register_flop_formula(torch.ops.fusedtrain.swiglu_fwd)
def _(x_shape, gate_shape, *args, **kwargs) -> int:
    return 2 * 2 * x_shape[0] * x_shape[1] * gate_shape[0]


@register_flop_formula(torch.ops.fusedtrain.swiglu_bwd)
def _(dy_shape, w_shape, *args, **kwargs) -> int:
    return 2 * dy_shape[0] * dy_shape[1] * w_shape[1]


class SwiGLUMLPFunction(torch.autograd.Function):
    """Saves x, the weights (cast) and g, u; silu(g) * u is recomputed in backward for the
    down projection's weight gradient, and lives only until that GEMM is done."""

    @staticmethod
    def forward(ctx, x: Tensor, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor,
                compute_dtype: torch.dtype | None):
        ctx.dtypes = tuple(w.dtype for w in (gate_weight, up_weight, down_weight))
        wg, wu, wd = cast_params(compute_dtype, gate_weight, up_weight, down_weight)
        g, u, h = _swiglu_fwd(x, wg, wu)
        y = F.linear(h, wd)  # h is dropped here, not saved
        ctx.save_for_backward(x, wg, wu, wd, g, u)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, wg, wu, wd, g, u = ctx.saved_tensors
        g_dtype, u_dtype, d_dtype = ctx.dtypes
        dg, du, h = _swiglu_bwd(dy, wd, g, u)
        dwd = weight_grad(dy, h, d_dtype)  # dy.T @ (silu(g) * u)
        del h
        dx = torch.addmm(dg @ wg, du, wu)
        return dx, weight_grad(dg, x, g_dtype), weight_grad(du, x, u_dtype), dwd, None


_apply_swiglu_mlp = function_apply(SwiGLUMLPFunction)


def swiglu_mlp(x: Tensor, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor
               ) -> Tensor:
    """y = (silu(x @ gate_weight.T) * (x @ up_weight.T)) @ down_weight.T.

    x: (..., C), gate_weight, up_weight: (H, C), down_weight: (C_out, H) -> (..., C_out).
    Saves for backward x and the two pre-activations only (the eager form also keeps
    silu(g) and silu(g) * u).
    """
    check_tensor("x", x, min_ndim=1)
    weights = (gate_weight, up_weight, down_weight)
    x, compute_dtype = autocast_params(x, *weights)
    same = compute_dtype is None
    check_linear(x, gate_weight, None, "gate_weight", "bias", x.shape[-1], same)
    check_linear(x, up_weight, None, "up_weight", "bias", x.shape[-1], same)
    if up_weight.shape != gate_weight.shape:
        raise ValueError(f"up_weight has shape {tuple(up_weight.shape)} but gate_weight has "
                         f"{tuple(gate_weight.shape)}: both must be (H, C)")
    check_linear(x, down_weight, None, "down_weight", "bias", gate_weight.shape[0], same)
    if x.numel() == 0:
        return eager.swiglu_mlp(*autocast_cast(x, *weights))
    x2 = x.reshape(-1, x.shape[-1])
    if backward_wanted(x, *weights):
        y = _apply_swiglu_mlp(x2, *weights, compute_dtype)
    else:
        wg, wu, wd = cast_params(compute_dtype, *weights)
        y = F.linear(_swiglu_fwd(x2, wg, wu)[2], wd)
    return y.view(*x.shape[:-1], down_weight.shape[0])
