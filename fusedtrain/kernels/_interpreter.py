"""bfloat16 under Triton's CPU interpreter: `tl.dot` and the fp32 -> bf16 cast.

The interpreter keeps bfloat16 tensors as their uint16 bit patterns, and its `tl.dot`
multiplies those patterns as integers (values near 1e10 for inputs near 1; bfloat16 is
unsupported there upstream, triton-lang/triton#11584). Widening bfloat16 operands to fp32
first gives what a GPU's tensor cores compute: exact products, summed in fp32.

Its fp32 -> bf16 cast (`.to(tl.bfloat16)`, and a store of fp32 values to bf16 memory)
drops the low 16 bits, where a GPU (cvt.rn.bf16.f32) and PyTorch round to nearest, ties
to even: on the CPU every bf16 output was up to one unit in the last place off, biased
toward zero. Rounded here as the GPU does.
"""

from __future__ import annotations

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def _widened(operand: interpreter.TensorHandle) -> interpreter.TensorHandle:
    if operand.dtype.scalar != tl.bfloat16:
        return operand
    bits = operand.data.astype(np.uint32) << 16  # bf16 is fp32's upper half
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)


def _bf16_round_to_nearest(value: interpreter.TensorHandle) -> interpreter.TensorHandle:
    """fp32 -> bf16 bits, rounded to nearest, ties to even (overflow to inf by the carry;
    NaN stays a quiet NaN of its sign)."""
    bits = value.data.astype(np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16)
    nan = np.isnan(value.data)
    rounded = np.where(nan, (bits >> 16) | np.uint32(0x0040), rounded).astype(np.uint16)
    return interpreter.TensorHandle(rounded, tl.bfloat16)


def patch_bf16() -> None:
    """Make the interpreter's tl.dot widen bfloat16 operands and its fp32 -> bf16 casts
    round to nearest even; repeated calls are free."""
    _widen_bf16_dot()
    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "rounds_bf16", False):
        return
    cast_impl = builder.cast_impl

    def rounding_cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return _bf16_round_to_nearest(src)
        return cast_impl(self, src, dst_type)

    rounding_cast_impl.rounds_bf16 = True
    builder.cast_impl = rounding_cast_impl


def _widen_bf16_dot() -> None:
    """Make the interpreter's tl.dot widen bfloat16 operands; repeated calls are free."""
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    create_dot = builder.create_dot

    def widening_create_dot(self, a, b, *args):
        return create_dot(self, _widened(a), _widened(b), *args)

    widening_create_dot.widens_bf16 = True
    builder.create_dot = widening_create_dot
