"""Kernel launches without most of triton's per-call host work.

Why: `kernel[grid](...)` costs 55-69 us of host time on the lent H200 hosts for an
autotuned kernel of 25 arguments (triton 3.6), 30-46 us without the autotuner, of which
launching the compiled kernel is 9-13: the autotuner rebuilds its argument dicts and key
on every call, and JITFunction.run reads knobs, hooks and globals before it gets there.
A training step launches ~190 kernels, so without a CUDA graph its host time, not its GPU
time, sets the pace. Through this shortcut a launch costs 33 us (docs/journal.md).

`fast_launch(kernel)` wraps a @triton.jit or @gluon.jit kernel, or a triton.autotune over
one. `kernel[grid](*args)` is the general path; `kernel.planned(key, grid, *args)` the
lean one, for a launcher that can name in `key` everything the launch depends on but the
tensors' addresses: from the second call with a key, the compiled kernel, its grid and its
constexpr arguments come from a plan made once (no binder, no tuning lookup, no grid
function: ~11 us of host time a launch, the compiled launcher's own, against 37 through
the general path on the lent H200 hosts).

A call goes through triton as usual (compiling, tuning) until triton has launched its
specialisation once; later calls with it go straight to that compiled kernel. The tuning
choice is read from the autotuner's own cache under the autotuner's own key, and the
specialisation is the kernel's own binder's (what triton keys its compiled kernels on:
dtypes, 16-byte alignment, integers equal to 1 or divisible by 16 or past 32 bits,
constexpr values, options), so the shortcut launches exactly what triton would have.
Launch hooks (profilers), pre-run hooks and config pre-hooks send every call through
triton; so does the interpreter. Keyword arguments must be hashable (constexprs and
launch options are).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

import torch
import triton
from triton import knobs
from triton.runtime.autotuner import Autotuner

from fusedtrain.kernels import INTERPRET

# FUSEDTRAIN_FAST_LAUNCH=0 sends every launch through triton's own path.
ENABLED = not INTERPRET and os.environ.get("FUSEDTRAIN_FAST_LAUNCH", "1") != "0"
# FUSEDTRAIN_CHECK_PLANS=1 checks every planned launch against triton's own binding (the
# GPU tests set it): a key that misses something a launch depends on fails loudly.
CHECK_PLANS = os.environ.get("FUSEDTRAIN_CHECK_PLANS", "0") == "1"
# Triton 3.6's compiled launcher: a Python __call__ (scratch allocation) around a C
# `launch(gridX, gridY, gridZ, stream, function, cooperative, pdl, global_scratch,
# profile_scratch, metadata, launch_metadata, enter_hook, exit_hook, *args)` that takes a
# pointer argument as an int as well as a tensor (then calling its data_ptr and
# cuPointerGetAttribute). A plan calls that C function itself, with the addresses it read
# for the alignment check, when the kernel needs no scratch memory; other releases lay
# their launcher out differently and go through its __call__.
DIRECT_LAUNCH = triton.__version__.split(".")[:2] == ["3", "6"]


log = logging.getLogger("fusedtrain")
_KERNELS: list[FastLaunch] = []  # every wrapped kernel, for describe()


# Set while the op registry traces a launcher's body for torch.compile (ops/_registry.py).
# One flag for all threads: a launch another thread makes meanwhile goes through
# wrap_triton's own eager path, which launches the kernel as triton does.
_TRACING = False


@contextlib.contextmanager
def traced_launches() -> Iterator[None]:
    """Within: every launch is recorded for torch.compile (`torch.library.wrap_triton`:
    Inductor emits the kernel in its own code) instead of made, and no plan is read or
    made (the tensors are FunctionalTensors, their shapes possibly symbolic)."""
    global _TRACING
    before, _TRACING = _TRACING, True
    try:
        yield
    finally:
        _TRACING = before


def tracing() -> bool:
    return _TRACING


# While set, every launch is reported to it (fusedtrain/ops/_replay.py records an op's
# first call per signature so that later calls replay it from C++).
_RECORDER = None


def recorder(rec):
    """Set the launch recorder (None: none); returns the one set before."""
    global _RECORDER
    before, _RECORDER = _RECORDER, rec
    return before


def address(t: torch.Tensor) -> int:
    """t's address, for an alignment check; while traced (no address yet) its byte offset
    into its storage: Inductor's buffers, like the caching allocator's, start 16-byte
    aligned, and Inductor copies a graph input that is not."""
    return t.storage_offset() * t.element_size() if _TRACING else t.data_ptr()


def stand_in(written: torch.Tensor) -> torch.Tensor:
    """What to pass for a pointer a launch neither reads nor writes (its constexpr off),
    given a buffer the launch writes through another argument. Eager: that buffer itself
    (no allocation). Traced: a one-element tensor of its own. Functionalization copies
    every argument Triton's mutation analysis counts as written (a pointer whose loads
    feed a store's address counts; where the analysis fails, every pointer does), runs the
    kernel on the copies and puts each copy back over the tensor it was passed as, in
    argument order: a tensor passed under two such names ends up as the later name's copy,
    and the writes through the earlier one are lost."""
    return written.new_empty(1) if _TRACING else written


def _traced(kernel, grid, args: tuple, kwargs: dict) -> None:
    from torch.library import wrap_triton

    wrap_triton(kernel)[grid](*args, **kwargs)


CONSTANT = "_fusedtrain_constant"


def mark_constant(t: torch.Tensor) -> torch.Tensor:
    """t, marked as a cached table that never changes once made, which a recorded call
    (ops/_replay.py) may hold and reuse: its cache key must follow from the call's
    signature (shapes, dtypes, devices, scalar values)."""
    setattr(t, CONSTANT, True)
    return t


class PlanMismatchError(AssertionError):
    """A planned launch would differ from triton's own: its launcher's key is incomplete."""


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Not kept for the next launch: in Inductor's CUDA-graph warm-up (reduce-overhead) it
    # would be a live allocation in the graph's pool.
    return torch.empty(size, device="cuda", dtype=torch.int8)


def enable_device_descriptors() -> None:
    """Give triton the scratch allocator that kernels making TMA descriptors on the device
    need. Before every such launch: triton keeps the allocator in a context variable, and
    autograd runs backward kernels on its own threads, which start with none."""
    triton.set_allocator(_scratch)


class FastLaunch:
    """`kernel[grid](*args, **kwargs)` as triton launches it, with a shortcut to the
    compiled kernel on repeated specialisations. Other attributes are the kernel's."""

    def __init__(self, kernel):
        _KERNELS.append(self)
        self.fn = kernel  # the wrapped kernel, as Autotuner.fn is its JITFunction
        self._tuner = kernel if isinstance(kernel, Autotuner) else None
        self._jit = kernel.fn if self._tuner else kernel
        self._compiled = {}  # (device, specialisation, options) -> CompiledKernel
        # (device, key) -> (kernel, grid, tensor positions, the misaligned ones, constexprs,
        # whether it needs a scratch allocator, the C launch with its flags or None)
        self._plans = {}
        if self._tuner is not None:
            names = self._tuner.arg_names
            self._key_positions = [names.index(k) for k in self._tuner.keys if k in names]
            self._choices = {}  # see _tuned

    def __getattr__(self, name: str):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def _general(self, grid, args: tuple, kwargs: dict):
        """kernel[grid](*args, **kwargs) through triton's own path."""
        if _RECORDER is None:
            return self.fn[grid](*args, **kwargs)
        _RECORDER.python_launch(self.fn, grid, args, kwargs)
        with _RECORDER.paused():  # the interpreter's copies, the autotuner's runs
            return self.fn[grid](*args, **kwargs)

    def planned(self, key, args: tuple, launch: Callable[[], tuple]):
        """kernel[grid](*args, **kwargs) with (grid, kwargs) = launch(), planned once per
        (device, key): later calls with the key skip launch(), the binding and the grid.
        `key` (hashable) must determine every integer and every dtype among args, the
        constexprs and the grid: all that triton specialises on but the tensors'
        16-byte alignment, which the plan checks. Without a key (None), the general path:
        kernel[grid](*args, **kwargs)."""
        if key is None or _TRACING:
            grid, kwargs = launch()
            return self.run(grid, args, kwargs)
        if ENABLED and not CHECK_PLANS and self._launch_planned(key, None, args):
            return
        grid, kwargs = launch()
        if ENABLED and CHECK_PLANS:
            plan = self._plans.get((torch.cuda.current_device(), key))
            if plan is not None:
                self._check_plan(plan, grid, kwargs, args)
            if self._launch_planned(key, None, args):
                return
        self.run(grid, args, kwargs, key)

    def run(self, grid, args: tuple, kwargs: dict, plan_key=None):
        """kernel[grid](*args, **kwargs). Without a plan_key the call's own signature keys
        its plan: every argument but the tensors and floats by value, the tensors' dtypes,
        the keyword arguments (floats, such as a learning rate, are not specialised on)."""
        if _TRACING:
            return _traced(self.fn, grid, args, kwargs)
        if not ENABLED:
            return self._general(grid, args, kwargs)
        if plan_key is None:
            plan_key = (tuple([a.dtype if isinstance(a, torch.Tensor)
                               else float if type(a) is float else a for a in args]),
                        tuple(kwargs.items()))
            if self._launch_planned(plan_key, grid, args):
                return
        if self._jit.pre_run_hooks or _launch_hooks():
            return self._general(grid, args, kwargs)
        params = kwargs
        if self._tuner is not None:
            choice = self._tuned(args, kwargs)
            if choice is None:
                return self._general(grid, args, kwargs)
            self._tuner.best_config, config_kwargs = choice
            params = {**kwargs, **config_kwargs}
        device = torch.cuda.current_device()
        bound, specialisation, options = self._jit.device_caches[device][4](*args, **params)
        key = (device, tuple(specialisation), tuple(options.items()))
        kernel = self._compiled.get(key)
        if kernel is None:  # triton compiles (and tunes) it
            self._compiled[key] = self._general(grid, args, kwargs)
            return
        grid = _grid3(grid(bound) if callable(grid) else grid)
        values = tuple(bound.values())
        kernel.run(grid[0], grid[1], grid[2], _current_stream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *values)
        if _RECORDER is not None:
            _RECORDER.cuda_launch(kernel, grid, args, values[len(args):])
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self._plans[(device, plan_key)] = (
            kernel, grid, tensors, [i for i in tensors if args[i].data_ptr() & 15],
            values[len(args):], getattr(kernel.metadata, "global_scratch_size", 0) > 0,
            _direct_launch(kernel))
        log.info("launch plan: %s", _described(self, (device, plan_key), self._plans[
            (device, plan_key)], list(bound)[len(args):]))

    def _launch_planned(self, key, grid, args: tuple) -> bool:
        """Launch from the plan under (device, key), if there is one that fits the call's
        alignment and no hook wants the launch; `grid`, unless None or a function (whose
        value the plan holds), is the call's own. Returns whether it launched."""
        device = _current_device()
        plan = self._plans.get((device, key))
        if plan is None or self._jit.pre_run_hooks or _launch_hooks():
            return False
        kernel, g, tensors, misaligned, tail, scratch, direct = plan
        values = list(args)
        seen = 0  # the addresses or'ed together: their low bits say whether all are aligned
        for i in tensors:
            t = args[i]
            if direct is not None and not _on_device(t):
                direct = None
            values[i] = p = t.data_ptr()
            seen |= p
        if (seen & 15 or misaligned) and [i for i in tensors if values[i] & 15] != misaligned:
            return False
        if grid is not None and not callable(grid):
            g = _grid3(grid)
        if direct is not None:
            launch, cooperative, pdl = direct
            launch(g[0], g[1], g[2], _current_stream(device), kernel.function, cooperative,
                   pdl, None, None, kernel.packed_metadata, None, None, None, *values, *tail)
        else:
            if scratch:
                enable_device_descriptors()
            kernel.run(g[0], g[1], g[2], _current_stream(device), kernel.function,
                       kernel.packed_metadata, None, None, None, *args, *tail)
        if _RECORDER is not None:
            _RECORDER.cuda_launch(kernel, g, args, tail)
        return True

    def _check_plan(self, plan, grid, kwargs: dict, args: tuple) -> None:
        """Raise PlanMismatchError unless triton's own binding of this call gives the plan's
        kernel, grid and constexprs."""
        params = dict(kwargs)
        if self._tuner is not None:
            choice = self._tuned(args, kwargs)
            params.update(choice[1] if choice is not None else {})
        device = torch.cuda.current_device()
        bound, specialisation, options = self._jit.device_caches[device][4](*args, **params)
        compiled = self._compiled.get((device, tuple(specialisation), tuple(options.items())))
        got = (compiled, _grid3(grid(bound) if callable(grid) else grid),
               tuple(bound.values())[len(args):])
        if got != (plan[0], plan[1], plan[4]):
            name = getattr(self._jit, "__name__", type(self._jit).__name__)
            raise PlanMismatchError(f"{name}: planned {plan[1]}, {plan[4]}; "
                                    f"triton binds {got[1]}, {got[2]}")

    def _tuned(self, args: tuple, kwargs: dict):
        """(config, its kwargs) that the autotuner has chosen for this call, or None where
        it has not tuned the call's key yet or the config has a pre-hook. Memoised under a
        key from which the autotuner's own follows (the key arguments given by position,
        every positional argument's dtype or None, the keyword arguments), so that
        Autotuner.run's key, rebuilt from dicts of all arguments, is built once a key."""
        key = (tuple(args[i] for i in self._key_positions if i < len(args)),
               tuple(getattr(a, "dtype", None) for a in args), tuple(kwargs.items()))
        choice = self._choices.get(key)
        if choice is None:
            config = self._tuning_choice(args, kwargs)
            if config is None or config.pre_hook is not None:
                return None
            choice = self._choices[key] = (config, config.all_kwargs())
        return choice

    def _tuning_choice(self, args: tuple, kwargs: dict):
        """The config the autotuner has chosen for this call's tuning key (its key, built
        as Autotuner.run builds it), or None if it has not tuned it yet."""
        tuner = self._tuner
        if len(tuner.configs) == 1:
            return tuner.configs[0]
        named = dict(zip(tuner.arg_names, args))
        named.update((k, v) for k, v in kwargs.items() if k in tuner.arg_names)
        key = [named[k] for k in tuner.keys if k in named]
        key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
        return tuner.cache.get(tuple(key))


