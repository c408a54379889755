"""Embedding lookup, weight[idx], whose backward is the atomic scatter-add kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedtrain.kernels import embedding as K
from fusedtrain.kernels._common import stat_dtype
from fusedtrain.ops._registry import launcher
from fusedtrain.ops._validate import check_index_tensor, check_tensor

Tensor = torch.Tensor


@launcher("embedding_bwd")
def _embedding_bwd(idx: Tensor, dy: Tensor, num_rows: int) -> Tensor:
    """dW (num_rows, C) in fp32 (fp64); PyTorch's sorted, reproducible backward under
    torch.use_deterministic_algorithms(True)."""
    if torch.are_deterministic_algorithms_enabled():
        return torch.ops.aten.embedding_dense_backward(dy, idx, num_rows, -1, False).to(
            stat_dtype(dy))
    return K.embedding_bwd(idx, dy, num_rows)


@_embedding_bwd.register_fake
def _(idx, dy, num_rows):
    return dy.new_empty((num_rows, dy.shape[1]), dtype=stat_dtype(dy))


class EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(idx)
        ctx.num_rows = weight.shape[0]
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (idx,) = ctx.saved_tensors
        dw = _embedding_bwd(idx.reshape(-1), dy.reshape(-1, dy.shape[-1]), ctx.num_rows)
        return None, dw.to(dy.dtype)


def embedding(idx: Tensor, weight: Tensor) -> Tensor:
    """idx: (...) integer ids in [0, V), weight: (V, C) -> weight[idx]: (..., C)."""
    check_tensor("weight", weight, ndim=2)
    check_index_tensor("idx", idx, "row ids")
    if idx.device != weight.device:
        raise ValueError(f"idx is on {idx.device} but weight is on {weight.device}")
    if idx.numel() == 0 or not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding(idx, weight)
    return EmbeddingFunction.apply(idx, weight)
