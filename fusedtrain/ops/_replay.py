"""Records an op's work once per call signature so that later calls replay it in C++.

A public op's autograd.Function costs host time in Python on every call: its checks, its
launchers' allocations and plan lookups, the Function's own apply and, in backward,
autograd's hand-over of a Python node to its device thread. `Replayed(fn)` runs the
Function once per call signature (the arguments' dtypes, devices, shapes, strides,
16-byte alignment, requires_grad and aliasing, the other arguments' values, grad mode,
autocast and deterministic mode) under a recorder, which writes down what its forward
did: the tensors it allocated, the views it took, every other ATen op (a cuBLAS GEMM, a
fill, a cast: a boxed call with its tensors as slots), each kernel launch (the compiled
kernel's function, grid, block, shared memory, and every argument as a slot or a value).
Later calls with that signature go to fusedtrain/csrc/replay.cpp, which allocates,
calls, launches and builds one C++ autograd node (native.py). Its backward is recorded
the same way on its first call per gradient layout, from the Function's own backward run
with a stand-in ctx, and then replayed without the GIL.

A call is recorded only if every kernel in it is launched through `fast_launch` with the
layout triton 3.6's launcher gives it (no profiling scratch, no host-side tensor
descriptor, one CTA per program, no cooperative or PDL launch) and no ATen op in it reads
a value back to the host or makes outputs of data-dependent shape; anything else (or a
kernel triton is still compiling or tuning: retried) leaves the signature to the Python
Function, logged once with the reason. Under triton's interpreter the launches are
recorded as Python calls of the kernel, so the CPU tests run the same records. The ctx
attributes a backward reads must follow from the signature (a Function that stores a
tensor there is left to Python).
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusedtrain import native
from fusedtrain.kernels import INTERPRET, _launch

log = logging.getLogger("fusedtrain")

# Signatures kept per op: a model has a handful; past this, calls run the Python Function.
LIMIT = 256

_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
                torch.ops.aten.empty_like.default}
# ATen ops that return no tensor but read one's data (and wait for the device).
_DATA_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
               torch.ops.aten.is_nonzero.default}


# Ops whose outputs' shapes or values the host cannot know without the data (nonzero,
# unique, item): a record of them would fix what should vary.
_DATA_TAGS = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
_LAYOUTS = {torch.strided: 0, torch.sparse_coo: 1}
_MEMORY_FORMATS = {torch.contiguous_format: 0, torch.preserve_format: 1,
                   torch.channels_last: 2, torch.channels_last_3d: 3}


def _has_tensor(out) -> bool:
    if isinstance(out, (tuple, list)):
        return any(_has_tensor(o) for o in out)
    return isinstance(out, torch.Tensor)


# Triton 3.6 signature type -> replay.cpp's argument kind.
_SCALARS = {"i1": 2, "i32": 2, "i64": 3, "fp16": 4, "bf16": 4, "fp32": 4, "f32": 4, "fp64": 5,
            "u1": 6, "u32": 6, "u64": 7, "i8": 8, "i16": 9, "u8": 10, "u16": 11}
_PTR, _NULL = 0, 1


class NotRecordableError(Exception):
    """This call cannot be recorded; `final`: nor can any call of its signature."""

    def __init__(self, reason: str, final: bool = True):
        super().__init__(reason)
        self.final = final


class Recorder(TorchDispatchMode):
    """While active: every ATen op and fast_launch launch is written down as a step over
    slots (the inputs, then each allocation or view, in order)."""

    transparent = True  # the op registry calls launchers directly under this mode

    def __init__(self, inputs: list[torch.Tensor | None]):
        super().__init__()
        self.slots: list[torch.Tensor | None] = list(inputs)
        self.ids = {id(t): i for i, t in enumerate(inputs) if t is not None}
        self.steps: list[tuple] = []
        self.failure: NotRecordableError | None = None
        self.general = 0  # launches made through triton's own path (JITFunction.run)
        self.recorded_general = 0  # of those, recorded ones (the interpreter's)
        self.pause = False

    def fail(self, reason: str, final: bool = True) -> None:
        if self.failure is None or (final and not self.failure.final):
            self.failure = NotRecordableError(reason, final)

    def slot(self, t: torch.Tensor) -> int:
        i = self.ids.get(id(t))
        if i is None and getattr(t, _launch.CONSTANT, False):
            self._add(t, ("const", t))
            return len(self.slots) - 1
        if i is None:
            raise NotRecordableError("a tensor that came from neither an input nor a recorded op")
        return i

    def _add(self, t: torch.Tensor, step: tuple) -> None:
        self.ids[id(t)] = len(self.slots)
        self.slots.append(t)
        self.steps.append(step)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within: ATen ops are not recorded (those of a launch triton makes itself)."""
        before, self.pause = self.pause, True
        try:
            yield
        finally:
            self.pause = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.pause or (self.failure is not None and self.failure.final):
            return out
        try:
            if func in _ALLOCATIONS:
                self._add(out, ("alloc", tuple(out.shape), out.stride(), _dtype_code(out.dtype),
                                out.device.index if out.is_cuda else -1))
            elif func.is_view and isinstance(args[0], torch.Tensor):
                base = args[0]
                i = self.slot(base)
                for view in out if isinstance(out, (tuple, list)) else (out,):
                    if view.dtype != base.dtype:
                        raise NotRecordableError(f"{func} reinterprets a dtype")
                    self._add(view, ("view", i, tuple(view.shape), view.stride(),
                                     view.storage_offset() - base.storage_offset()))
            elif not _has_tensor(out):
                if func in _DATA_READS:
                    raise NotRecordableError(f"{func} reads a tensor's value on the host")
                # else a query of metadata (promote_types, ...): no device work
            elif _DATA_TAGS.intersection(func.tags):
                raise NotRecordableError(f"{func}'s outputs depend on its inputs' values")
            else:
                self._aten(func, args, kwargs or {}, out)
        except NotRecordableError as e:
            self.fail(str(e), e.final)
        return out

    def _aten(self, func, args: tuple, kwargs: dict, out) -> None:
        """An ATen op as a boxed call: its arguments in schema order (defaults filled in),
        tensors by slot; each returned tensor a new slot, or the argument it returns."""
        schema = func._schema
        encoded = []
        for i, a in enumerate(schema.arguments):
            if not a.kwarg_only and i < len(args):
                v = args[i]
            elif a.name in kwargs:
                v = kwargs[a.name]
            elif a.has_default_value():
                v = a.default_value
            else:
                raise NotRecordableError(f"{func}: argument {a.name} not given")
            if isinstance(v, (bool, int, float)) and str(a.type) == "Tensor":
                encoded.append(("wn", v))  # x * 2: the Python number as a wrapped tensor
            else:
                encoded.append(self._encode(v, func))
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        flags = []
        for t in outs:
            if not isinstance(t, torch.Tensor):
                raise NotRecordableError(f"{func} returns a {type(t).__name__}")
            new = id(t) not in self.ids
            flags.append(int(new))
            if new:
                self.ids[id(t)] = len(self.slots)
                self.slots.append(t)
        self.steps.append(("aten", schema.name, schema.overload_name, tuple(encoded),
                           tuple(flags)))

    def _encode(self, v, func) -> tuple:
        if isinstance(v, torch.Tensor):
            return ("t", self.slot(v))
        if v is None:
            return ("n",)
        if isinstance(v, bool):
            return ("b", v)
        if isinstance(v, int):
            return ("i", v)
        if isinstance(v, float):
            return ("f", v)
        if isinstance(v, str):
            return ("s", v)
        if isinstance(v, torch.dtype):
            return ("dtype", _dtype_code(v))
        if isinstance(v, torch.device):
            return ("device", v.type, -1 if v.index is None else v.index)
        if isinstance(v, torch.layout):
            return ("layout", _LAYOUTS[v])
        if isinstance(v, torch.memory_format):
            return ("mf", _MEMORY_FORMATS[v])
        if isinstance(v, (tuple, list)):
            if all(isinstance(x, torch.Tensor) for x in v) and v:
                return ("tl", tuple(self.slot(x) for x in v))
            if any(isinstance(x, torch.Tensor) for x in v):
                return ("otl", tuple(-1 if x is None else self.slot(x) for x in v))
            if all(isinstance(x, bool) for x in v) and v:
                return ("bl", tuple(v))
            if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                return ("il", tuple(v))
            if all(isinstance(x, (int, float)) for x in v):
                return ("fl", tuple(float(x) for x in v))
        raise NotRecordableError(f"{func}: an argument of type {type(v).__name__}")

    # fast_launch (kernels/_launch.py) reports each launch here.
    def cuda_launch(self, kernel, grid, args: tuple, tail: tuple) -> None:
        try:
            self.steps.append(_cuda_step(self, kernel, grid, args, tail))
        except NotRecordableError as e:
            self.fail(str(e), e.final)

    def python_launch(self, fn, grid, args: tuple, kwargs: dict) -> None:
        """A launch through triton's own path: recorded under the interpreter, else the
        call is not recordable this time (triton compiles or tunes it)."""
        if not INTERPRET:
            self.fail("triton is compiling or tuning a kernel of it", final=False)
            return
        try:
            positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            slots = tuple(self.slot(args[i]) for i in positions)
        except NotRecordableError as e:
            self.fail(str(e), e.final)
            return
        self.recorded_general += 1
        template = list(args)

        def launch(tensors: list[torch.Tensor]) -> None:
            call = list(template)
            for i, t in zip(positions, tensors):
                call[i] = t
            fn[grid](*call, **kwargs)

        self.steps.append(("python", launch, slots))

    def program(self, outputs) -> tuple:
        """(steps, output slots) of what was recorded, or raise NotRecordableError."""
        if self.failure is not None:
            raise self.failure
        if self.general != self.recorded_general:
            raise NotRecordableError("a kernel launched outside fast_launch, or a tuning run",
                             final=False)
        return tuple(self.steps), tuple(-1 if t is None else self.slot(t) for t in outputs)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES[dtype]


