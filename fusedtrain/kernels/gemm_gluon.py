"""Warp-specialised persistent GEMMs for Hopper (sm_90), in Gluon (triton's lower-level
language: explicit layouts, shared memory, barriers, async wgmma).

Why: a Triton kernel's warps run a tile's MMAs and then its epilogue in turn, so the
tensor cores idle through every epilogue (GELU, a second tensor read or written, column
sums). Here each CTA walks its share of output tiles with three partitions:

  producer    streams A and B tiles by TMA into a ring of STAGES shared-memory slots;
              ready[s] completes when slot s is full, empty[s] when its wgmma has read it;
  consumers   two warpgroups taking alternate tiles of the CTA's walk. Their mainloops
              (async wgmma over K) run in turn (ping-pong): one consumer's epilogue runs
              while the other's MMAs keep the tensor cores busy.

The turn also keeps the ring consumed in the producer's order. Without it, a consumer
waiting for a slot of its next tile could meet the slot's barrier two laps ahead, whose
phase parity is the same as the one it waits for, and read a tile not yet loaded (the
launch failures of a first prototype, docs/journal.md).

A kernel built on this module brings its epilogue (`epilogue(args, acc, buf, bar, off_m,
off_n, j)`, on a (BM, BN) fp32 accumulator in ACC_LAYOUT) and a hook run before each
tile's mainloop (`prefetch`, e.g. a TMA load of the tile's operand for the epilogue into
`buf`, completing `bar`); each consumer owns one (BM, BN) shared-memory buffer and one
barrier for them. Gluon kernels do not run under the interpreter: the Triton kernels stay
the CPU path, and the reference these are tested against on the GPU.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from fusedtrain.kernels._device import ceil_div, sm_count
from fusedtrain.kernels._tma import enable_device_descriptors

# Tiles: 128 x 128 per consumer (a 128-register fp32 accumulator in each of its 128
# threads), 64-deep K steps, four ring slots: at gpt2's MLP shapes on an H200 faster than
# 64 x 256 per consumer (docs/journal.md).
BM, BN, BK, STAGES = gl.constexpr(128), gl.constexpr(128), gl.constexpr(64), gl.constexpr(4)
GROUP_M = gl.constexpr(8)
# Registers: the default partition (consumer 0) runs under the kernel's cap; the second
# consumer raises its own, the one-warp producer lowers its own (setmaxnreg).
_MAXNREG = 168
_CONSUMER_REGS, _PRODUCER_REGS = gl.constexpr(232), gl.constexpr(24)

ACC_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BN, 16]))


def launch(kernel, M: int, N: int, device: torch.device, *args, key=None,
           **constexprs) -> None:
    """One CTA per SM (at most one per output tile) of 4 + 4 + 1 warps. With a `key` (see
    FastLaunch.planned: it must determine M, N, the constexprs and every integer argument),
    the launch is planned once under it."""

    def plan():
        enable_device_descriptors()
        tiles = ceil_div(M, BM.value) * ceil_div(N, BN.value)
        return (min(tiles, sm_count(device)),), dict(constexprs, num_warps=4,
                                                      maxnreg=_MAXNREG)

    kernel.planned(key, args, plan)


@gluon.jit
def matrix_desc(ptr, rows, cols, row_stride, BLOCK_R: gl.constexpr, BLOCK_C: gl.constexpr):
    """TMA descriptor over the (rows, cols) matrix at ptr (unit column stride), made on the
    device (see _tma), carrying (BLOCK_R, BLOCK_C) tiles in the layout wgmma reads."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_C],
                                                                ptr.dtype.element_ty)
    return tma.make_tensor_descriptor(ptr, [rows, cols], [row_stride, 1], [BLOCK_R, BLOCK_C],
                                      layout)


@aggregate
class Pipe:
    """The ring between the producer and the consumers, and the GEMM's sizes."""

    a_desc: tma.tensor_descriptor
    b_desc: tma.tensor_descriptor
    b2_desc: tma.tensor_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor
    M: gl.tensor
    N: gl.tensor
    K: gl.tensor
    B_TRANS: gl.constexpr
    PAIRED: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, turn, M, N, K,
                 B_TRANS, PAIRED):
        self.a_desc, self.b_desc, self.b2_desc = a_desc, b_desc, b2_desc
        self.a_bufs, self.b_bufs = a_bufs, b_bufs
        self.ready, self.empty, self.turn = ready, empty, turn
        self.M, self.N, self.K = M, N, K
        self.B_TRANS, self.PAIRED = gl.constexpr(B_TRANS), gl.constexpr(PAIRED)


@gluon.jit
def _barriers(count: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(count):
        mbarrier.init(bars.index(i), count=1)
    return bars


@gluon.jit
def make_pipe(a_desc, b_desc, M, N, K, B_TRANS: gl.constexpr):
    """A: (M, K) through a_desc's (BM, BK) tiles; B: (K, N), through b_desc's (BK, BN) tiles,
    or with B_TRANS B.T (N, K) through (BN, BK) tiles (a weight W for x @ W.T)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                       b_desc.layout)
    # Sizes as tensors: triton passes an int argument equal to 1 as a constant.
    return Pipe(a_desc, b_desc, b_desc, a_bufs, b_bufs, _barriers(STAGES), _barriers(STAGES),
                _barriers(2), gl.to_tensor(M), gl.to_tensor(N), gl.to_tensor(K), B_TRANS,
                False)


@gluon.jit
def make_paired_pipe(a_desc, b_desc, b2_desc, M, N, K):
    """x @ [W1 | W2 interleaved].T: A (M, K) through a_desc's (BM, BK) tiles, W1 and W2 (N/2,
    K) each through (BN/2, BK) tiles; output tile columns [off_n, off_n + BN) are W1's rows
    [off_n/2, off_n/2 + BN/2) then W2's same rows (e.g. SwiGLU's gate and up projections
    side by side in one accumulator)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    return Pipe(a_desc, b_desc, b2_desc, a_bufs, b_bufs, _barriers(STAGES), _barriers(STAGES),
                _barriers(2), gl.to_tensor(M), gl.to_tensor(N), gl.to_tensor(K), True, True)


