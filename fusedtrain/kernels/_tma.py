"""Persistent GEMMs that load through TMA tensor descriptors (Hopper's bulk-copy engine).

A kernel built on these helpers launches one program per SM (or two), walks its share of the
output tiles in one flattened loop (so the compiler pipelines the next tile's loads
under this tile's epilogue), reads A and B tiles through TMA descriptors (rows and
columns past the tensor's end read as zero, stores past it are dropped: no masks), and
runs its epilogue on the two column halves of the accumulator in turn, which halves the
registers the epilogue's fp32 temporaries need.

Descriptors are made on the device (`matrix_desc`), once per program, from a pointer and
strides: host-made TensorDescriptor arguments cost about 2 ms of host time per launch
in triton 3.6's launcher (measured: the fused training step became host-bound on them).
Device-made ones live in a small global scratch buffer that `launch` allocates through
triton's allocator hook. Block sizes come from a small measured table (`tma_config`).
Kernels fall back to the pointer-based GEMMs (any strides, fp32/fp64 on the GPU) where
`tma_ok` says the operands cannot go through TMA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._device import ceil_div, sm_count
from fusedtrain.kernels._gemm import grouped_tile
from fusedtrain.kernels._launch import address, enable_device_descriptors, tracing
from fusedtrain.kernels._primitives import device_fn
from fusedtrain.kernels.gelu import gelu_operand


@dataclass(frozen=True)
class TmaConfig:
    """Tile shape and launch settings of one persistent TMA GEMM."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    # Programs per SM: 2 (when two fit in registers and shared memory) lets one program's
    # epilogue run while the other's MMAs do.
    per_sm: int = 1
    maxnreg: int | None = None  # a register cap per thread, so that two programs fit

    def __post_init__(self):
        if self.per_sm < 1:  # zero programs would launch nothing and leave outputs unwritten
            raise ValueError(f"TmaConfig.per_sm must be >= 1, got {self.per_sm}")

    def meta(self) -> dict:
        """The kernel's tile constexprs and launch options."""
        cap = {} if self.maxnreg is None else {"maxnreg": self.maxnreg}
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "GROUP_M": self.group_m, "num_warps": self.num_warps,
                "num_stages": self.num_stages, **cap}

    def programs(self, work_items: int, device: torch.device) -> int:
        """Programs of a persistent launch over `work_items` tiles: per_sm per SM, at most
        one per item (one under the interpreter)."""
        return 1 if INTERPRET else min(work_items, self.per_sm * sm_count(device))


# The interpreter runs few, large programs fastest; tile shape does not matter to it.
_INTERPRET_CONFIG = TmaConfig(128, 128, 64, 4, 1)


def tma_config(N: int) -> TmaConfig:
    """Tiles for an (M x N) output on an H200, from scripts/tune_tma.py's sweep (see
    docs/journal.md): 128 x 256 x 64 tiles, 8 warps, 3 stages, and 128-wide tiles
    where N is too narrow for 256. (Two programs per SM of 128 x 128 tiles won 4-5% at
    K = 768 for the forwards in the sweep's cold-cache timing and lost up to 4% in the
    benchmark's CUDA-graph replays: not chosen.)"""
    if INTERPRET:
        return _INTERPRET_CONFIG
    return TmaConfig(block_n=256 if N >= 256 else 128)


@functools.lru_cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_aligned(t: torch.Tensor) -> bool:
    """A 16-byte aligned base, unit stride in the last dimension and 16-byte multiples for
    the other strides: what a TMA descriptor needs of its tensor."""
    strides = t.stride()
    if strides[-1] != 1 or address(t) & 15:
        return False
    size = t.element_size()
    return all(s * size % 16 == 0 for s in strides[:-1])


def tma_ok(*operands: torch.Tensor) -> bool:
    """Whether a GEMM's operands go through TMA: 16-bit data on a Hopper (or newer) GPU, or
    any dtype under the interpreter, each operand tma_aligned."""
    return all((INTERPRET or (t.element_size() == 2 and _hopper(t.device))) and tma_aligned(t)
               for t in operands)


# The Gluon API the warp-specialised kernels (kernels.gemm_gluon) are written against: it changes
# between triton releases (3.9 renamed its TMA copies), so other versions keep the Triton
# kernels.
GLUON_TRITON = "3.6."

# The widest reduction at which the epilogue-fused Gluon GEMMs (the QKV projection's,
# SwiGLU's forward) run, where an H100 measured them faster than the alternative
# (forward): QKV 2.7-4.5% faster than its TMA kernel at C = 768, equal at 1024, 2.3-5.4%
# slower at 2048 and 4096; SwiGLU 0.200 against cuBLAS's 0.237 ms at (16384, 768 -> 2048),
# 4.73 against 4.68 at (16384, 4096 -> 11008).
GLUON_EPILOGUE_MAX_K = 1024


