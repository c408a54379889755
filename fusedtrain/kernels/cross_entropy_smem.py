"""Cross-entropy's loss and logit gradient in one pass, each row of logits held in shared
memory: a Gluon kernel for Hopper (sm_90).

Why: the loss needs a row's logsumexp before any of its gradient can be written, so the
Triton kernels read the logits twice, once in the loss's kernel and again in the
gradient's (4.95 GB of HBM traffic at GPT-2's 16384 x 50304 bf16 logits, ~1.24 ms on an
H200). Re-reading a row from L2 instead did not work out: few rows in flight do not keep
HBM busy, many evict each other (docs/perf-notes.md, nineteenth round). Here a CTA loads a
whole row (~100 KB) into shared memory by TMA, takes the logsumexp and the loss from it,
then writes the gradient from it: 3.3 GB of traffic. Two CTAs per SM overlap one row's
loads with the other's arithmetic.

The row is viewed as sub-rows of W = 64 logits (128 bytes: one TMA swizzle span), fetched
in NB boxes of BOX sub-rows; a box past the row's end reads the next row's first logits
(or zeros past the tensor), which the column mask drops. Taken where `fits` says so
(kernels.cross_entropy.cross_entropy_fwd_grad); Gluon kernels do not run under the
interpreter, so the Triton kernels are the CPU path and the reference these are tested
against on the GPU.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from fusedtrain.kernels._common import sm_count
from fusedtrain.kernels._tma import enable_device_descriptors, ws_ok

W, BOX = gl.constexpr(64), gl.constexpr(128)
_WARPS = 4
_SMEM_PER_SM = 227 * 1024  # an H200 SM's shared memory for CTAs
LOG2E = gl.constexpr(1.4426950408889634)
# Each thread holds 8 consecutive logits (one 16-byte access) of a box's sub-rows.
ROW_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [_WARPS, 1], [1, 0]))


def _boxes(V: int) -> int:
    return triton.cdiv(V // W.value, BOX.value)


def _ctas_per_sm(V: int) -> int:
    return _SMEM_PER_SM // (_boxes(V) * BOX.value * W.value * 2 + 1024)


def fits(logits: torch.Tensor) -> bool:
    """Whether the kernel takes these (M, V) logits: contiguous 16-bit rows that are whole
    sub-rows (V % 64 == 0), two rows of them in an SM's shared memory, on an sm_90 GPU with
    the triton release the Gluon kernels are written for (kernels._tma.ws_ok)."""
    V = logits.shape[1]
    return (ws_ok(logits) and logits.is_contiguous() and V % W.value == 0
            and _ctas_per_sm(V) >= 2)


@gluon.jit
def _ce_smem_kernel(logits_ptr, target_ptr, count_ptr, loss_ptr, dlogits_ptr, M, V,
                    ignore_index, NB: gl.constexpr):
    dtype: gl.constexpr = logits_ptr.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BOX, W], dtype)
    sub_rows = V // W
    desc = tma.make_tensor_descriptor(logits_ptr, [M * sub_rows, W], [W, 1], [BOX, W],
                                      smem_layout)
    boxes = gl.allocate_shared_memory(dtype, [NB, BOX, W], smem_layout)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NB):
        mbarrier.init(bars.index(b), count=1)
    # A box's logits, by their column in the row less the box's first (b * BOX * W).
    cols = (gl.arange(0, BOX, layout=gl.SliceLayout(1, ROW_LAYOUT))[:, None] * W
            + gl.arange(0, W, layout=gl.SliceLayout(0, ROW_LAYOUT))[None, :])
    inv_count = 1.0 / gl.load(count_ptr).to(gl.float32)  # inf if every row is ignored: g = 0
    phase = 0
    for row in range(gl.program_id(0), M, gl.num_programs(0)):
        for b in gl.static_range(NB):
            mbarrier.expect(bars.index(b), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row * sub_rows + b * BOX, 0], bars.index(b),
                                            boxes.index(b))
        target = gl.load(target_ptr + row)
        # Pass 1, in base 2: running maximum m, sum l of 2^(x log2(e) - m), and the target's
        # logit x_t (taken here: the row's memory is overwritten by pass 2).
        m = -float("inf")
        l = 0.0
        x_t = 0.0
        for b in gl.static_range(NB):
            mbarrier.wait(bars.index(b), phase)
            idx = b * BOX * W + cols
            x = boxes.index(b).load(ROW_LAYOUT).to(gl.float32)
            x_t += gl.sum(gl.sum(gl.where(idx == target, x, 0.0), axis=1), axis=0)
            x2 = gl.where(idx < V, x * LOG2E, -float("inf"))
            m_new = gl.maximum(m, gl.max(gl.max(x2, axis=1), axis=0))
            m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)  # only -inf so far
            l = l * gl.exp2(m - m_safe) + gl.sum(gl.sum(gl.exp2(x2 - m_safe), axis=1), axis=0)
            m = m_new
        lse2 = m + gl.log2(l)
        in_range = (target >= 0) & (target < V)
        loss = gl.where(in_range, lse2 / LOG2E - x_t, float("nan"))
        gl.store(loss_ptr + row, gl.where(target == ignore_index, 0.0, loss))
        # Pass 2: d = (softmax - onehot(target)) / count, over the logits' own memory.
        g = gl.where(target != ignore_index, inv_count, 0.0)
        out = dlogits_ptr + row.to(gl.int64) * V
        for b in gl.static_range(NB):
            idx = b * BOX * W + cols
            x = boxes.index(b).load(ROW_LAYOUT).to(gl.float32)
            d = (gl.exp2(x * LOG2E - lse2) - gl.where(idx == target, 1.0, 0.0)) * g
            gl.store(out + idx, d.to(dtype), mask=idx < V)
        # Every warp has read the row before the next row's TMA copies overwrite it.
        gl.thread_barrier()
        fence_async_shared()
        phase ^= 1


def cross_entropy_fwd_grad(logits: torch.Tensor, targets: torch.Tensor, count: torch.Tensor,
                           loss: torch.Tensor, dlogits: torch.Tensor, ignore_index: int) -> None:
    """logits: (M, V) as `fits` requires, targets: (M,) int64, count: () int64, the rows not
    ignored -> per-row loss into loss: (M,) fp32, and (softmax - onehot) / count (0 on
    ignored rows) into dlogits: (M, V), which may be the logits themselves."""
    M, V = logits.shape
    enable_device_descriptors()
    programs = min(M, _ctas_per_sm(V) * sm_count(logits.device))
    _ce_smem_kernel[(max(programs, 1),)](logits, targets, count, loss, dlogits, M, V,
                                         ignore_index, NB=_boxes(V), num_warps=_WARPS)
