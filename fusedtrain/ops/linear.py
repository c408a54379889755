"""A plain linear layer, y = x @ W.T + b, for the fused model's attention output projection.

Its GEMMs are cuBLAS's, as in nn.Linear; what differs is around them. Under autocast
it takes the weight and bias from `fusedtrain.casts.grouped_casts` (no cast of its own,
forward or backward), and the bias gradient comes from the column-sum kernel (fp32
accumulation, exact where PyTorch's bf16 `sum` rounds; 16 against 30 us at 16384 x 768
on an H200, docs/perf-notes.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedtrain.ops._validate import autocast_cast, check_linear, check_tensor
from fusedtrain.ops.bias_grad import column_sums

Tensor = torch.Tensor


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        want_x, want_w, want_b = ctx.needs_input_grad
        dx = (dy2 @ weight).view(x.shape) if want_x else None
        dw = dy2.t() @ x.reshape(-1, x.shape[-1]) if want_w else None
        db = column_sums(dy2) if ctx.has_bias and want_b else None
        return dx, dw, db


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x: (..., K), weight: (N, K), bias: (N,) -> x @ weight.T + bias: (..., N)."""
    check_tensor("x", x, min_ndim=1)
    x, weight, bias = autocast_cast(x, weight, bias)
    check_linear(x, weight, bias, "weight", "bias", x.shape[-1])
    if x.numel() == 0:
        return F.linear(x, weight, bias)
    return LinearFunction.apply(x, weight, bias)
