"""A plain linear layer, y = x @ W.T + b: the fused model's attention output projection
and its tied LM head.

Its GEMMs are cuBLAS's, as in nn.Linear; what differs is around them. Under autocast the
op casts the weight and bias itself (from `fusedtrain.casts.grouped_casts` when they were
cast there), and its backward writes the weight's gradient in the weight's own dtype
straight from the GEMM (`torch.mm(out_dtype=...)` on CUDA): no bf16 gradient widened by a
second pass (the tied head's 50304 x 768 on an H200: 1.88 against 1.96 ms,
docs/journal.md). The bias gradient comes from the column-sum kernel
(fp32 accumulation, exact where PyTorch's bf16 `sum` rounds; 16 against 30 us at 16384 x
768).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedtrain.casts import cast_params
from fusedtrain.ops._registry import function_apply
from fusedtrain.ops._validate import autocast_params, check_linear, check_tensor
from fusedtrain.ops.bias_grad import column_sums

Tensor = torch.Tensor


def weight_grad(dy2: Tensor, x2: Tensor, dtype: torch.dtype) -> Tensor:
    """dy2: (M, N), x2: (M, K) -> dy2.T @ x2: (N, K) in `dtype`: from the GEMM itself where
    cuBLAS can write it (16-bit operands, fp32 out, CUDA), else rounded and cast."""
    if dy2.is_cuda and dtype == torch.float32 and dy2.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(dy2.t(), x2, out_dtype=dtype)
    return (dy2.t() @ x2).to(dtype)


def linear_grads(dy: Tensor, x: Tensor, weight: Tensor,
                 dtypes: tuple[torch.dtype, torch.dtype | None], wanted: tuple[bool, ...]
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """y = x @ weight.T + b's gradients from dy (..., N), x (..., K): dx in x's shape, dW
    and db in dtypes (the weight's and the bias's; None: no bias), each None where
    `wanted` (x, weight, bias) says so."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    want_x, want_w, want_b = wanted
    w_dtype, b_dtype = dtypes
    dx = (dy2 @ weight).view(x.shape) if want_x else None
    dw = weight_grad(dy2, x.reshape(-1, x.shape[-1]), w_dtype) if want_w else None
    db = column_sums(dy2, b_dtype) if b_dtype is not None and want_b else None
    return dx, dw, db


class LinearFunction(torch.autograd.Function):
    """compute_dtype: cast weight and bias to it here (None: they arrive in x's dtype);
    their gradients leave in their own dtypes (fusedtrain.casts)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None,
                compute_dtype: torch.dtype | None) -> Tensor:
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        weight, bias = cast_params(compute_dtype, weight, bias)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        return (*linear_grads(dy, x, weight, ctx.dtypes, ctx.needs_input_grad[:3]), None)


# compute_dtype follows from a replay's key (autocast, the dtypes): a replayed call does
# not compute it.
_apply_linear = function_apply(LinearFunction, derived=(3,))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x: (..., K), weight: (N, K), bias: (N,) -> x @ weight.T + bias: (..., N). A replayed
    signature skips the checks and autocast's cast of x: its record's call passed them, and
    an x that keys it is already in the autocast dtype."""
    out = _apply_linear.hit(x, weight, bias, None)
    if out is not None:
        return out
    check_tensor("x", x, min_ndim=1)
    x, compute_dtype = autocast_params(x, weight, bias)
    check_linear(x, weight, bias, "weight", "bias", x.shape[-1], same_dtype=compute_dtype is None)
    if x.numel() == 0:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return _apply_linear(x, weight, bias, compute_dtype)