# torch.dtype -> c10::ScalarType's value, which replay.cpp allocates with.
_DTYPE_CODES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
                torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.complex64: 9,
                torch.complex128: 10, torch.bool: 11, torch.bfloat16: 15}


def _cuda_step(rec: Recorder, kernel, grid, args: tuple, tail: tuple) -> tuple:
    """("cuda", function, grid, block, shared, args, scratch) for a compiled kernel
    launched as triton 3.6's C launcher does: every non-constexpr argument in signature
    order, then its global and profile scratch pointers; `scratch`: the global scratch
    bytes per program (the device-side TMA descriptors' memory), allocated per launch."""
    run = kernel.run
    if not _launch.DIRECT_LAUNCH or not hasattr(run, "launch"):
        raise NotRecordableError("a launcher laid out other than triton 3.6's")
    if getattr(run, "profile_scratch_size", 1):
        raise NotRecordableError("a kernel instrumented for profiling")
    meta = kernel.packed_metadata  # (num_warps, num_ctas, shared memory) in triton 3.6
    if run.launch_cooperative_grid or run.launch_pdl or meta[1] != 1:
        raise NotRecordableError("a cooperative, PDL or multi-CTA launch")
    signature = list(getattr(getattr(kernel, "src", None), "signature", {}).values())
    values = list(args) + list(tail)
    if len(signature) != len(values):
        raise NotRecordableError("a kernel whose signature does not match its arguments")
    out = []
    for ty, v in zip(signature, values):
        if ty == "constexpr":
            continue
        if isinstance(ty, str) and ty.startswith("*"):
            if v is None:
                out.append((_NULL, -1, 0, 0.0))
            elif isinstance(v, torch.Tensor):
                out.append((_PTR, rec.slot(v), 0, 0.0))
            else:
                raise NotRecordableError("a pointer argument passed as an address")
        elif ty in _SCALARS:
            kind = _SCALARS[ty]
            out.append((kind, -1, 0, float(v)) if kind in (4, 5) else (kind, -1, int(v), 0.0))
        else:
            raise NotRecordableError(f"an argument of type {ty}")
    g = _launch._grid3(grid)
    return ("cuda", kernel.function, g, 32 * meta[0], meta[2], tuple(out),
            run.global_scratch_size)


