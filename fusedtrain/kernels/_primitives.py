"""Triton-language helpers every kernel family uses: reductions, a sigmoid, special-function
instructions with interpreter twins, tile pointers.

Kernels here use Triton's builtins only, never triton.language's own @jit helpers
(tl.sum, tl.max, tl.zeros, tl.sigmoid, tl.cdiv, ...): when triton was imported
before TRITON_INTERPRET was set (torch and lightning import it), those stay
compiled-mode functions that the interpreter cannot call. The few we need are
re-stated below on top of builtins (tl.reduce, tl.full, tl.exp); under the
interpreter the reductions pass tl.sum's / tl.max's own combine functions to tl.reduce.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET


def device_fn(fn):
    """@triton.jit for helpers called from kernels. Under the interpreter the helper
    becomes its rewritten Python function: the interpreter would otherwise re-patch
    triton.language on every helper call, which dominates its run time."""
    jitted = triton.jit(fn)
    return jitted.rewrite() if INTERPRET else jitted


# Helpers the kernels call are bound to their own function's name: torch.compile's Inductor
# re-emits a user kernel's helpers from their source under that name (a kernel registered
# through torch.library.triton_op), so an alias such as `x = _other` would be undefined
# there. Where the GPU and the interpreter take different forms, each mode defines it.
if INTERPRET:
    # tl.sum's and tl.max's own combine functions, which the interpreter recognises and
    # reduces with numpy instead of element by element.
    from triton.language.standard import _elementwise_max as _max_combine
    from triton.language.standard import _sum_combine
else:
    @triton.jit
    def _sum_combine(a, b):
        return a + b

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)


@device_fn
def row_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _sum_combine)


@device_fn
def row_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _max_combine)


@device_fn
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@device_fn
def cdiv(a, b):
    return (a + b - 1) // b


@device_fn
def tanh(x):
    """tanh of x (fp32 or fp64) to its dtype's precision, as 1 - 2 / (exp(2x) + 1): exact
    at the limits (exp overflowing to inf gives 1), for gradients checked in fp64."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@device_fn
def tanh_approx(x):
    """tanh of fp32 x in one special-function-unit instruction (NVIDIA GPUs only)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)




if INTERPRET:
    @device_fn
    def sin_cos(x):
        return tl.sin(x), tl.cos(x)

    @device_fn
    def reciprocal(x):
        return 1.0 / x

    @device_fn
    def mul_rounded(a, b):  # the interpreter's numpy never fuses a product into an add
        return a * b
else:
    @device_fn
    def sin_cos(x):
        """(sin x, cos x). fp32 x: reduced to [-pi, pi] by x - k 2pi, 2pi as two fp32 parts
        (error ~1e-7 for |x| up to 1e5), then one special-function-unit instruction each
        (absolute error 2^-20.5 there); libdevice's sinf and cosf, which tl.sin and tl.cos
        call, cost ~40 instructions each and a local-memory slow path for large x. fp64 x:
        libdevice."""
        if x.dtype == tl.float64:
            return tl.sin(x), tl.cos(x)
        k = tl.floor(x * 0.15915494309189535 + 0.5)
        r = tl.fma(k, -6.2831854820251465, x)  # fp32(2 pi), 1.75e-7 above 2 pi
        r = tl.fma(k, 1.7484556e-07, r)
        s = tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=f,f", [r],
                                      dtype=tl.float32, is_pure=True, pack=1)
        c = tl.inline_asm_elementwise("cos.approx.ftz.f32 $0, $1;", "=f,f", [r],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return s, c

    @device_fn
    def reciprocal(x):
        """1 / x of fp32 x in one special-function-unit instruction (relative error 1
        ulp; an IEEE division is a rcp plus a Newton step, a check and a slow path)."""
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @device_fn
    def mul_rounded(a, b):
        """a * b in fp32, rounded on its own: PTX's mul.rn is never contracted into an FMA
        with a later addition, as a plain product may be, so the result is the bits that
        multiplying in a separate pass (PyTorch's) stores."""
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)


@device_fn
def tile_ptrs(ptr, offs_m, offs_n, s_m, s_n):
    """Pointers of a (rows, cols) tile of a strided 2-D tensor, int64 offsets."""
    return ptr + offs_m.to(tl.int64)[:, None] * s_m + offs_n.to(tl.int64)[None, :] * s_n


@device_fn
def pick3(i, p0, p1, p2):
    """p0, p1 or p2 by a run-time index i in {0, 1, 2} (e.g. q, k or v)."""
    return tl.where(i == 0, p0, tl.where(i == 1, p1, p2))
