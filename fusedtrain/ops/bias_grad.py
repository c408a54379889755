"""The column-sum kernel as a registered op: bias gradients of the fused linear layers."""

from __future__ import annotations

import torch

from fusedtrain.kernels.bias_grad import bias_grad
from fusedtrain.ops._registry import launcher


@launcher("bias_grad", traceable=True)
def column_sums(g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """g: (M, N) -> g.sum(0): (N,) in `dtype` (default g's), accumulated in fp32 (fp64 for
    fp64 g), then rounded once."""
    return bias_grad(g, dtype or g.dtype)


@column_sums.register_fake
def _(g, dtype=None):
    return g.new_empty(g.shape[1], dtype=dtype or g.dtype)
