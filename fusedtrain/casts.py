"""Grouped autocast casts of the weights the fused ops read.

Under autocast each op casts its fp32 weight and bias to the autocast dtype, one small
kernel per tensor per step, and autograd casts each gradient back with another: about 150
launches a GPT-2 step for the fused ops' parameters alone (docs/perf-notes.md, thirteenth
round). Inside `grouped_casts(*params)` those parameters are cast once, all together, by
one multi-tensor copy (one autograd node, whose backward turns all their gradients back
in another), and the fused ops' autocast step (`prepared_cast`) picks the copies up. The
values are the same bits either way: one rounding from fp32, and the exact widening back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

import torch

# id(parameter) -> its cast copy, for the grouped_casts block being run. Ids are unique
# among live objects, and the parameters outlive the block.
_PREPARED: ContextVar[MappingProxyType] = ContextVar("fusedtrain_casts",
                                                   default=MappingProxyType({}))


class _CastAll(torch.autograd.Function):
    """params -> copies in `dtype`; gradients back to each parameter's own dtype. One
    multi-tensor kernel (a few, for many bytes) each way, instead of one per tensor."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dtypes = [p.dtype for p in params]
        copies = [torch.empty_like(p, dtype=dtype) for p in params]
        torch._foreach_copy_(copies, list(params))
        return tuple(copies)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Separate tensors, not views of one buffer: autograd then hands each to its
        # parameter's .grad without another copy.
        widened = [torch.empty_like(g, dtype=d) for g, d in zip(grads, ctx.dtypes)]
        torch._foreach_copy_(widened, list(grads))
        return (None, *widened)


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype in force for t's device, or None."""
    dev = t.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


@contextmanager
def grouped_casts(*params: torch.Tensor | None) -> Iterator[None]:
    """Within the block, `params` (None entries skipped) are cast to the autocast dtype
    once, together. Does nothing outside autocast, under torch.compile (Inductor fuses
    the casts itself) and for parameters already in that dtype (FSDP's mixed precision).
    Frozen parameters keep their own casts: in the group their copies would need
    gradients, and the ops would compute them. Every parameter given must be read
    through `prepared_cast` in the block (a copy nobody reads would get no gradient)."""
    params = [p for p in params if p is not None]
    dtype = autocast_dtype(params[0]) if params else None
    grads = torch.is_grad_enabled()
    params = [p for p in params if p.is_floating_point() and p.dtype != dtype
              and (p.requires_grad or not grads)]
    if dtype is None or not params or torch.compiler.is_compiling():
        yield
        return
    copies = _CastAll.apply(dtype, *params)
    token = _PREPARED.set(MappingProxyType(
        {**_PREPARED.get(), **{id(p): c for p, c in zip(params, copies)}}))
    try:
        yield
    finally:
        _PREPARED.reset(token)


def _prepared_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """grouped_casts' copy of t in `dtype`, if the block being run holds one."""
    if torch.compiler.is_compiling():
        return None
    copy = _PREPARED.get().get(id(t))
    return copy if copy is not None and copy.dtype == dtype else None


def has_prepared_cast(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether grouped_casts holds a copy of t in `dtype` (prepared_cast would return it)."""
    return _prepared_copy(t, dtype) is not None


def prepared_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`: its grouped_casts copy when there is one, else t.to(dtype)."""
    copy = _prepared_copy(t, dtype)
    return copy if copy is not None else t.to(dtype)
