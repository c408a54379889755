"""Kernel launchers as torch.library ops, called without the dispatcher in eager mode."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._launch import traced_launches
from fusedtrain.ops._replay import Replayed

log = logging.getLogger("fusedtrain")


def dispatcher_needed() -> bool:
    """torch.compile is tracing, or a dispatch mode (FlopCounterMode, FakeTensorMode, ...)
    must see the op (the replay recorder, which records the launchers' own work, need not)."""
    if torch.compiler.is_compiling():
        return True
    mode = _get_current_dispatch_mode()
    return mode is not None and not getattr(mode, "transparent", False)


def runs_directly(t: torch.Tensor) -> bool:
    """Whether a launcher given t as its first tensor calls its kernels itself: not while
    the dispatcher is needed, and not on meta tensors (shape inference, deferred init),
    which have no data for a kernel and go to the op's fake implementation instead."""
    return not (dispatcher_needed() or t.is_meta)


def backward_wanted(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will call the op's backward: grad mode on and some input needing
    a gradient. Otherwise what only backward reads (saved pre-activations, statistics)
    need not be written."""
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


_C_APPLY = torch._C._FunctionBase.__dict__["apply"]


def _first_order_only(fn: type[torch.autograd.Function]) -> None:
    """Make fn's backward refuse to be differentiated. Its kernels build no autograd graph,
    so the gradients of a backward run with create_graph=True carry none: differentiated
    again (a gradient penalty, a Hessian-vector product), they would silently leave out
    every term through this op. When create_graph=True and anything the backward read
    needs a gradient, its gradients come back behind an error node (as torch's
    once_differentiable does, which looks at the incoming gradients only): using them in
    a further backward raises, naming the op."""
    backward = fn.backward
    message = (f"fusedtrain: {fn.__name__}'s backward is not differentiable; a gradient "
               "taken through it with create_graph=True was differentiated again. For "
               "higher-order gradients use the eager ops (fusedtrain.eager, or fused=false)")

    @functools.wraps(backward)
    def first_order(ctx, *grads):
        out = backward(ctx, *grads)
        if (not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or torch._C._are_functorch_transforms_active()
                or _get_current_dispatch_mode() is not None):
            return out
        read = (*grads, *ctx.saved_tensors)
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in read):
            return out
        outs = out if isinstance(out, tuple) else (out,)
        guarded = torch._C._functions.DelayedError(message.encode(), len(outs))(
            *[t.detach().requires_grad_() if isinstance(t, torch.Tensor) else t
              for t in outs])
        guarded = guarded if isinstance(guarded, tuple) else (guarded,)
        return guarded if isinstance(out, tuple) else guarded[0]

    fn.backward = staticmethod(first_order)


def function_apply(fn: type[torch.autograd.Function], derived: tuple[int, ...] = ()
                   ) -> Callable:
    """fn.apply, in plain eager execution replayed from one C++ autograd node per call
    signature recorded (ops/_replay.py), else without autograd.Function.apply's Python
    layer: 5 us of host time a call on the lent H200 host, 13.4 against 18.3 (binding
    defaults for setup_context, which these Functions do not define, and unwrapping
    tensors that escaped a functorch transform after it ended; such a tensor then fails
    the kernels' data_ptr read with torch's own error). Under torch.compile and inside
    functorch transforms, fn.apply; under a dispatch mode or while another op is being
    recorded, the Python Function.

    `derived`: the positions of arguments that are functions of the rest of a replay's
    key (dtypes, devices, requires_grad, grad mode, autocast), such as an output dtype:
    left out of the key, so that `hit` need not compute them (None there)."""
    _first_order_only(fn)
    direct = _C_APPLY.__get__(None, fn)
    replayed = Replayed(fn, direct, derived)

    def apply(*args):
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return fn.apply(*args)
        if _get_current_dispatch_mode() is not None:
            return direct(*args)
        return replayed(args)

    def hit(*args):
        """apply(*args) where plain eager execution replays a recorded signature, else
        None. A public op may call this before validating its arguments: a signature is
        recorded only from a call that passed them (the key holds every property its
        checks read: dtypes, devices, shapes, scalar values, autocast)."""
        if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
                or _get_current_dispatch_mode() is not None):
            return None
        return replayed.hit(args)

    apply.hit = hit
    return apply


_OP_NAMES: list[str] = []  # every fusedtrain:: op, in registration order
TRACEABLE: list[str] = []  # those registered with traceable=True


def register_inductor_fallbacks() -> None:
    """Give torch.compile's Inductor an explicit fallback for every fusedtrain:: op, with
    the layout rule (the op's tag, or Inductor's default) its implicit fallback would use.
    Call before compiling a model that uses the ops; repeated calls are free.

    Why: for an op it has no lowering for, Inductor (torch 2.11, the GPU image's) formats
    the op and its whole input IR into a log message before creating the implicit
    fallback, at any log level; in a 12-layer GPT that IR is deep and the formatting
    recursive: compiling the fused gpt2 step took over 300 s on an H200 host, the main
    thread inside ir.py's __str__ (docs/journal.md)."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    for name in _OP_NAMES:
        op = getattr(torch.ops.fusedtrain, name).default
        if op not in lowering.lowerings:
            tag = get_layout_constraint_tag(op, with_default=True)
            lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag))


# Whether torch.compile traces the traceable launchers' bodies, so that their Triton
# launches appear in Inductor's generated code, or keeps every op opaque (a call through
# the dispatcher into the launcher's Python: a compiled LayerNorm forward and a multiply
# at 64 x 768 cost 172.7 us of host time on the lent H200 host; docs/journal.md). Set by
# trace_kernels; off until timed on a GPU.
_TRACE_KERNELS = False
_TRACED_LOGGED: set[str] = set()
# Settings trace_kernels holds while on, each restored when it goes off. AOTAutograd's cache
# keys on Dynamo's graph, which is the same either way: it would hand back the other
# choice's compilation. Inductor types a user kernel's Python float arguments as fp64
# where Triton's own launcher, which the kernels are written for, types them as fp32: on
# the H200 (torch 2.11) the attention forward's fp32 accumulator became fp64 in its loop
# and did not compile.
_TRACING_CONFIG = (("torch._functorch.config", "enable_autograd_cache", False),
                   ("torch._inductor.config", "_use_fp64_for_unbacked_floats", False))
_CONFIG_BEFORE: dict[tuple[str, str], object] = {}


def trace_kernels(enabled: bool = True) -> None:
    """Let torch.compile (AOTAutograd's functionalization) trace the launchers registered
    with traceable=True into their Triton launches (`torch.library.wrap_triton`, as
    torch.library.triton_op does), or keep them opaque (the default). Takes effect at the
    next compilation (a function Dynamo already compiled keeps its choice until
    torch._dynamo.reset()). Triton's interpreter cannot be traced: wrap_triton hands an
    interpreted kernel back to be called, and it cannot read a traced tensor."""
    global _TRACE_KERNELS
    if enabled and INTERPRET:
        raise RuntimeError("trace_kernels: Triton's interpreter (no CUDA device) cannot be "
                           "traced into a compiled graph; the ops stay opaque there")
    if bool(enabled) == _TRACE_KERNELS:
        return
    for module_name, name, value in _TRACING_CONFIG:
        module = importlib.import_module(module_name)
        if not hasattr(module, name):  # a torch without the setting
            continue
        if enabled:
            _CONFIG_BEFORE[module_name, name] = getattr(module, name)
            setattr(module, name, value)
        else:
            setattr(module, name, _CONFIG_BEFORE.pop((module_name, name)))
    _TRACE_KERNELS = bool(enabled)
    log.info("torch.compile %s the fusedtrain launchers' Triton kernels",
             "traces into" if enabled else "keeps opaque")


def _traced_rule(name: str, fn: Callable) -> Callable:
    """The launcher's FunctionalTensorMode rule: under trace_kernels, its body run on the
    traced tensors (each launch recorded by wrap_triton), else the op as one node."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    known = (torch.Tensor, FakeTensor, FunctionalTensor)

    def rule(mode, op, types, args, kwargs):
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if not _TRACE_KERNELS or custom_triton_ops_decomposition_disabled():
            return mode.__torch_dispatch__(op, types, args, kwargs)
        if any(t not in known for t in types):
            return NotImplemented
        if name not in _TRACED_LOGGED:
            _TRACED_LOGGED.add(name)
            log.info("torch.compile: fusedtrain::%s traced into its Triton launches", name)
        with mode, traced_launches():
            return fn(*args, **kwargs)

    return rule


# The ops' library. Defined through it rather than torch.library.custom_op: a compiled
# graph calls each op through the dispatcher, and custom_op's Python layers around the
# kernel (an autograd wrapper that redispatches, Dynamo's disable guard, an aliasing check
# of the outputs) cost ~4x the bare dispatch a call, on a path a training step takes
# about 190 times.
_LIB = torch.library.Library("fusedtrain", "DEF")


def launcher(name: str, mutates: tuple[str, ...] = (),
             traceable: bool = False) -> Callable[[Callable], Callable]:
    """Register fn as the op `fusedtrain::name` (schema from its type hints; opaque to
    torch.compile unless traceable and trace_kernels is on, visible to FlopCounterMode; no
    autograd formula: the public ops' autograd Functions call it) and return a caller;
    fn's first argument must be a tensor and its outputs new tensors; it writes in place
    only the arguments named in `mutates`. In plain eager execution on real tensors the
    caller runs fn directly: even the bare dispatcher costs microseconds of CPU a call,
    which a training step pays dozens of times.
    traceable: fn runs on FunctionalTensors too (addresses read through _launch.address,
    every launch through FastLaunch, which records it there), so torch.compile may trace
    it."""

    def decorate(fn: Callable) -> Callable:
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates))
        for dispatch_key in ("CPU", "CUDA"):
            _LIB.impl(name, fn, dispatch_key)
        if traceable:
            from torch._subclasses.functional_tensor import FunctionalTensorMode

            torch.library.register_torch_dispatch(f"fusedtrain::{name}", FunctionalTensorMode,
                                                  _traced_rule(name, fn), lib=_LIB)
            TRACEABLE.append(name)
        op = getattr(torch.ops.fusedtrain, name).default
        _OP_NAMES.append(name)

        def call(*args):
            return fn(*args) if runs_directly(args[0]) else op(*args)

        def register_fake(fake: Callable) -> Callable:
            return torch.library.register_fake(f"fusedtrain::{name}", fake, lib=_LIB)

        call.register_fake = register_fake
        call.__name__ = call.__qualname__ = fn.__name__
        call.op_name = name
        call.__doc__ = fn.__doc__
        return call

    return decorate