# Why a launcher took a kernel of each kind (the kernels' names say their kind).
PATHS = {
    "_ws_kernel": "Gluon warp-specialised GEMM: an sm_90 GPU, triton 3.6, 16-bit operands "
                  "of one dtype, each TMA-aligned (kernels/_tma.gluon_ok)",
    "_tma_kernel": "persistent GEMM loading through TMA: 16-bit TMA-aligned operands on "
                   "Hopper (kernels/_tma.tma_ok)",
    "_table_sweep_kernel": "an embedding's gradient from at most 2048 tokens: one sweep "
                           "of the table, zeros and sums, no atomics",
    "_rows_kernel": "an embedding's 16-bit gradient, 2049 tokens to fewer than table rows: "
                    "fp32 sums per distinct id, the table written once in 16 bits",
    "_embedding_bwd_kernel": "atomic adds into an fp32 table: fp32/fp64 gradients, as "
                             "many tokens as rows, or GPT's tied table",
    "_smem_kernel": "rows held in shared memory (Gluon): an sm_90 GPU, triton 3.6, "
                    "contiguous logits",
}


def _path(name: str, constexprs: dict) -> str:
    for suffix, why in PATHS.items():
        if name.endswith(suffix):
            return why
    if "TMA" in constexprs:
        return ("loads through TMA: 16-bit TMA-aligned operands on Hopper"
                if constexprs["TMA"] == "True" else "pointer loads: operands TMA cannot read")
    if name.startswith(("_linear_gelu", "_matmul", "_qkv")):
        return ("pointer GEMM: operands the TMA and Gluon kernels cannot take (strided, "
                "unaligned, fp32 or fp64, or no Hopper GPU)")
    return "the family's one Triton kernel"


