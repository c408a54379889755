"""Kernel launches without most of triton's per-call host work.

Why: `kernel[grid](...)` costs 55-69 us of host time on the lent H200 hosts for an
autotuned kernel of 25 arguments (triton 3.6), 30-46 us without the autotuner, of which
launching the compiled kernel is 9-13: the autotuner rebuilds its argument dicts and key
on every call, and JITFunction.run reads knobs, hooks and globals before it gets there.
A training step launches ~190 kernels, so without a CUDA graph its host time, not its GPU
time, sets the pace. Through this shortcut a launch costs 33 us (docs/journal.md).

`fast_launch(kernel)` wraps a @triton.jit or @gluon.jit kernel, or a triton.autotune over
one. A call goes through triton as usual (compiling, tuning) until triton has launched its
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

import os

import torch
from triton import knobs
from triton.runtime.autotuner import Autotuner

from fusedtrain.kernels import INTERPRET

# FUSEDTRAIN_FAST_LAUNCH=0 sends every launch through triton's own path.
ENABLED = not INTERPRET and os.environ.get("FUSEDTRAIN_FAST_LAUNCH", "1") != "0"


class FastLaunch:
    """`kernel[grid](*args, **kwargs)` as triton launches it, with a shortcut to the
    compiled kernel on repeated specialisations. Other attributes are the kernel's."""

    def __init__(self, kernel):
        self.fn = kernel  # the wrapped kernel, as Autotuner.fn is its JITFunction
        self._tuner = kernel if isinstance(kernel, Autotuner) else None
        self._jit = kernel.fn if self._tuner else kernel
        self._compiled = {}  # (device, specialisation, options) -> CompiledKernel
        if self._tuner is not None:
            names = self._tuner.arg_names
            self._key_positions = [names.index(k) for k in self._tuner.keys if k in names]
            self._choices = {}  # see _tuned

    def __getattr__(self, name: str):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict):
        if not ENABLED or self._jit.pre_run_hooks or _launch_hooks():
            return self.fn[grid](*args, **kwargs)
        params = kwargs
        if self._tuner is not None:
            choice = self._tuned(args, kwargs)
            if choice is None:
                return self.fn[grid](*args, **kwargs)
            self._tuner.best_config, config_kwargs = choice
            params = {**kwargs, **config_kwargs}
        device = torch.cuda.current_device()
        bound, specialisation, options = self._jit.device_caches[device][4](*args, **params)
        key = (device, tuple(specialisation), tuple(options.items()))
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)
            self._compiled[key] = kernel
            return kernel
        if callable(grid):
            grid = grid(bound)
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                   _current_stream(device), kernel.function, kernel.packed_metadata, None, None,
                   None, *bound.values())
        return kernel

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
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(hook, "calls", hook) for hook in hooks)


fast_launch = FastLaunch  # as a decorator on a kernel or an autotuner over one
