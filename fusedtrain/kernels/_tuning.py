"""Autotuning: per-dtype candidate lists, CUDA-graph timing for microsecond kernels, the
on-disk cache, and the fast launcher around every tuned kernel."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import triton
import triton.testing

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._launch import fast_launch


def autotune(configs: list[triton.Config], key: list[str], interpret: triton.Config,
             wide: list[triton.Config], keep: Callable[..., bool] | None = None, **kwargs):
    """triton.autotune over `configs` for 16-bit data on a GPU, over the small `wide`
    configs for fp32/fp64 data (large tiles of 4- and 8-byte elements overflow shared
    memory or take minutes to compile, and those dtypes are for checking, not speed),
    and under the interpreter the single `interpret` config (tuned for few, large
    programs, which the interpreter runs fastest). `keep(config, **constexprs)`, if
    given, drops 16-bit candidates for a call's constexprs. The GPU choice is cached on
    disk where this Triton supports it, so a second process does not re-tune."""
    if INTERPRET:
        configs = [interpret]

    def by_dtype(candidates, named_args, **constexprs):
        data = next(a for a in named_args.values() if isinstance(a, torch.Tensor))
        if data.element_size() >= 4:
            return wide
        return [c for c in candidates if keep is None or keep(c, **constexprs)] or candidates

    return cached_autotune(configs, key, by_dtype, **kwargs)


def graph_timed(kernel_call: Callable, quantiles: tuple[float, ...]) -> list[float]:
    """The autotuner's benchmark for kernels of a few microseconds: CUDA-graph replays of
    the call, so that its GPU time decides and not the host's launch cost, which exceeds
    it (triton's default times back-to-back launches: ~19 us a LayerNorm of 13)."""
    return triton.testing.do_bench_cudagraph(kernel_call, quantiles=quantiles)


def cached_autotune(configs: list[triton.Config], key: list[str], prune: Callable, **kwargs):
    """triton.autotune over the configs `prune(configs, named_args, **constexprs)` keeps,
    its choice cached on disk where this Triton supports it; launched through
    _launch.fast_launch."""
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        kwargs.setdefault("cache_results", True)
    tune = triton.autotune(configs=configs, key=key,
                           prune_configs_by={"early_config_prune": prune}, **kwargs)
    return lambda kernel: fast_launch(tune(kernel))
