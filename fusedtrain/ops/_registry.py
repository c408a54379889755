"""Kernel launchers as torch.library custom ops, called without the dispatcher in eager mode."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def dispatcher_needed() -> bool:
    """torch.compile is tracing, or a dispatch mode (FlopCounterMode, FakeTensorMode, ...)
    must see the op."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def runs_directly(t: torch.Tensor) -> bool:
    """Whether a launcher given t as its first tensor calls its kernels itself: not while
    the dispatcher is needed, and not on meta tensors (shape inference, deferred init),
    which have no data for a kernel and go to the op's fake implementation instead."""
    return not (dispatcher_needed() or t.is_meta)


def backward_wanted(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will call the op's backward: grad mode on and some input needing
    a gradient. Otherwise what only backward reads (saved pre-activations, statistics)
    need not be written."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_OP_NAMES: list[str] = []  # every fusedtrain:: op, in registration order


def register_inductor_fallbacks() -> None:
    """Give torch.compile's Inductor an explicit fallback for every fusedtrain:: op, with
    the layout rule (the op's tag, or Inductor's default) its implicit fallback would use.
    Call before compiling a model that uses the ops; repeated calls are free.

    Why: for an op it has no lowering for, Inductor (torch 2.11, the GPU image's) formats
    the op and its whole input IR into a log message before creating the implicit
    fallback, at any log level; in a 12-layer GPT that IR is deep and the formatting
    recursive: compiling the fused gpt2 step took over 300 s on an H200 host, the main
    thread inside ir.py's __str__ (docs/perf-notes.md, eighth round)."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    for name in _OP_NAMES:
        op = getattr(torch.ops.fusedtrain, name).default
        if op not in lowering.lowerings:
            tag = get_layout_constraint_tag(op, with_default=True)
            lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag))


def launcher(name: str) -> Callable[[Callable], Callable]:
    """Register fn as the custom op `fusedtrain::name` (opaque to torch.compile, visible to
    FlopCounterMode) and return a caller; fn's first argument must be a tensor. In plain
    eager execution on real tensors the caller runs fn directly: the custom-op dispatcher
    costs hundreds of microseconds of CPU a call (measured on the H200 host), which a
    training step pays dozens of times."""

    def decorate(fn: Callable) -> Callable:
        op = torch.library.custom_op(f"fusedtrain::{name}", mutates_args=())(fn)
        _OP_NAMES.append(name)

        def call(*args):
            return fn(*args) if runs_directly(args[0]) else op(*args)

        call.register_fake = op.register_fake
        call.__name__ = call.__qualname__ = fn.__name__
        call.__doc__ = fn.__doc__
        return call

    return decorate
