"""Cross-entropy's loss and logit gradient in one pass, each row of logits held in shared
memory: a Gluon kernel for Hopper (sm_90).

Why: the loss needs a row's logsumexp before any of its gradient can be written, so the
Triton kernels read the logits twice, once in the loss's kernel and again in the
gradient's (4.95 GB of HBM traffic at GPT-2's 16384 x 50304 bf16 logits, ~1.24 ms on an
H200). Re-reading a row from L2 instead did not work out: few rows in flight do not keep
HBM busy, many evict each other (docs/journal.md). Here a CTA loads a
whole row (~100 KB) into shared memory by TMA, takes the logsumexp and the loss from it,
then writes the gradient from it: 3.3 GB of traffic.

The row is viewed as sub-rows of W = 64 logits (128 bytes: one TMA swizzle span), fetched
in NB boxes of BOX sub-rows; a box past the row's end reads the next row's first logits
(or zeros past the tensor), which the column mask drops. Taken where `fits` says so
(kernels.cross_entropy.cross_entropy_fwd_grad); Gluon kernels do not run under the
interpreter, so the Triton kernels are the CPU path and the reference these are tested
against on the GPU.
"""

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from fusedtrain.kernels._device import ceil_div, sm_count
from fusedtrain.kernels._launch import fast_launch
from fusedtrain.kernels._tma import enable_device_descriptors, gluon_ok

W = gl.constexpr(64)
LOG2E = gl.constexpr(1.4426950408889634)
# An H200 SM's shared memory is 227 KiB; some is left for the barriers and the
# reductions' scratch.
_SMEM_PER_SM = 220 * 1024