def _on_device(t: torch.Tensor) -> bool:
    """Whether t's address is device memory. Only then may a plan pass it as an int: the
    launcher's own check of a tensor (cuPointerGetAttribute) is what turns a CPU tensor
    reaching a kernel into a ValueError instead of an illegal address on the GPU."""
    return t.is_cuda


def _direct_launch(kernel) -> tuple[Callable, int, int] | None:
    """(the C launch, cooperative flag, PDL flag) of a compiled kernel that a plan may call
    straight (DIRECT_LAUNCH, no scratch memory), else None."""
    run = kernel.run
    if not DIRECT_LAUNCH or getattr(run, "global_scratch_size", 1) \
            or getattr(run, "profile_scratch_size", 1) or not hasattr(run, "launch"):
        return None
    return run.launch, run.launch_cooperative_grid, run.launch_pdl


def _described(launcher: FastLaunch, key, plan, names: list[str]) -> dict:
    kernel, grid, _, misaligned, tail, _, direct = plan
    meta = kernel.metadata
    name = getattr(launcher._jit, "__name__", type(launcher._jit).__name__)
    constexprs = dict(zip(names, map(repr, tail)))
    return {"kernel": name, "why": _path(name, constexprs),
            "device": key[0], "key": repr(key[1]), "grid": grid,
            "constexprs": constexprs,
            "num_warps": getattr(meta, "num_warps", None),
            "num_stages": getattr(meta, "num_stages", None),
            "misaligned_args": misaligned,
            "launch": "C launcher, addresses as ints" if direct else "triton's launcher"}


