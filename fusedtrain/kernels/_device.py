"""Host-side facts about data and devices: accumulator and statistics dtypes, the dot's
precision, SM count and L2 size, integer grid arithmetic."""

from __future__ import annotations

import functools

import torch
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(t: torch.Tensor) -> tl.dtype:
    """Accumulator type for a kernel's `ACC` constexpr: fp64 for fp64 data, else fp32."""
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def stat_dtype(t: torch.Tensor) -> torch.dtype:
    """Torch dtype of statistics and partial sums kept beside t (log-sum-exp, mean/rstd,
    split-K and dW partials): fp64 for fp64 data, else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def dot_precision(t: torch.Tensor) -> str:
    """For a kernel's `PRECISION` constexpr. fp32 operands are multiplied in full
    precision, as eager fp32 matmul is by default, not in tf32: the fused op must
    stay within 2x the eager op's error."""
    return "ieee" if t.dtype in (torch.float32, torch.float64) else "tf32"


@functools.lru_cache
def _properties(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def _device_properties(device: torch.device):
    """A CUDA device's properties (cached: the query costs microseconds)."""
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


# Host-side arithmetic for grids and block sizes. triton.cdiv and triton.next_power_of_2
# are constexpr functions (usable in kernels too), whose calls from Python unwrap their
# arguments: ~5 us each against 0.2, paid ~570 times a GPT-2 step.


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return _device_properties(device).multi_processor_count


def l2_cache_bytes(device: torch.device) -> int:
    """L2 cache size of a CUDA device; under the interpreter, an H100's 50 MiB."""
    if device.type != "cuda":
        return 50 * 2**20
    return _device_properties(device).L2_cache_size