class _StandInCtx:
    """What a Function's backward reads from its ctx, for a replayed forward's backward."""

    def __init__(self, attrs: dict, saved: tuple, needs_input_grad: tuple):
        self.__dict__.update(attrs)
        self.saved_tensors = saved
        self.needs_input_grad = needs_input_grad


def _plain(v: Any) -> bool:
    """Whether v is a value that a signature determines (no tensor in it)."""
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(x) for x in v.values())
    return v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device,
                                       torch.Size))


def _count_general_launches(rec: Recorder):
    """Patch triton's own launch paths to count into rec while it records (one recorder
    at a time: records are made under the GIL, on first calls only)."""
    from triton.runtime import interpreter, jit

    classes = [jit.JITFunction, interpreter.InterpretedFunction]
    originals = [(cls, cls.run) for cls in classes]

    def counting(run):
        def wrapped(self, *args, **kwargs):
            rec.general += 1
            return run(self, *args, **kwargs)
        return wrapped

    for cls, run in originals:
        cls.run = counting(run)
    return originals


class _Recording:
    """Within: rec receives every ATen op and launch (its mode, the launch hook, the
    count of triton's own launches)."""

    def __init__(self, rec: Recorder):
        self.rec = rec

    def __enter__(self) -> Recorder:
        self.before = _launch.recorder(self.rec)
        self.patched = _count_general_launches(self.rec)
        self.rec.__enter__()
        return self.rec

    def __exit__(self, *exc) -> None:
        self.rec.__exit__(*exc)
        for cls, run in self.patched:
            cls.run = run
        _launch.recorder(self.before)