def describe() -> list[dict]:
    """Every launch planned in this process: the kernel and why its launcher took a kernel
    of its kind, the key (shapes, dtypes, flags), grid, constexprs (tiles) and warps; one
    entry per (kernel, device, key)."""
    out = []
    for launcher in _KERNELS:
        names = getattr(launcher._jit, "arg_names", [])
        for key, plan in launcher._plans.items():
            n_args = len(names) - len(plan[4])
            out.append(_described(launcher, key, plan, names[n_args:]))
    return out


def _grid3(grid) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


_get_stream = None


def _current_stream(device: int) -> int:
    """The stream triton would launch on (torch's current stream on that device)."""
    global _get_stream
    if _get_stream is None:
        from triton.runtime import driver

        _get_stream = driver.active.get_current_stream
    return _get_stream(device)


def _launch_hooks() -> bool:
    """Whether a launch hook (a profiler's) is set: triton 3.6 keeps them in HookChains,
    always present (their `calls` lists empty when none is set), earlier releases as
    optional callables."""
    runtime = knobs.runtime
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_))


def _current_device() -> int:
    """torch's current CUDA device (torch.cuda.current_device without its lazy-init check:
    a plan exists only after a launch has initialised CUDA)."""
    return torch._C._cuda_getDevice()


fast_launch = FastLaunch  # as a decorator on a kernel or an autotuner over one


def operand_signature(name: str, *operands: torch.Tensor) -> tuple:
    """A plan key of a GEMM-like launch: its name, device, the operands' shapes, strides and
    dtypes, and whether all of them are 16-byte aligned."""
    aligned = 0
    key = [name, operands[0].device]
    for t in operands:
        key += (t.shape, t.stride(), t.dtype)
        aligned |= address(t) if _TRACING else t.data_ptr()  # inline: a hot path
    key.append(aligned & 15 == 0)
    return tuple(key)


# A launcher's call signature (operand_signature and its flags) -> its path (Gluon, TMA or
# pointer kernel) and what follows from it (tiles, constexprs, split-K): decided once a
# signature, since gluon_ok and tma_ok read every operand's strides and address and the
# split-K choice the SM count. Each launch is then planned under the same key
# (FastLaunch.planned). A call with a tuning `config` passes no key: neither planned nor
# kept.
_PLANS: dict[tuple, tuple] = {}


def plan_once(key: tuple | None, make: Callable[[], tuple]) -> tuple:
    """make()'s plan, made once per key (every call without one, and while traced)."""
    if key is None or _TRACING:
        return make()
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = make()
    return plan
