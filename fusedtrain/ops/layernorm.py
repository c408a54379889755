"""Differentiable LayerNorm family: layer_norm, layer_norm_stream, add_layer_norm,
layer_norm_gelu, and RMSNorm as rms_norm and add_rms_norm.

Under autocast the normalised output is written in the autocast dtype (the next op is a
low-precision GEMM either way), statistics stay fp32, and x / residual / weight / bias
may have different floating dtypes (each is upcast as it is loaded). Outside autocast
they must share one dtype.
"""

from __future__ import annotations

import torch

from fusedtrain import eager
from fusedtrain.kernels import layernorm as K
from fusedtrain.kernels._device import stat_dtype
from fusedtrain.ops._registry import backward_wanted, function_apply, launcher
from fusedtrain.ops._validate import (
    autocast_dtype,
    check_approximate,
    check_same,
    check_tensor,
)

Tensor = torch.Tensor


@launcher("layer_norm_fwd", traceable=True)
def _layer_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                    approximate: str, out_dtype: torch.dtype, save_stats: bool,
                    rms: bool = False) -> tuple[Tensor, Tensor]:
    """(y, stats): see K.layer_norm_fwd."""
    y, _, stats = K.layer_norm_fwd(x, None, weight, bias, eps, approximate or None, out_dtype,
                                   x.dtype, save_stats, None, rms)
    return y, stats


@_layer_norm_fwd.register_fake
def _(x, weight, bias, eps, approximate, out_dtype, save_stats, rms=False):
    M = x.numel() // x.shape[-1] if save_stats else 0
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((2, M), dtype=stat_dtype(x))


@launcher("add_layer_norm_fwd", traceable=True)
def _add_layer_norm_fwd(x: Tensor, residual: Tensor, weight: Tensor | None,
                        bias: Tensor | None, eps: float, out_dtype: torch.dtype,
                        stream_dtype: torch.dtype, save_stats: bool, x_bias: Tensor | None = None,
                        rms: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(y, s, stats): see K.layer_norm_fwd."""
    return K.layer_norm_fwd(x, residual, weight, bias, eps, None, out_dtype, stream_dtype,
                            save_stats, x_bias, rms)


@_add_layer_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, out_dtype, stream_dtype, save_stats, x_bias=None,
      rms=False):
    M = x.numel() // x.shape[-1] if save_stats else 0
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=stream_dtype),
            x.new_empty((2, M), dtype=stat_dtype(x)))


@launcher("layer_norm_bwd", traceable=True)
def _layer_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                    stats: Tensor, ds: Tensor | None, approximate: str,
                    dx_dtype: torch.dtype, dx2_dtype: torch.dtype | None,
                    dx_sums: bool = False, sums_dtype: torch.dtype | None = None,
                    rms: bool = False) -> list[Tensor]:
    """[dx, sums] or, with dx2_dtype, [dx, sums, dx in dx2_dtype] (see K.layer_norm_bwd)."""
    dx, dx2, sums = K.layer_norm_bwd(dy, x, weight, bias, stats, ds, approximate or None,
                                     dx_dtype, dx2_dtype, dx_sums, sums_dtype, rms)
    return [dx, sums] if dx2 is None else [dx, sums, dx2]


@_layer_norm_bwd.register_fake
def _(dy, x, weight, bias, stats, ds, approximate, dx_dtype, dx2_dtype, dx_sums=False,
      sums_dtype=None, rms=False):
    grads = [x.new_empty(x.shape, dtype=dx_dtype),
             x.new_empty((3 if dx_sums else 2, x.shape[-1]), dtype=sums_dtype or stats.dtype)]
    return grads if dx2_dtype is None else [*grads, x.new_empty(x.shape, dtype=dx2_dtype)]


def _sums_dtype(*params: Tensor | None) -> torch.dtype | None:
    """The one dtype of the given parameters, for the backward to write their gradient
    sums in (None: they differ, or there are none; the sums then stay fp32)."""
    dtypes = {p.dtype for p in params if p is not None}
    return dtypes.pop() if len(dtypes) == 1 else None


def _param_grads(sums: Tensor, weight: Tensor | None, bias: Tensor | None):
    """(dW, db) from the backward's (2, C) sums, in the parameters' dtypes."""
    return (None if weight is None else sums[0].to(weight.dtype),
            None if bias is None else sums[1].to(bias.dtype))


class LayerNormFunction(torch.autograd.Function):
    """y = [gelu](layer_norm(x)); saves x and the (2, M) statistics only. With `stream`,
    (y, x): x also passes through (a residual stream), and the gradient that reaches it
    there comes into this backward, whose one pass adds it to dx (as add_layer_norm's
    does): no separate add of x's two (..., C) gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, approximate: str, out_dtype: torch.dtype,
                save_stats: bool, stream: bool = False, rms: bool = False):
        y, stats = _layer_norm_fwd(x, weight, bias, eps, approximate, out_dtype, save_stats,
                                   rms)
        ctx.save_for_backward(x, weight, bias, stats)
        ctx.approximate, ctx.rms = approximate, rms
        ctx.sums_dtype = _sums_dtype(weight, bias)
        return (y, x) if stream else y

    @staticmethod
    def backward(ctx, dy, ds=None):
        x, weight, bias, stats = ctx.saved_tensors
        dx, sums = _layer_norm_bwd(dy, x, weight, bias, stats, ds, ctx.approximate, x.dtype,
                                   None, False, ctx.sums_dtype, ctx.rms)
        return (dx, *_param_grads(sums, weight, bias), None, None, None, None, None, None)


