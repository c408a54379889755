"""A plain linear layer, y = x @ W.T + b: the fused model's attention output projection
and its tied LM head.

Its GEMMs are cuBLAS's, as in nn.Linear; what differs is around them. Under autocast it
takes the weight and bias from `fusedtrain.casts.grouped_casts` when they were cast there
(no cast of its own, forward or backward). A weight cast nowhere else (the tied head's
fp32 embedding table) is cast inside the op, whose backward then writes the weight's
gradient in the weight's own dtype straight from the GEMM (`torch.mm(out_dtype=...)` on
CUDA): no bf16 gradient widened by a second pass (50304 x 768 on an H200: 1.88 against
1.96 ms, docs/perf-notes.md, fifteenth round). The bias gradient comes from the column-sum
kernel (fp32 accumulation, exact where PyTorch's bf16 `sum` rounds; 16 against 30 us at
16384 x 768).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedtrain.casts import autocast_dtype, has_prepared_cast
from fusedtrain.ops._validate import autocast_cast, check_linear, check_tensor
from fusedtrain.ops.bias_grad import column_sums

Tensor = torch.Tensor


def _weight_grad(dy2: Tensor, x2: Tensor, dtype: torch.dtype) -> Tensor:
    """dy2.T @ x2 in `dtype`: from the GEMM itself where cuBLAS can write it (16-bit
    operands, fp32 out, CUDA), else rounded and cast."""
    if dy2.is_cuda and dtype == torch.float32 and dy2.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(dy2.t(), x2, out_dtype=dtype)
    return (dy2.t() @ x2).to(dtype)


class LinearFunction(torch.autograd.Function):
    """compute_dtype: cast weight and bias to it here (None: they arrive in x's dtype);
    their gradients leave in their own dtypes."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None,
                compute_dtype: torch.dtype | None) -> Tensor:
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        if compute_dtype is not None:
            weight = weight.to(compute_dtype)
            bias = None if bias is None else bias.to(compute_dtype)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        dy2 = dy.reshape(-1, dy.shape[-1])
        want_x, want_w, want_b, _ = ctx.needs_input_grad
        dx = (dy2 @ weight).view(x.shape) if want_x else None
        dw = _weight_grad(dy2, x.reshape(-1, x.shape[-1]), w_dtype) if want_w else None
        db = column_sums(dy2, b_dtype) if b_dtype is not None and want_b else None
        return dx, dw, db, None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x: (..., K), weight: (N, K), bias: (N,) -> x @ weight.T + bias: (..., N)."""
    check_tensor("x", x, min_ndim=1)
    cast = autocast_dtype(x)
    compute_dtype = None
    if cast is not None and weight.dtype != cast and not has_prepared_cast(weight, cast):
        # Cast inside the op (see the module's docstring); x as F.linear would.
        x, compute_dtype = x.to(cast), cast
        check_linear(x, weight, bias, "weight", "bias", x.shape[-1], same_dtype=False)
    else:
        x, weight, bias = autocast_cast(x, weight, bias)
        check_linear(x, weight, bias, "weight", "bias", x.shape[-1])
    if x.numel() == 0:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return LinearFunction.apply(x, weight, bias, compute_dtype)
