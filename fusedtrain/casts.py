"""Autocast casts of the weights the fused ops read: inside the ops, grouped per block.

Under autocast F.linear casts its fp32 weight and bias to the autocast dtype, one small
kernel per tensor per step, and autograd casts each gradient back with another. The fused
ops instead take their parameters in their own dtype and cast them inside their
autograd.Function (`cast_params`), whose backward returns the gradients in the
parameters' dtype straight from its GEMMs and column sums (fp32 accumulators written as
fp32: no bf16 gradient rounded, then widened by a second pass). Inside
`grouped_casts(*params)` the casts themselves are made once, all together, by one
multi-tensor copy (thirteenth round of docs/perf-notes.md: about 150 launches a GPT-2 step
otherwise), and `cast_params` picks the copies up. The forward values are the same bits
either way: one rounding from fp32.

An optimizer that writes such copies in its own pass (fusedtrain.optim.AdamW) publishes
them (`publish_copies`); a published copy stands in for the cast as long as its parameter
is unchanged since (same storage, same version counter), under torch.compile too (through
the op `fusedtrain::published_cast`, which looks it up at run time).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

import torch

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


# id(parameter) -> (weak reference to it, copy, its version and address when published).
_PUBLISHED: dict[int, tuple[weakref.ref, torch.Tensor, int, int]] = {}


def publish_copies(params: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
    """copies[i] holds params[i] cast to copies[i].dtype, as of now."""
    for p, c in zip(params, copies):
        key = id(p)  # the entry goes with its parameter
        entry = _PUBLISHED.get(key)
        if entry is not None and entry[0]() is p:  # republished each step: keep its ref
            ref = entry[0]
        else:
            ref = weakref.ref(p, lambda _, key=key: _PUBLISHED.pop(key, None))
        _PUBLISHED[key] = (ref, c, p._version, p.data_ptr())


def published_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The copy published for t, or for the parameter that t views whole (an
    autograd.Function's output that is its input returned, as the tied head's weight from
    ops.gpt_embedding), while still fresh."""
    param = t._base if t._is_view() and _views_whole(t, t._base) else t
    entry = _PUBLISHED.get(id(param))
    if entry is None:
        return None
    ref, copy, version, address = entry
    # A view shares its base's version counter: writes through either are seen.
    fresh = (ref() is param and copy.dtype == dtype and t._version == version
             and t.data_ptr() == address)
    return copy if fresh else None


def _views_whole(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `view` is all of `base` as it is laid out: same elements, same order."""
    return (view.dtype == base.dtype and view.shape == base.shape
            and view.stride() == base.stride()
            and view.storage_offset() == base.storage_offset())


def _prepared_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """grouped_casts' copy of t in `dtype`, if the block being run holds one, else a
    published one still fresh. Not for code that torch.compile traces (see _cast)."""
    copy = _PREPARED.get().get(id(t))
    if copy is not None and copy.dtype == dtype:
        return copy
    return published_copy(t, dtype)


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
        # runs, so the lookup goes into an op the compiler leaves as it is (registered by
        # fusedtrain.ops, whose ops are the only callers here).
        return p if p.dtype == dtype else torch.ops.fusedtrain.published_cast(p, dtype)
    copy = _prepared_copy(p, dtype)
    return copy if copy is not None else p.to(dtype)