@dataclass(frozen=True)
class _Shape:
    """A launch's boxes (sub-rows of W logits each), warps and CTAs per SM; each CTA gets
    1 / ctas_per_sm of the SM's 64K registers and of its shared memory."""

    box: int
    warps: int
    ctas_per_sm: int

    def boxes(self, V: int) -> int:
        return ceil_div(V // W.value, self.box)

    def fits(self, V: int, element_size: int) -> bool:
        row_bytes = self.boxes(V) * self.box * W.value * element_size
        return row_bytes <= _SMEM_PER_SM // self.ctas_per_sm

    @property
    def maxnreg(self) -> int:
        return min(255, 65536 // (self.ctas_per_sm * self.warps * 32))


# Two CTAs of 8 warps on each SM where a row fits in half the shared memory, so that one's
# loads and stores run while the other computes its row's logsumexp (H200, GPT-2's 16384 x
# 50304 bf16 logits: 982 us, 3.4 TB/s, against 1164 us for one CTA of 16 warps with
# 128-sub-row boxes and 1303 for one of 8; docs/journal.md); that
# one CTA of 16 warps for rows of up to all of it.
SHAPES = (_Shape(box=64, warps=8, ctas_per_sm=2), _Shape(box=128, warps=16, ctas_per_sm=1))


def launch_shape(logits: torch.Tensor) -> _Shape | None:
    """The first of SHAPES whose CTAs hold a row of these (M, V) logits, if any."""
    return next((s for s in SHAPES if s.fits(logits.shape[1], logits.element_size())), None)


def fits(logits: torch.Tensor) -> bool:
    """Whether the kernel takes these (M, V) logits: contiguous 16-bit rows that are whole
    sub-rows (V % 64 == 0), a row of them in a CTA's shared memory, on an sm_90 GPU with
    the triton release the Gluon kernels are written for (kernels._tma.gluon_ok)."""
    return (gluon_ok(logits) and logits.is_contiguous() and logits.shape[1] % W.value == 0
            and launch_shape(logits) is not None)


@fast_launch
@gluon.jit
def _ce_smem_kernel(logits_ptr, target_ptr, count_ptr, loss_ptr, dlogits_ptr, M, V,
                    ignore_index, NB: gl.constexpr, BOX: gl.constexpr, WARPS: gl.constexpr):
    # Each thread holds 8 consecutive logits (one 16-byte access) of a box's sub-rows; a
    # sub-row's 64 logits lie in one warp, so sums along it need no shared memory.
    ROW_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    SUB_ROW: gl.constexpr = gl.SliceLayout(1, ROW_LAYOUT)
    # Each CTA (one or two on an SM) walks rows pid, pid + P, ... Pass 2 of a row frees
    # its boxes one by one, and each is refilled at once with the next row's: those loads
    # run under the rest of pass 2, and the next row's pass 1 finds its first boxes in place.
    dtype: gl.constexpr = logits_ptr.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BOX, W], dtype)
    sub_rows = V // W
    desc = tma.make_tensor_descriptor(logits_ptr, [M * sub_rows, W], [W, 1], [BOX, W],
                                      smem_layout)
    boxes = gl.allocate_shared_memory(dtype, [NB, BOX, W], smem_layout)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NB):
        mbarrier.init(bars.index(b), count=1)
    fence_async_shared()
    row = gl.program_id(0)
    step = gl.num_programs(0)
    for b in gl.static_range(NB):
        _load_box(desc, boxes, bars, b, row * sub_rows, BOX)
    # A box's logits, by their column in the row less the box's first (b * BOX * W).
    cols = (gl.arange(0, BOX, layout=SUB_ROW)[:, None] * W
            + gl.arange(0, W, layout=gl.SliceLayout(0, ROW_LAYOUT))[None, :])
    inv_count = 1.0 / gl.load(count_ptr).to(gl.float32)  # inf if every row is ignored: g = 0
    phase = 0
    for _ in range(gl.program_id(0), M, step):
        base = row.to(gl.int64) * V
        target = gl.load(target_ptr + row)
        in_range = (target >= 0) & (target < V)
        # Read before pass 2 overwrites it (its first store follows a CTA barrier).
        x_t = gl.load(logits_ptr + base + gl.where(in_range, target, 0)).to(gl.float32)
        # Pass 1, in base 2, per sub-row position of a box: running maximum m and sum l of
        # 2^(x log2(e) - m); combined across positions at the end.
        m = gl.full([BOX], -float("inf"), gl.float32, SUB_ROW)
        l = gl.zeros([BOX], gl.float32, SUB_ROW)
        for b in gl.static_range(NB):
            mbarrier.wait(bars.index(b), phase)
            x = boxes.index(b).load(ROW_LAYOUT).to(gl.float32) * LOG2E
            x = gl.where(b * BOX * W + cols < V, x, -float("inf"))
            m_new = gl.maximum(m, gl.max(x, axis=1))
            m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)  # only -inf so far
            l = l * gl.exp2(m - m_safe) + gl.sum(gl.exp2(x - m_safe[:, None]), axis=1)
            m = m_new
        m_row = gl.max(m, axis=0)
        lse2 = m_row + gl.log2(gl.sum(l * gl.exp2(m - m_row), axis=0))
        loss = gl.where(in_range, lse2 / LOG2E - x_t, float("nan"))
        gl.store(loss_ptr + row, gl.where(target == ignore_index, 0.0, loss))
        # Pass 2: d = (softmax - onehot(target)) / count, over the logits' own memory.
        g = gl.where(target != ignore_index, inv_count, 0.0)
        next_row = row + step
        for b in gl.static_range(NB):
            x = boxes.index(b).load(ROW_LAYOUT).to(gl.float32)
            gl.thread_barrier()  # every warp has box b in registers: refill it
            if next_row < M:
                _load_box(desc, boxes, bars, b, next_row * sub_rows, BOX)
            idx = b * BOX * W + cols
            d = (gl.exp2(x * LOG2E - lse2) - gl.where(idx == target, 1.0, 0.0)) * g
            gl.store(dlogits_ptr + base + idx, d.to(dtype), mask=idx < V)
        row = next_row
        phase ^= 1


@gluon.jit
def _load_box(desc, boxes, bars, b: gl.constexpr, first_sub_row, BOX: gl.constexpr):
    """Box b of the row whose first sub-row is first_sub_row, by TMA into boxes[b]."""
    fence_async_shared()  # after the generic-proxy reads of the box it overwrites
    mbarrier.expect(bars.index(b), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [first_sub_row + b * BOX, 0], bars.index(b),
                                    boxes.index(b))


def cross_entropy_fwd_grad(logits: torch.Tensor, targets: torch.Tensor, count: torch.Tensor,
                           loss: torch.Tensor, dlogits: torch.Tensor, ignore_index: int) -> None:
    """logits: (M, V) as `fits` requires, targets: (M,) int64, count: () int64, the rows not
    ignored -> per-row loss into loss: (M,) fp32, and (softmax - onehot) / count (0 on
    ignored rows) into dlogits: (M, V), which may be the logits themselves."""
    M, V = logits.shape
    enable_device_descriptors()
    shape = launch_shape(logits)
    _ce_smem_kernel[(max(min(M, shape.ctas_per_sm * sm_count(logits.device)), 1),)](
        logits, targets, count, loss, dlogits, M, V, ignore_index, NB=shape.boxes(V),
        BOX=shape.box, WARPS=shape.warps, num_warps=shape.warps, maxnreg=shape.maxnreg)