class AddLayerNormFunction(torch.autograd.Function):
    """(layer_norm(s), s) with s = (x [+ x_bias]) + residual, in one pass; saves s."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps: float, out_dtype: torch.dtype,
                save_stats: bool, x_bias, rms: bool = False):
        stream_dtype = torch.promote_types(x.dtype, residual.dtype)
        if x_bias is not None:
            stream_dtype = torch.promote_types(stream_dtype, x_bias.dtype)
        y, s, stats = _add_layer_norm_fwd(x, residual, weight, bias, eps, out_dtype,
                                          stream_dtype, save_stats, x_bias, rms)
        ctx.save_for_backward(s, weight, bias, stats)
        ctx.dtypes = (x.dtype, residual.dtype, None if x_bias is None else x_bias.dtype)
        ctx.sums_dtype, ctx.rms = _sums_dtype(weight, bias, x_bias), rms
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight, bias, stats = ctx.saved_tensors
        x_dtype, res_dtype, xb_dtype = ctx.dtypes
        # d/dx = d/dresidual: one gradient, written in each input's dtype by the one pass;
        # d/dx_bias its column sums, from the same pass.
        grads = _layer_norm_bwd(dy, s, weight, bias, stats, ds, "", res_dtype,
                                None if x_dtype == res_dtype else x_dtype, xb_dtype is not None,
                                ctx.sums_dtype, ctx.rms)
        dres, sums = grads[:2]
        dx = grads[2] if len(grads) == 3 else dres
        dxb = None if xb_dtype is None else sums[2].to(xb_dtype)
        return (dx, dres, *_param_grads(sums, weight, bias), None, None, None, dxb, None)


# out_dtype and backward_wanted follow from a replay's key (autocast, dtypes, grad mode,
# requires_grad): a replayed call does not compute them.
_apply_layer_norm = function_apply(LayerNormFunction, derived=(5, 6))
_apply_add_layer_norm = function_apply(AddLayerNormFunction, derived=(5, 6))


def _check(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
           residual: Tensor | None = None, x_bias: Tensor | None = None) -> None:
    """Validate: shapes, eps, and one dtype and device (under autocast, one device)."""
    check_tensor("x", x, min_ndim=1)
    C = x.shape[-1]
    if C > K.MAX_C:
        raise ValueError(f"x's last dimension {C} exceeds the supported maximum {K.MAX_C}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    named = {"residual": residual, "weight": weight, "bias": bias, "x_bias": x_bias}
    for name, t in named.items():
        if t is not None:
            check_tensor(name, t)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)} but x has "
                         f"{tuple(x.shape)}")
    for name in ("weight", "bias", "x_bias"):
        t = named[name]
        if t is not None and tuple(t.shape) != (C,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({C},)")
    if autocast_dtype(x) is None:
        check_same("x", x, **named)
        return
    for name, t in named.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def _out_dtype(x: Tensor) -> torch.dtype:
    """The output dtype: the autocast dtype under autocast, else x's."""
    return autocast_dtype(x) or x.dtype


