"""A weight's cast for the fused ops under torch.compile, through the optimizer's copy.

Uncompiled, `fusedtrain.casts.cast_params` finds the copy that fusedtrain's AdamW wrote
and published for a weight in its own pass, by the weight's identity and version counter,
and only casts when there is none. A traced function cannot look that up once at trace
time: the copy is fresh or not at each call. So under torch.compile `cast_params` calls
this op, opaque to the compiler, which does the lookup at run time. Without it Inductor
casts every weight again each step (at GPT-2's size ~0.33 ms of an H200 step, 24 cast
kernels and more; docs/perf-notes.md, thirtieth round).
"""

from __future__ import annotations

import torch

from fusedtrain.casts import published_copy
from fusedtrain.ops._registry import launcher


@launcher("published_cast")
def published_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight in `dtype`: the copy published for it while fresh (the optimizer's own
    tensor, not a new one: the compiled code only reads it), else a cast.

    Not while a CUDA graph is being captured (Inductor's reduce-overhead mode): a replay
    reads the addresses captured without looking the copy up again, so it could read a
    copy gone stale; the captured cast is made again at each replay instead."""
    capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
    copy = None if capturing else published_copy(weight, dtype)
    return copy if copy is not None else weight.to(dtype)


@published_cast.register_fake
def _(weight, dtype):
    return torch.empty_like(weight, dtype=dtype)