_ON = True
# Function name -> backward calls of replayed nodes that went to its Python backward (the
# call that records a gradient layout, every call of one left to Python, every call with
# create_graph=True): a replayed op's count stays put once its backward is recorded
# (`bench.py host` reports it per op).
python_backwards: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within: every op runs its Python Function (the host benchmark's baseline)."""
    global _ON
    before, _ON = _ON, False
    try:
        yield
    finally:
        _ON = before


class Replayed:
    """fn's apply (fn: an autograd.Function of fusedtrain.ops), replayed from C++ for
    each call signature recorded; `direct` is fn's C apply."""

    def __init__(self, fn: type[torch.autograd.Function], direct: Callable,
                 derived: tuple[int, ...] = ()):
        self.fn, self.direct, self.derived = fn, direct, frozenset(derived)
        self.index: int | None = None  # the op in replay.cpp, on the first call
        self._logged: set[str] = set()
        self._recording_apply()

    def _recording_apply(self) -> None:
        """fn with a forward that records itself, for a signature's first call; records
        are of the code (fn.forward, fn.backward) as it is now."""
        fn, state = self.fn, self
        forward = fn.forward
        self._code = (fn.forward, fn.backward)

        def recorded_forward(ctx, *args):
            rec = state._active
            with _Recording(rec):
                out = forward(ctx, *args)
            state._saved = getattr(ctx, "to_save", None) or ()
            state._attrs = dict(vars(ctx))
            state._raw = out
            return out

        self._recording = torch._C._FunctionBase.__dict__["apply"].__get__(
            None, type(fn.__name__, (fn,), {"forward": staticmethod(recorded_forward),
                                            "__module__": fn.__module__}))
        self._active: Recorder | None = None

    def _ready(self):
        """replay.cpp's module where this call may go through it, else None: no native
        module, replay off, or inside another op's forward (recorded there). Code replaced
        since the records (a test's monkeypatch) drops them."""
        if self.index is None:
            module = native.load()
            self.index = -1 if module is None else module.new_op(self._backward, LIMIT)
            self._native = module
        if self.index < 0 or not _ON or _launch._RECORDER is not None:
            return None
        if self.fn.forward is not self._code[0] or self.fn.backward is not self._code[1]:
            self._native.reset(self.index)
            self._recording_apply()
        return self._native

    def __call__(self, args: tuple):
        native_ops = self._ready()
        if native_ops is None:
            return self.direct(*args)
        key = (tuple(None if i in self.derived else a for i, a in enumerate(args))
               if self.derived else args)
        out = native_ops.apply(self.index, key)
        if out is None:
            return self._record(args, key)
        return self.direct(*args) if out is NotImplemented else out

    def hit(self, args: tuple):
        """The replayed outputs where args' signature is recorded and replayable, else
        None; never records. args hold None at the derived positions."""
        native_ops = self._ready()
        out = None if native_ops is None else native_ops.apply(self.index, args)
        return None if out is None or out is NotImplemented else out

    def _record(self, args: tuple, key: tuple):
        """Run fn on args, recording it; its record is stored under `key`'s signature."""
        inputs = [a if isinstance(a, torch.Tensor) else None for a in args]
        self._active = Recorder(inputs)
        self._saved, self._attrs, self._raw = (), {}, None
        try:
            out = self._recording(*args)
            raw = self._raw
            outputs = raw if isinstance(raw, tuple) else (raw,)
            try:
                record = self._active.program(outputs)
                saved = tuple(-1 if t is None else self._active.slot(t) for t in self._saved)
                if not _plain(self._attrs):
                    raise NotRecordableError("its ctx holds a tensor")
                needs = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                self._native.store(self.index, key, (record, saved), False,
                                   (self.fn, self._attrs, needs), isinstance(raw, torch.Tensor))
                self._log("forward", args, None)
            except NotRecordableError as e:
                self._native.store(self.index, key, None, e.final, None, False)
                self._log("forward", args, e)
        finally:
            self._active, self._raw, self._saved = None, None, ()
        return out

    def _backward(self, attrs: tuple, saved: list, grads: list, record: bool):
        """(gradients, record or None, final): the Function's backward on a stand-in ctx,
        recorded if `record`; called from replay.cpp with the GIL taken."""
        fn, ctx_attrs, needs = attrs
        python_backwards[fn.__name__] += 1
        ctx = _StandInCtx(ctx_attrs, tuple(saved), needs)
        if not record:
            return list(fn.backward(ctx, *grads)), None, True
        rec = Recorder([*saved, *grads])
        with _Recording(rec):
            out = fn.backward(ctx, *grads)
        out = out if isinstance(out, tuple) else (out,)
        try:
            program = rec.program(out)
        except NotRecordableError as e:
            self._log("backward", grads, e)
            return list(out), None, e.final
        self._log("backward", grads, None)
        return list(out), program, True

    def _log(self, what: str, tensors, failure: NotRecordableError | None) -> None:
        shapes = tuple(tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor))
        reason = "recorded, replayed from C++ from its next call" if failure is None else (
            f"left to Python ({failure}){'' if failure.final else ', retried'}")
        line = f"{self.fn.__name__} {what} {shapes}: {reason}"
        if line not in self._logged:
            self._logged.add(line)
            log.info("replay: %s", line)
