"""Kernel launchers as torch.library custom ops, called without the dispatcher in eager mode."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def dispatcher_needed() -> bool:
    """torch.compile is tracing, or a dispatch mode (FlopCounterMode, FakeTensorMode, ...)
    must see the op."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def launcher(name: str) -> Callable[[Callable], Callable]:
    """Register fn as the custom op `fusedtrain::name` (opaque to torch.compile, visible to
    FlopCounterMode) and return a caller. In plain eager execution the caller runs fn
    directly: the custom-op dispatcher costs hundreds of microseconds of CPU a call
    (measured on the H200 host), which a training step pays dozens of times."""

    def decorate(fn: Callable) -> Callable:
        op = torch.library.custom_op(f"fusedtrain::{name}", mutates_args=())(fn)

        def call(*args):
            return op(*args) if dispatcher_needed() else fn(*args)

        call.register_fake = op.register_fake
        call.__name__ = call.__qualname__ = fn.__name__
        call.__doc__ = fn.__doc__
        return call

    return decorate
