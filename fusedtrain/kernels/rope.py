"""Rotary position embedding (RoPE, the "rotate half" form of transformers' Llama): each
head's dims d and d + D/2 rotated by the angle p * base ** (-2d / D) of the token's position p.

  rope  out[d] = x[d] cos - x[d + D/2] sin, out[d + D/2] = x[d + D/2] cos + x[d] sin; with
        INVERSE the rotation by -angle, its own backward (the rotation is orthogonal).

x: (B, H, T, D) with unit stride in d, any other strides; out likewise. Angles, cos, sin
(_primitives.sin_cos) and the rotation in fp32 (fp64 for fp64 x), rounded once. One
program a block of tokens of one head.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fusedtrain.kernels._device import acc_dtype, ceil_div, next_pow2, stat_dtype
from fusedtrain.kernels._launch import fast_launch, mark_constant, tracing
from fusedtrain.kernels._primitives import sin_cos

_BLOCK_T = 32


@fast_launch
@triton.jit
def _rope_kernel(x_ptr, pos_ptr, freq_ptr, o_ptr, N, T, HALF, s_xb, s_xh, s_xt, s_ob, s_oh,
                 s_ot, POSITIONS: tl.constexpr, INVERSE: tl.constexpr, ACC: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = (tokens < N)[:, None] & (d < HALF)[None, :]
    b, t = (tokens // T).to(tl.int64), (tokens % T).to(tl.int64)
    p = tl.load(pos_ptr + tokens, mask=tokens < N, other=0) if POSITIONS else t
    p = p.to(ACC)
    inv_freq = tl.load(freq_ptr + d, mask=d < HALF, other=0.0)
    angle = p[:, None] * inv_freq[None, :]
    sin, cos = sin_cos(angle)
    if INVERSE:
        sin = -sin
    x_row = (x_ptr + b * s_xb + t * s_xt + head * s_xh)[:, None] + d[None, :]
    x1 = tl.load(x_row, mask=ok, other=0.0).to(ACC)
    x2 = tl.load(x_row + HALF, mask=ok, other=0.0).to(ACC)
    o_row = (o_ptr + b * s_ob + t * s_ot + head * s_oh)[:, None] + d[None, :]
    tl.store(o_row, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=ok)
    tl.store(o_row + HALF, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=ok)


def _inv_freq(head_dim: int, base: float, device: torch.device, dtype: torch.dtype
              ) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)


@functools.lru_cache(maxsize=16)
def _inv_freq_cached(head_dim: int, base: float, device: torch.device, dtype: torch.dtype
                     ) -> torch.Tensor:
    return mark_constant(_inv_freq(head_dim, base, device, dtype))


def inv_freq(head_dim: int, base: float, device: torch.device, dtype: torch.dtype
             ) -> torch.Tensor:
    """(D/2,) base ** (-2d / D) in dtype (fp32, or fp64), as transformers' Llama computes it:
    1 / base ** (arange(0, D, 2) / D). Cached, except while traced for torch.compile, where
    it is a traced tensor that must not outlive its graph."""
    make = _inv_freq if tracing() else _inv_freq_cached
    return make(head_dim, float(base), device, dtype)


def rope(x: torch.Tensor, base: float, positions: torch.Tensor | None = None,
         inverse: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: (B, H, T, D), D even -> the rotated x: (B, H, T, D), written into `out` (unit
    stride in d) if given, else in x's layout where it is dense (a (B, T, H, D) tensor's
    view stays one), else contiguous. positions: (B, T) ints, default t along each row."""
    B, H, T, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty_like(x)
    pos = x if positions is None else positions.contiguous()  # not read without positions
    _rope_kernel[(ceil_div(B * T, _BLOCK_T), H)](
        x, pos, inv_freq(D, base, x.device, stat_dtype(x)),
        out, B * T, T, D // 2, x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2), POSITIONS=positions is not None,
        INVERSE=inverse, ACC=acc_dtype(x), BLOCK_T=_BLOCK_T, BLOCK_D=next_pow2(max(D // 2, 1)))
    return out