def _normalise(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
               approximate: str = "", stream: bool = False, rms: bool = False):
    """LayerNormFunction on checked inputs: [gelu](layer_norm(x)) (rms_norm(x) with `rms`),
    with `stream` also x; an empty x through the eager twin. A replayed signature skips
    the checks (function_apply's `hit`)."""
    if isinstance(x, Tensor):
        out = _apply_layer_norm.hit(x, weight, bias, eps, approximate, None, None, stream, rms)
        if out is not None:
            return out
    _check(x, weight, bias, eps)
    out_dtype = _out_dtype(x)
    if x.numel() == 0:
        y = (eager.rms_norm(x, weight, eps) if rms
             else eager.layer_norm_gelu(x, weight, bias, eps, approximate) if approximate
             else eager.layer_norm(x, weight, bias, eps)).to(out_dtype)
        return (y, x) if stream else y
    return _apply_layer_norm(x, weight, bias, eps, approximate, out_dtype,
                       backward_wanted(x, weight, bias), stream, rms)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None,
               eps: float = 1e-5) -> Tensor:
    """x: (..., C), weight, bias: (C,) -> y: (..., C); statistics in fp32."""
    return _normalise(x, weight, bias, eps)


def layer_norm_stream(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                      eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """(layer_norm(x), x): a pre-LN block's first LayerNorm when nothing is added to the
    residual stream x before it (GPT's first block). The same values as layer_norm and x;
    in backward the gradient of the returned x is added by the LayerNorm's pass."""
    return _normalise(x, weight, bias, eps, stream=True)


def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None,
                   eps: float = 1e-5, x_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """s = (x [+ x_bias]) + residual; returns (layer_norm(s), s) in one pass.
    x, residual: (..., C); x_bias: (C,), the bias of the layer that made x, added here so
    that its gradient comes from this op's backward pass (dx's column sums) instead of a
    separate read of dx."""
    return _add_normalise(x, residual, weight, bias, eps, x_bias)


def _add_normalise(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None,
                   eps: float, x_bias: Tensor | None = None, rms: bool = False):
    """AddLayerNormFunction on checked inputs (RMSNorm with `rms`); an empty x through the
    eager twin. A replayed signature skips the checks."""
    if isinstance(x, Tensor):
        out = _apply_add_layer_norm.hit(x, residual, weight, bias, eps, None, None, x_bias,
                                        rms)
        if out is not None:
            return out
    if residual is None:
        raise ValueError("residual must be a tensor; use layer_norm without one")
    _check(x, weight, bias, eps, residual, x_bias)
    out_dtype = _out_dtype(x)
    if x.numel() == 0:
        y, s = (eager.add_rms_norm(x, residual, weight, eps) if rms
                else eager.add_layer_norm(x, residual, weight, bias, eps, x_bias))
        return y.to(out_dtype), s
    return _apply_add_layer_norm(x, residual, weight, bias, eps, out_dtype,
                             backward_wanted(x, residual, weight, bias, x_bias), x_bias, rms)


def layer_norm_gelu(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5,
                    approximate: str = "none") -> Tensor:
    """y = gelu(layer_norm(x)) written once; backward recomputes the normalised value."""
    check_approximate(approximate)
    return _normalise(x, weight, bias, eps, approximate)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
    """x: (..., C), weight: (C,) -> y = x / sqrt(mean(x^2) + eps) * weight: (..., C);
    statistics in fp32. Saves x and the per-row rstd for backward."""
    return _normalise(x, weight, None, eps, rms=True)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None,
                 eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """s = x + residual; returns (rms_norm(s), s) in one pass.  x, residual: (..., C)."""
    return _add_normalise(x, residual, weight, None, eps, rms=True)