@gluon.jit
def tile_origin(t, M, N):
    """(first row, first column) of output tile t, in groups of GROUP_M row tiles (for L2
    reuse of B)."""
    num_m = gl.cdiv(M, BM)
    per_group = GROUP_M * gl.cdiv(N, BN)
    first_m = (t // per_group) * GROUP_M
    rows = gl.minimum(num_m - first_m, GROUP_M)
    return (first_m + (t % per_group) % rows) * BM, ((t % per_group) // rows) * BN


@gluon.jit
def _producer(p):
    n_tiles = gl.cdiv(p.M, BM) * gl.cdiv(p.N, BN)
    s = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        off_m, off_n = tile_origin(t, p.M, p.N)
        for k in range(0, p.K, BK):
            slot = s % STAGES
            mbarrier.wait(p.empty.index(slot), ((s // STAGES) & 1) ^ 1)  # lap 0: free
            bar = p.ready.index(slot)
            b_bytes: gl.constexpr = p.b_desc.block_type.nbytes * (2 if p.PAIRED else 1)
            mbarrier.expect(bar, p.a_desc.block_type.nbytes + b_bytes)
            tma.async_copy_global_to_shared(p.a_desc, [off_m, k], bar, p.a_bufs.index(slot))
            if p.PAIRED:
                b = p.b_bufs.index(slot)
                tma.async_copy_global_to_shared(p.b_desc, [off_n // 2, k], bar,
                                                b.slice(0, BN // 2, dim=0))
                tma.async_copy_global_to_shared(p.b2_desc, [off_n // 2, k], bar,
                                                b.slice(BN // 2, BN // 2, dim=0))
            elif p.B_TRANS:
                tma.async_copy_global_to_shared(p.b_desc, [off_n, k], bar, p.b_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(p.b_desc, [k, off_n], bar, p.b_bufs.index(slot))
            s += 1


@gluon.jit
def _mainloop(p, which: gl.constexpr, i):
    """The accumulator of consumer `which`'s tile, the CTA's i-th, over all of K; waits for
    this consumer's turn and passes it on once its last wgmma is issued."""
    acc = gl.zeros((BM, BN), gl.float32, ACC_LAYOUT)
    k_steps = gl.cdiv(p.K, BK)
    s = i * k_steps
    mbarrier.wait(p.turn.index(which), ((i // 2) & 1) ^ (1 - which))  # 0's first: at once
    for k in range(k_steps):
        slot = s % STAGES
        mbarrier.wait(p.ready.index(slot), (s // STAGES) & 1)
        a = p.a_bufs.index(slot)
        b = p.b_bufs.index(slot)
        if p.B_TRANS:
            b = b.permute((1, 0))
        acc = warpgroup_mma(a, b, acc, use_acc=k > 0, is_async=True)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))
        if k > 0:  # the previous step's wgmma is done with its slot
            mbarrier.arrive(p.empty.index((s - 1) % STAGES), count=1)
        s += 1
    mbarrier.arrive(p.turn.index(1 - which), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(p.empty.index((s - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _consumer(p, args, which: gl.constexpr, buf_dtype: gl.constexpr, prefetch: gl.constexpr,
              epilogue: gl.constexpr):
    buf = gl.allocate_shared_memory(buf_dtype, [BM, BN],
                                    gl.NVMMASharedLayout.get_default_for([BM, BN], buf_dtype))
    bar = _barriers(1).index(0)
    n_tiles = gl.cdiv(p.M, BM) * gl.cdiv(p.N, BN)
    nprog = gl.num_programs(0)
    i = which  # the CTA's tiles i = which, which + 2, ...: j-th of this consumer
    for t in range(gl.program_id(0) + which * nprog, n_tiles, 2 * nprog):
        off_m, off_n = tile_origin(t, p.M, p.N)
        prefetch(args, buf, bar, off_m, off_n)
        acc = _mainloop(p, which, i)
        epilogue(args, acc, buf, bar, off_m, off_n, i // 2)
        i += 2
    tma.store_wait(pendings=0)


@gluon.jit
def run(p, args, buf_dtype: gl.constexpr, prefetch: gl.constexpr, epilogue: gl.constexpr):
    """The kernel body: producer and consumers over the pipe; each consumer's (BM, BN)
    buffer holds buf_dtype, laid out as matrix_desc's (BM, BN) tiles."""
    gl.warp_specialize([(_consumer, (p, args, 0, buf_dtype, prefetch, epilogue)),
                        (_consumer, (p, args, 1, buf_dtype, prefetch, epilogue)),
                        (_producer, (p,))], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


@gluon.jit
def no_prefetch(args, buf, bar, off_m, off_n):
    pass


@gluon.jit
def stage_tile(buf, val):
    """val into buf, once buf's last TMA store has read it out, ready for TMA stores."""
    tma.store_wait(pendings=0)
    buf.store(val.to(buf.dtype))
    fence_async_shared()


@gluon.jit
def store_tile(desc, buf, val, off_m, off_n):
    """TMA-store val (BM, BN) at (off_m, off_n) through buf."""
    stage_tile(buf, val)
    tma.async_copy_shared_to_global(desc, [off_m, off_n], buf)


@gluon.jit
def tile_columns(off_n):
    """The columns of a tile starting at off_n, laid out as the accumulator's."""
    return off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC_LAYOUT))
