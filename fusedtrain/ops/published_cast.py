"""A weight's cast for the fused ops under torch.compile, through the optimizer's copy.

Uncompiled, `fusedtrain.casts.cast_params` asks fusedtrain.weight_copies for the copy
that fusedtrain's AdamW wrote for a weight in its own pass, and only casts when there is
none. A traced function cannot ask once at trace time: the copy is fresh or not at each
call. So under torch.compile `cast_params` calls this op, opaque to the compiler, which
asks at run time. Without it Inductor casts every weight again each step (at GPT-2's size
~0.33 ms of an H200 step, 24 cast kernels and more).
"""

from __future__ import annotations

import torch

from fusedtrain.ops._registry import launcher
from fusedtrain.weight_copies import WEIGHT_COPIES


@launcher("published_cast")
def published_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight in `dtype`: the copy published for it while fresh (the optimizer's own
    tensor, not a new one: the compiled code only reads it), else a cast.

    Not while a CUDA graph is being captured (Inductor's reduce-overhead mode): a replay
    reads the addresses captured without looking the copy up again, so it could read a
    copy gone stale; the captured cast is made again at each replay instead."""
    capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
    copy = None if capturing else WEIGHT_COPIES.fresh(weight, dtype)
    return copy if copy is not None else weight.to(dtype)


@published_cast.register_fake
def _(weight, dtype):
    return torch.empty_like(weight, dtype=dtype)
