"""The documents packed into a (B, T) batch, as the model reads them: from cu_seqlens,
each token's position in its document and, for eager attention, the keys each query sees."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fusedtrain.ops.attention import vouch_cu_seqlens

Tensor = torch.Tensor


# cu_seqlens' length is part of each attention call's signature (a new one is recorded
# before it replays, and recompiled under torch.compile): ending it with zero-length
# documents up to a multiple of 8 gives the stdlib corpus's gpt2 batches (16 rows of 1024,
# 34-37 entries) one length, at the cost of at most 7 sequences' empty programs.
SEQUENCE_MULTIPLE = 8


class Documents(NamedTuple):
    """cu_seqlens: int32 (n + 1,), the first token of each document in the batch's B * T
    flattened tokens, then B * T, with every row's first token among them (so no document
    crosses a row, and none is longer than T), n + 1 a multiple of SEQUENCE_MULTIPLE
    (zero-length documents at the end); positions: (B, T) int64, each token's place
    in its document; seen: (B, 1, T, T) bool, which keys each query sees (its own
    document's, causal, within the window), for eager attention; None where no eager
    attention reads it."""

    cu_seqlens: Tensor
    positions: Tensor
    seen: Tensor | None


def documents(cu_seqlens: Tensor, rows: int, length: int, window: int | None = None,
              eager: bool = True) -> Documents:
    """cu_seqlens: int32 (n + 1,), document starts in the (rows, length) batch's flattened
    tokens (data.pack_collate's) -> Documents. Every row's start is added (where it is
    already one, a zero-length document: programs that return at once), values are
    clamped to [0, rows * length] and the end repeated up to the multiple, so the result
    follows the varlen rules for any input: the attention ops are told so
    (vouch_cu_seqlens) and read none of its values. window: each token sees itself and
    this many before it."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be an int32 tensor, got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
    n, device = rows * length, cu_seqlens.device
    row_starts = torch.arange(0, n + 1, length, device=device, dtype=torch.int32)
    pad = -(cu_seqlens.shape[0] + row_starts.shape[0]) % SEQUENCE_MULTIPLE
    cu = torch.cat([cu_seqlens.clamp(0, n), row_starts, row_starts.new_full((pad,), n)])
    cu = cu.sort().values
    vouch_cu_seqlens(cu, n, length)
    token = torch.arange(n, device=device, dtype=torch.int32)
    doc = torch.searchsorted(cu, token, right=True) - 1  # the last start at or before it
    positions = (token - cu[doc]).view(rows, length).long()
    if not eager:
        return Documents(cu, positions, None)
    doc = doc.view(rows, 1, length)
    i = torch.arange(length, device=device)
    behind = i[:, None] - i[None, :]  # query i, key j: i - j
    seen = (doc.transpose(1, 2) == doc) & (behind >= 0)
    if window is not None:
        seen &= behind <= window
    return Documents(cu, positions, seen[:, None])
