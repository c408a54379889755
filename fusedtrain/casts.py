"""Autocast casts of the weights the fused ops read: inside the ops, grouped per block.

Under autocast F.linear casts its fp32 weight and bias to the autocast dtype, one small
kernel per tensor per step, and autograd casts each gradient back with another. The fused
ops instead take their parameters in their own dtype and cast them inside their
autograd.Function (`cast_params`), whose backward returns the gradients in the
parameters' dtype straight from its GEMMs and column sums (fp32 accumulators written as
fp32: no bf16 gradient rounded, then widened by a second pass). Inside
`grouped_casts(*params)` the casts themselves are made once, all together, by one
multi-tensor copy (about 150 launches a GPT-2 step otherwise), and `cast_params` picks
the copies up. The forward values are the same bits either way: one rounding from fp32.

A copy that fusedtrain.optim.AdamW wrote in its own pass stands in for the cast while its
parameter is unchanged (fusedtrain.weight_copies, the channel between the two), under
torch.compile too (through the op `fusedtrain::published_cast`, which asks at run time).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

import torch

from fusedtrain.weight_copies import WEIGHT_COPIES

# id(parameter) -> its cast copy, for the grouped_casts block being run. Ids are unique
# among live objects, and the parameters outlive the block.
_PREPARED: ContextVar[MappingProxyType] = ContextVar("fusedtrain_casts",
                                                   default=MappingProxyType({}))


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype in force for t's device, or None."""
    dev = t.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


@contextmanager
def grouped_casts(*params: torch.Tensor | None) -> Iterator[None]:
    """Within the block, `params` (None entries skipped) are cast to the autocast dtype
    once, together, for `cast_params` to return (blocks nest: an inner block casts only
    what the outer ones did not). The copies carry no autograd history:
    only an op that returns the parameter's gradient itself may read them, as the fused
    ops do. Does nothing outside autocast, under torch.compile (Inductor fuses the casts
    itself) and for parameters already in that dtype (FSDP's mixed precision)."""
    params = [p for p in params if p is not None]
    dtype = None if not params or torch.compiler.is_compiling() else autocast_dtype(params[0])
    if dtype is not None:
        params = [p for p in params if p.is_floating_point() and p.dtype != dtype
                  and _prepared_copy(p, dtype) is None]  # not cast by an enclosing block
    if dtype is None or not params:
        yield
        return
    with torch.no_grad():
        copies = [torch.empty_like(p, dtype=dtype) for p in params]
        torch._foreach_copy_(copies, params)
    token = _PREPARED.set(MappingProxyType(
        {**_PREPARED.get(), **{id(p): c for p, c in zip(params, copies)}}))
    try:
        yield
    finally:
        _PREPARED.reset(token)


def _prepared_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """grouped_casts' copy of t in `dtype`, if the block being run holds one, else a
    published one still fresh. Not for code that torch.compile traces (see _cast)."""
    copy = _PREPARED.get().get(id(t))
    if copy is not None and copy.dtype == dtype:
        return copy
    return WEIGHT_COPIES.fresh(t, dtype)


def cast_params(dtype: torch.dtype | None,
                *params: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """params in `dtype` (None: unchanged), each from grouped_casts' copy when there is one,
    else cast here. For an autograd.Function's forward: the copies carry no gradient, so
    the Function must return each parameter's gradient itself, in its own dtype."""
    if dtype is None:
        return params
    return tuple(None if p is None else _cast(p, dtype) for p in params)


def _cast(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # Traced: whether a published copy is fresh is known only when the compiled code
        # runs, so the lookup goes into an op the compiler leaves as it is. Imported here:
        # fusedtrain.ops, whose ops are the only callers, imports this module.
        from fusedtrain.ops.published_cast import published_cast

        return p if p.dtype == dtype else published_cast(p, dtype)
    copy = _prepared_copy(p, dtype)
    return copy if copy is not None else p.to(dtype)