@functools.lru_cache
def _sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def gluon_ok(*operands: torch.Tensor) -> bool:
    """Whether a GEMM runs as a warp-specialised Gluon kernel (kernels.gemm_gluon): on an sm_90 GPU
    with triton 3.6, 16-bit operands of one dtype, each tma_aligned; not while traced for
    torch.compile (Inductor re-emits a user kernel as @triton.jit source, which a Gluon
    kernel is not)."""
    return (not INTERPRET and not tracing() and triton.__version__.startswith(GLUON_TRITON)
            and all(t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)
                    and t.dtype == operands[0].dtype and tma_aligned(t) for t in operands)
            and _sm90(operands[0].device))


def k_splits(tiles: int, K: int, device: torch.device, per_sm: int = 1) -> int:
    """How many slices to split a GEMM's reduction over, for `tiles` output tiles: the count
    (at most 8, each slice at least 1024 long) whose tiles x slices work items spread most
    evenly over per_sm programs per SM, i.e. with the smallest ceil(tiles * s / P) / s."""
    if INTERPRET:
        return 1
    programs = per_sm * sm_count(device)
    return min(range(1, max(1, min(8, K // 1024)) + 1),
               key=lambda s: (ceil_div(tiles * s, programs) / s, s))


def launch(kernel, work_items: int, device: torch.device, *args, config: TmaConfig,
           programs: int | None = None, key=None, **constexprs) -> None:
    """Launch a persistent TMA kernel: `programs` programs (default config.programs(...)),
    with config's tile shape and warps. With a `key` (see FastLaunch.planned: it must
    determine the grid, the config, the constexprs and every integer argument), the launch
    is planned once under it."""

    def plan():
        enable_device_descriptors()
        return (programs or config.programs(work_items, device),), {**constexprs,
                                                                    **config.meta()}

    kernel.planned(key, args, plan)


@device_fn
def matrix_desc(ptr, rows, cols, row_stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """TMA descriptor over the (rows, cols) matrix at ptr (unit column stride), carrying
    (BLOCK_R, BLOCK_C) tiles."""
    return tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[row_stride, 1],
                                     block_shape=[BLOCK_R, BLOCK_C])


# reduce_tile(desc, offsets, val): desc's block at `offsets` += val. One TMA bulk reduction
# (an fp32 add in L2) on the GPU; a load, add and store under the interpreter, which has no
# descriptor reductions and runs programs one at a time. (One name in both modes: see
# _primitives.)
if INTERPRET:
    @device_fn
    def reduce_tile(desc, offsets, val):
        desc.store(offsets, desc.load(offsets) + val)
else:
    @device_fn
    def reduce_tile(desc, offsets, val):
        desc.atomic_add(offsets, val)


@device_fn
def tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):
    """(first row, first column) of output tile number `tile`, in grouped order."""
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@device_fn
def tma_matmul(a_desc, b_desc, off_m, off_n, k_start, k_len,
               ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               A_TRANS: tl.constexpr = False, B_TRANS: tl.constexpr = False,
               A_GELU: tl.constexpr = False, APPROX: tl.constexpr = 0):
    """The (BLOCK_M, BLOCK_N) tile at (off_m, off_n) of A @ B, reduced over
    k in [k_start, k_start + k_len), as an fp32 (fp64) accumulator.

    A_TRANS: a_desc is over A.T, stored (K, M) (e.g. dy read as dy.T); B_TRANS: b_desc is
    over B.T, stored (N, K) (a weight W for x @ W.T). A_GELU: multiply gelu(A), recomputed
    in registers as each tile arrives (gelu.gelu_operand), so gelu(A) never exists in
    memory. (On A, not B: Hopper's wgmma takes its A operand from registers, B only from
    shared memory, which a recomputed B would have to be written back to.)
    """
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    for k in range(k_start, k_start + k_len, BLOCK_K):
        a = tl.trans(a_desc.load([k, off_m])) if A_TRANS else a_desc.load([off_m, k])
        b = tl.trans(b_desc.load([off_n, k])) if B_TRANS else b_desc.load([k, off_n])
        if A_GELU:
            a = gelu_operand(a, APPROX, ACC)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc.dtype)
    return acc


@device_fn
def tile_halves(a_desc, b_desc, off_m, off_n, K, ACC: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                B_TRANS: tl.constexpr = False):
    """The output tile of A @ B at (off_m, off_n) (tile_origin's) over all of K: its
    accumulator's two column halves, for an epilogue run per half. The origin comes from
    the caller: torch.compile's analysis of a kernel counts every pointer passed to a call
    whose results feed a store's address as written (and copies it), so what addresses a
    store must not come out of a call given the operands."""
    acc = tma_matmul(a_desc, b_desc, off_m, off_n, 0, K, ACC, PRECISION,
                     BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS=B_TRANS)
    return column_halves(acc, BLOCK_M, BLOCK_N)


@device_fn
def column_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc[:, :BLOCK_N // 2], acc[:, BLOCK_N // 2:] of a (BLOCK_M, BLOCK_N) tile."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@device_fn
def column_join(left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) tile [left | right] of two (BLOCK_M, BLOCK_N // 2) halves:
    column_halves' inverse."""
    return tl.reshape(tl.permute(tl.join(left, right), (0, 2, 1)), (BLOCK_M, BLOCK_N))
