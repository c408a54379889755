"""bfloat16 `tl.dot` under Triton's CPU interpreter.

The interpreter keeps bfloat16 tensors as their uint16 bit patterns, and its `tl.dot`
multiplies those patterns as integers (values near 1e10 for inputs near 1; bfloat16 is
unsupported there upstream, triton-lang/triton#11584). Widening bfloat16 operands to fp32
first gives what a GPU's tensor cores compute: exact products, summed in fp32.
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


def patch_bf16_dot() -> None:
    """Make the interpreter's tl.dot widen bfloat16 operands; repeated calls are free."""
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    create_dot = builder.create_dot

    def widening_create_dot(self, a, b, *args):
        return create_dot(self, _widened(a), _widened(b), *args)

    widening_create_dot.widens_bf16 = True
    builder.create_dot = widening_create_dot
