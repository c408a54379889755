"""Embedding lookups with Triton backwards: `embedding` (weight[idx]), whose gradient
_embedding_bwd builds, and `gpt_embedding`, GPT's input (token plus position rows, one
pass) with its tied output head's gradient gathered in the same backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedtrain.kernels import embedding as K
from fusedtrain.kernels._device import stat_dtype
from fusedtrain.ops._registry import function_apply, launcher
from fusedtrain.ops._validate import check_index_tensor, check_same, check_tensor

Tensor = torch.Tensor


@launcher("embedding_bwd", traceable=True)
def _embedding_bwd(idx: Tensor, dy: Tensor, num_rows: int) -> Tensor:
    """dW (num_rows, C) in dy's dtype, sums in fp32 (fp64). Up to K.SWEEP_TOKENS tokens, one
    sweep of the table (deterministic; 1 kernel, PyTorch's 2 at this size); beyond, PyTorch's
    sorted, reproducible backward under torch.use_deterministic_algorithms(True); for a
    16-bit dy and fewer tokens than rows, each id's sum rounded once into the table; else
    atomic adds into the fp32 table."""
    if idx.shape[0] <= K.SWEEP_TOKENS:
        return K.embedding_bwd_sweep(idx, dy, num_rows)
    if torch.are_deterministic_algorithms_enabled():
        return torch.ops.aten.embedding_dense_backward(dy, idx, num_rows, -1, False)
    if dy.element_size() == 2 and idx.shape[0] < num_rows:
        return K.embedding_bwd_rows(idx, dy, num_rows)
    return K.embedding_bwd(idx, dy, num_rows)[0].to(dy.dtype)


@_embedding_bwd.register_fake
def _(idx, dy, num_rows):
    return dy.new_empty((num_rows, dy.shape[1]))


class EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(idx)
        ctx.num_rows = weight.shape[0]
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (idx,) = ctx.saved_tensors
        return None, _embedding_bwd(idx.reshape(-1), dy.reshape(-1, dy.shape[-1]), ctx.num_rows)


_apply_embedding = function_apply(EmbeddingFunction)


def embedding(idx: Tensor, weight: Tensor) -> Tensor:
    """idx: (...) integer ids in [0, V), weight: (V, C) -> weight[idx]: (..., C). A replayed
    signature skips the checks (its record's call passed them)."""
    out = _apply_embedding.hit(idx, weight)
    if out is not None:
        return out
    check_tensor("weight", weight, ndim=2)
    check_index_tensor("idx", idx, "row ids")
    if idx.device != weight.device:
        raise ValueError(f"idx is on {idx.device} but weight is on {weight.device}")
    if idx.numel() == 0 or not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding(idx, weight)
    return _apply_embedding(idx, weight)


# ---------------------------------------------------------------- GPT's input embedding


@launcher("gpt_embedding_fwd", traceable=True)
def _gpt_embedding_fwd(idx: Tensor, token_weight: Tensor, position_weight: Tensor,
                       positions: Tensor | None = None) -> Tensor:
    B, T = idx.shape
    ids = None if positions is None else positions.reshape(-1)
    return K.embedding_fwd(idx.reshape(-1), token_weight, position_weight, T, ids).view(B, T, -1)


@_gpt_embedding_fwd.register_fake
def _(idx, token_weight, position_weight, positions=None):
    return token_weight.new_empty((*idx.shape, token_weight.shape[1]))


def _gpt_embedding_grads(idx: Tensor, dx: Tensor, dw: Tensor | None, num_rows: int,
                         num_positions: int, positions: Tensor | None
                         ) -> tuple[Tensor, Tensor]:
    """(dW, dP) in fp32 (fp64): dx's rows added at idx (into dw, in place, when given: an
    fp32 (fp64) contiguous (V, C) gradient) and at their positions (0..T-1 along each
    row, or `positions`)."""
    B, T = idx.shape
    dx2, flat = dx.reshape(-1, dx.shape[-1]), idx.reshape(-1)
    ids = None if positions is None else positions.reshape(-1)
    if not torch.are_deterministic_algorithms_enabled():
        return K.embedding_bwd(flat, dx2, num_rows, dw, num_positions, T, ids)
    acc = stat_dtype(dx)
    tokens = torch.ops.aten.embedding_dense_backward(dx2, flat, num_rows, -1, False).to(acc)
    if ids is None:
        dpos = dx.new_zeros((num_positions, dx.shape[-1]), dtype=acc)
        dpos[:T] = dx.sum(0, dtype=acc)
    else:
        dpos = torch.ops.aten.embedding_dense_backward(dx2, ids, num_positions, -1,
                                                       False).to(acc)
    return (tokens if dw is None else dw.add_(tokens)), dpos


@launcher("gpt_embedding_bwd", traceable=True)
def _gpt_embedding_bwd(idx: Tensor, dx: Tensor, head_grad: Tensor | None, num_rows: int,
                       num_positions: int, positions: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
    """(dW, dP): dW = head_grad (when given) + dx's rows added at idx, in a new tensor."""
    dw = None if head_grad is None else head_grad.to(stat_dtype(dx), copy=True)
    return _gpt_embedding_grads(idx, dx, dw, num_rows, num_positions, positions)


@_gpt_embedding_bwd.register_fake
def _(idx, dx, head_grad, num_rows, num_positions, positions=None):
    C, acc = dx.shape[-1], stat_dtype(dx)
    return dx.new_empty((num_rows, C), dtype=acc), dx.new_empty((num_positions, C), dtype=acc)


@launcher("gpt_embedding_bwd_into", mutates=("head_grad",), traceable=True)
def _gpt_embedding_bwd_into(idx: Tensor, dx: Tensor, head_grad: Tensor,
                            num_positions: int, positions: Tensor | None = None) -> Tensor:
    """dP; dx's rows added at idx into head_grad itself (contiguous, fp32 or fp64 as
    stat_dtype(dx)): under torch.compile Inductor then writes into the head's gradient
    buffer instead of copying it first (a 154 MB fp32 copy at GPT-2's size)."""
    return _gpt_embedding_grads(idx, dx, head_grad, head_grad.shape[0], num_positions,
                                positions)[1]


@_gpt_embedding_bwd_into.register_fake
def _(idx, dx, head_grad, num_positions, positions=None):
    return dx.new_empty((num_positions, dx.shape[-1]), dtype=stat_dtype(dx))


class GPTEmbeddingFunction(torch.autograd.Function):
    """(x, head weight): the head weight is the token table itself, returned so that the
    head's gradient for it arrives in this backward, which adds the embedding's rows into
    it. With `inplace` into that (V, C) gradient itself: no (V, C) buffer of its own, and
    no second (V, C) gradient for autograd to add (on an H200 at GPT-2's size each is a
    pass over 154 MB), compiled too (the op declares the write)."""

    @staticmethod
    def forward(ctx, idx: Tensor, token_weight: Tensor, position_weight: Tensor,
                inplace: bool, positions: Tensor | None):
        ctx.save_for_backward(idx, positions)
        ctx.tables = [(w.shape[0], w.dtype) for w in (token_weight, position_weight)]
        ctx.inplace = inplace
        return _gpt_embedding_fwd(idx, token_weight, position_weight, positions), token_weight

    @staticmethod
    def backward(ctx, dx: Tensor, head_grad: Tensor | None):
        idx, positions = ctx.saved_tensors
        (V, token_dtype), (P, position_dtype) = ctx.tables
        if dx is None:
            dx = idx.new_zeros((*idx.shape, head_grad.shape[1]), dtype=head_grad.dtype)
        in_place = (ctx.inplace and head_grad is not None and head_grad.is_contiguous()
                    and head_grad.dtype == stat_dtype(dx))
        if in_place:
            dw, dpos = head_grad, _gpt_embedding_bwd_into(idx, dx, head_grad, P, positions)
        else:
            dw, dpos = _gpt_embedding_bwd(idx, dx, head_grad, V, P, positions)
        return None, dw.to(token_dtype), dpos.to(position_dtype), None, None


_apply_gpt_embedding = function_apply(GPTEmbeddingFunction)


def gpt_embedding(idx: Tensor, token_weight: Tensor, position_weight: Tensor,
                  inplace_backward: bool = False, *,
                  positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """GPT's input embedding, with its tied output head's weight.

    idx: (B, T) token ids in [0, V), token_weight: (V, C), position_weight: (P, C), P >= T
    -> (x, head_weight): x = token_weight[idx] + position_weight[:T]: (B, T, C) in
    token_weight's dtype, or with positions ((B, T) ints in [0, P), e.g. packed documents'
    Documents.positions) x[b, t] = token_weight[idx[b, t]] + position_weight[positions[b, t]]
    (a row of NaN for an id outside its table, which gets no gradient there:
    checking the ids on the host would cost a sync), and head_weight, token_weight itself,
    for the output head tied to the token table to read instead of token_weight: its
    gradient then meets the embedding's in this op's backward, which adds the embedding's
    rows into it.

    inplace_backward: add them into the head's incoming gradient itself, saving a (V, C)
    buffer and a pass over it; that gradient's values are changed, so use it only when the
    head's backward hands over a buffer of its own that nothing else reads (as GPT's head,
    ops.linear or ops.linear_cross_entropy, does).
    """
    check_index_tensor("idx", idx, "token ids")
    check_tensor("token_weight", token_weight, ndim=2)
    check_tensor("position_weight", position_weight, ndim=2)
    if idx.dim() != 2:
        raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
    T, C = idx.shape[1], token_weight.shape[1]
    if position_weight.shape[1] != C:
        raise ValueError(f"position_weight has shape {tuple(position_weight.shape)}: "
                         f"expected (P, {C}) to match token_weight's width {C}")
    if positions is not None:
        check_index_tensor("positions", positions, "positions")
        if positions.shape != idx.shape:
            raise ValueError(f"positions must have idx's shape {tuple(idx.shape)}, got "
                             f"{tuple(positions.shape)}")
    elif position_weight.shape[0] < T:
        raise ValueError(f"sequence length {T} exceeds position_weight's {position_weight.shape[0]}"
                         " positions")
    check_same("token_weight", token_weight, idx=idx, position_weight=position_weight,
               same_dtype=False, **({} if positions is None else {"positions": positions}))
    if position_weight.dtype != token_weight.dtype:
        raise TypeError(f"position_weight has dtype {position_weight.dtype} but token_weight "
                        f"has {token_weight.dtype}")
    if idx.numel() == 0:
        from fusedtrain import eager

        return eager.gpt_embedding(idx, token_weight, position_weight, positions=positions)
    if torch.is_grad_enabled() and (token_weight.requires_grad or position_weight.requires_grad):
        return _apply_gpt_embedding(idx, token_weight, position_weight,
                                    bool(inplace_backward), positions)
    return _gpt_embedding_fwd(idx, token_weight, position_weight, positions), token_weight
