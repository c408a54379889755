"""GELU and its derivative inside kernels, in the exact forms and the cheaper 16-bit forms;
GeluMode, the APPROX constexpr that selects one."""

from __future__ import annotations

import enum

import torch
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._primitives import device_fn, reciprocal, sigmoid, tanh_approx

INV_SQRT2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
TANH_COEF = tl.constexpr(0.044715)
# The tanh form's z = sqrt(2/pi) (h + 0.044715 h^3) as h (sqrt(2/pi) + Z3 h^2), and its
# derivative dz/dh = sqrt(2/pi) + 3 Z3 h^2: one multiply-add on h^2 each.
Z3 = tl.constexpr(SQRT_2_OVER_PI.value * TANH_COEF.value)
Z3_DERIV = tl.constexpr(3 * Z3.value)



class GeluMode(enum.IntEnum):
    """A kernel's APPROX constexpr (passed as its int value): ERF and TANH are the exact
    forms of F.gelu's approximate="none" / "tanh"; FAST_TANH and FAST_ERF the cheaper forms
    16-bit data gets (see gelu_mode)."""

    ERF = 0
    TANH = 1
    FAST_TANH = 2  # the tanh form through tanh.approx
    FAST_ERF = 3  # the erf form through one exp2 and one reciprocal (see normal_cdf)


APPROXIMATIONS = {"none": GeluMode.ERF, "tanh": GeluMode.TANH}
# The fast forms as constexprs, for the kernels' comparisons.
FAST_TANH = tl.constexpr(int(GeluMode.FAST_TANH))
FAST_ERF = tl.constexpr(int(GeluMode.FAST_ERF))



def gelu_mode(approximate: str, data: torch.Tensor) -> int:
    """A kernel's APPROX constexpr (a GeluMode's value) for `approximate` on `data`: ERF,
    TANH, or, for
    16-bit data, a cheaper form whose error sits far below the output's rounding:
    FAST_TANH (on a GPU), where one tanh.approx.f32 (relative error about 2**-11) replaces
    an exp and a division, and FAST_ERF (GPU and interpreter), where normal_cdf's rational
    form (absolute error 1.5e-7) replaces the erf, which costs as much as the rest of a
    LayerNorm->GELU forward."""
    mode = APPROXIMATIONS[approximate]
    if data.element_size() != 2:
        return int(mode)
    if mode == GeluMode.ERF:
        return int(GeluMode.FAST_ERF)
    return int(mode if INTERPRET else GeluMode.FAST_TANH)


@device_fn
def _tanh_arg(h, h2):
    """z of the tanh form gelu(h) = 0.5 h (1 + tanh z), given h2 = h * h."""
    return h * (SQRT_2_OVER_PI + Z3 * h2)



# Abramowitz & Stegun 7.1.26: erfc(z) = t P(t) exp(-z^2) + e(z), t = 1 / (1 + p z), z >= 0,
# |e| <= 1.5e-7. Below z = |h| / sqrt 2, so p is pre-divided by sqrt 2, P's coefficients are
# pre-halved (the GELU wants erfc / 2) and exp(-h^2 / 2) is exp2(h^2 * AS_EXP2).
AS_P = tl.constexpr(0.3275911 * 0.7071067811865476)
AS_EXP2 = tl.constexpr(-0.5 * 1.4426950408889634)
AS_A1 = tl.constexpr(0.254829592 / 2)
AS_A2 = tl.constexpr(-0.284496736 / 2)
AS_A3 = tl.constexpr(1.421413741 / 2)
AS_A4 = tl.constexpr(-1.453152027 / 2)
AS_A5 = tl.constexpr(1.061405429 / 2)


@device_fn
def normal_cdf(h):
    """(Phi(h), exp(-h^2 / 2)) for FAST_ERF: the standard normal CDF from A&S's erfc form,
    which needs one exp2 and one reciprocal (two special-function instructions and ~12
    others) where erf's polynomials need several times the instructions.
    Phi(h) = erfc(-h / sqrt 2) / 2: for h < 0 the tail itself, no 1 - erf cancellation.
    The exp is returned for the derivative, phi(h) = exp(-h^2 / 2) / sqrt(2 pi)."""
    t = reciprocal(1.0 + AS_P * tl.abs(h))
    e = tl.exp2(h * h * AS_EXP2)
    half_erfc = t * (AS_A1 + t * (AS_A2 + t * (AS_A3 + t * (AS_A4 + t * AS_A5)))) * e
    return tl.where(h >= 0, 1.0 - half_erfc, half_erfc), e


@device_fn
def gelu(h, APPROX: tl.constexpr):
    """GELU of h (fp32 or fp64). APPROX=0: exact erf form; 1: tanh form, computed as
    h * sigmoid(2z) with z = sqrt(2/pi) (h + 0.044715 h^3), since 0.5 (1 + tanh z) = sigmoid(2z);
    FAST_TANH: the tanh form with tanh_approx; FAST_ERF: the erf form with normal_cdf."""
    if APPROX == FAST_TANH:  # 0.5 h + 0.5 h tanh z: five floating-point ops and a tanh
        half_h = 0.5 * h
        return half_h + half_h * tanh_approx(_tanh_arg(h, h * h))
    elif APPROX == FAST_ERF:
        cdf, _ = normal_cdf(h)
        return h * cdf
    elif APPROX:
        return h * sigmoid(2.0 * _tanh_arg(h, h * h))
    else:
        return 0.5 * h * (1.0 + tl.erf(h * INV_SQRT2))


@device_fn
def gelu_operand(a, APPROX: tl.constexpr, ACC: tl.constexpr):
    """gelu(a) of a 16-bit tile a (a GEMM operand, a stored pre-activation): computed in
    ACC, then rounded once to a's dtype. (Not in a's own 16-bit format, two values an
    instruction: that form's constants and intermediates, rounded to bf16, shifted every
    activation the same way, about -0.2% of their mean magnitude against eager's
    +0.01%, and the fused model's loss drifted above the eager one's within its first
    ~30 steps of training; docs/journal.md.)"""
    return gelu(a.to(ACC), APPROX).to(a.dtype)


@device_fn
def gelu_grad(h, APPROX: tl.constexpr):
    """d gelu(h) / dh, recomputed from the pre-activation h."""
    if APPROX == FAST_TANH:  # 0.5 (1 + t) + 0.5 h (1 - t^2) dz/dh, t = tanh z
        h2 = h * h
        t = tanh_approx(_tanh_arg(h, h2))
        return (0.5 + 0.5 * t) + (0.5 * h) * (SQRT_2_OVER_PI + Z3_DERIV * h2) * (1.0 - t * t)
    elif APPROX == FAST_ERF:
        cdf, e = normal_cdf(h)
        return cdf + h * INV_SQRT_2PI * e
    elif APPROX:
        h2 = h * h
        s = sigmoid(2.0 * _tanh_arg(h, h2))
        return s + h * s * (1.0 - s) * 2.0 * (SQRT_2_OVER_PI + Z3_DERIV * h2)
    else:
        cdf = 0.5 * (1.0 + tl.erf(h * INV_SQRT2))
        return cdf + h * INV_SQRT_2PI * tl.exp(-0.5 * h * h)
