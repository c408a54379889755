"""AdamW over many parameters in one launch, also writing each parameter's low-precision
copy (the weights the next forward's GEMMs read under autocast).

Why: under bf16 autocast every step casts the fp32 weights to bf16 before the forward
(6 bytes a parameter read and written), right after the optimizer has read and written
them (28 bytes). Written by the optimizer's pass, the copy costs 2 bytes a parameter.

Layout: the tensors are described by a device table of int64 rows (param, grad, exp_avg,
exp_avg_sq, copy addresses, numel), one per tensor, and the work by (tensor row, first
element) chunks of CHUNK elements, one program each. Parameters and moments are fp32;
gradients fp32; the copy any float dtype. The step count lives on the device (one fp32
scalar, incremented by the caller), so a captured step replays with the right bias
corrections.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._launch import fast_launch
from fusedtrain.kernels._primitives import mul_rounded

# Elements a program updates (several BLOCK sweeps) and a sweep's width, at 4 warps: on an
# H200 938 us for GPT-2's 124M parameters with their copies, against 1099 us at 32768 / 2048
# / 8 warps (docs/journal.md).
CHUNK = 8192 if INTERPRET else 16384
BLOCK = 1024
TABLE_COLUMNS = tl.constexpr(6)  # param, grad, exp_avg, exp_avg_sq, copy, numel

_TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                torch.float32: tl.float32}
COPY_DTYPES = tuple(_TORCH_TO_TL)


@triton.jit
def _address(row_ptr, column: tl.constexpr, dtype: tl.constexpr):
    """Column `column` of a tensor's table row as a pointer to `dtype`, 16-byte aligned
    (every tensor here starts at an allocation aligned at least that far)."""
    return tl.multiple_of(tl.load(row_ptr + column).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _update(p_ptr, g_ptr, m_ptr, v_ptr, copy_ptr, offs, mask, grad_scale, beta1, beta2, eps,
            step_size, bc2_sqrt, decay, COPY: tl.constexpr, COPY_DTYPE: tl.constexpr,
            SCALE: tl.constexpr):
    """torch.optim.AdamW's update of the elements at offs from the gradients (times
    grad_scale if SCALE): decoupled decay, moments, bias-corrected step; and the
    parameter's copy."""
    g = tl.load(g_ptr + offs, mask=mask)
    if SCALE:  # rounded before the update, as clipping's own pass would store it
        g = mul_rounded(g, grad_scale)
    p = tl.load(p_ptr + offs, mask=mask) * decay
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if COPY:
        tl.store(copy_ptr + offs, p.to(COPY_DTYPE, fp_downcast_rounding="rtne"), mask=mask)


@fast_launch
@triton.jit
def _adamw_kernel(table_ptr, chunk_ptr, step_ptr, scale_ptr, lr, beta1, beta2, log2_beta1,
                  log2_beta2, eps, weight_decay, COPY: tl.constexpr,
                  COPY_DTYPE: tl.constexpr, SCALE: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):
    # Chunk c covers elements [first, first + CHUNK) of tensor `row` (masked at its end).
    c = tl.program_id(0)
    row = tl.load(chunk_ptr + 2 * c)
    first = tl.load(chunk_ptr + 2 * c + 1)
    row_ptr = table_ptr + row * TABLE_COLUMNS
    p_ptr = _address(row_ptr, 0, tl.float32)
    g_ptr = _address(row_ptr, 1, tl.float32)
    m_ptr = _address(row_ptr, 2, tl.float32)
    v_ptr = _address(row_ptr, 3, tl.float32)
    copy_ptr = _address(row_ptr, 4, COPY_DTYPE)
    numel = tl.load(row_ptr + 5)
    # Bias corrections 1 - beta^step, step counted from 1 (after the caller's increment).
    step = tl.load(step_ptr)
    step_size = lr / (1.0 - tl.exp2(step * log2_beta1))
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    decay = 1.0 - lr * weight_decay
    grad_scale = tl.load(scale_ptr) if SCALE else 1.0
    for start in tl.range(first, first + CHUNK, BLOCK):
        # Chunks start at multiples of CHUNK: runs of BLOCK aligned elements.
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        if start + BLOCK <= numel:  # whole blocks unmasked: 16-byte accesses
            _update(p_ptr, g_ptr, m_ptr, v_ptr, copy_ptr, offs, None, grad_scale, beta1,
                    beta2, eps, step_size, bc2_sqrt, decay, COPY, COPY_DTYPE, SCALE)
        elif start < numel:
            _update(p_ptr, g_ptr, m_ptr, v_ptr, copy_ptr, offs, offs < numel, grad_scale,
                    beta1, beta2, eps, step_size, bc2_sqrt, decay, COPY, COPY_DTYPE, SCALE)


def tensor_table(params: list[torch.Tensor], grads: list[torch.Tensor],
                 exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 copies: list[torch.Tensor] | None) -> list[int]:
    """The kernel's table rows, flattened: addresses and numel per tensor (a parameter's
    own address stands in for a missing copy: never written then)."""
    rows = []
    for i, p in enumerate(params):
        copy = copies[i] if copies is not None else p
        rows += [p.data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr(),
                 exp_avg_sqs[i].data_ptr(), copy.data_ptr(), p.numel()]
    return rows


def chunk_table(numels: list[int], device: torch.device) -> torch.Tensor:
    """(chunks, 2) int64 on `device`: (tensor row, first element) of every CHUNK."""
    chunks = [(i, start) for i, n in enumerate(numels) for start in range(0, n, CHUNK)]
    return torch.tensor(chunks, dtype=torch.int64).to(device)


def adamw_step(table: torch.Tensor, chunks: torch.Tensor, step: torch.Tensor, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float,
               copy_dtype: torch.dtype | None, grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW step over the tensors of `table` ((tensors, TABLE_COLUMNS) int64, see
    tensor_table) in place; `step`: fp32 scalar tensor, the step being taken (1 first);
    `grad_scale`: an fp32 scalar tensor on the same device that every gradient is
    multiplied by as it is read (the gradients themselves are left as they are)."""
    if not 0.0 < beta1 < 1.0 or not 0.0 < beta2 < 1.0:
        raise ValueError(f"betas must lie in (0, 1), got ({beta1}, {beta2})")

    _adamw_kernel[(chunks.shape[0],)](
        table, chunks, step, step if grad_scale is None else grad_scale, lr, beta1, beta2,
        math.log2(beta1), math.log2(beta2), eps, weight_decay, COPY=copy_dtype is not None,
        COPY_DTYPE=_TORCH_TO_TL[copy_dtype or torch.float32], SCALE=grad_scale is not None,
        CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
