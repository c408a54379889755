"""Differentiable rotary position embedding over the Triton kernel: x (B, H, T, D) -> x
rotated by its tokens' positions (transformers' Llama "rotate half" convention)."""

from __future__ import annotations

import math

import torch

from fusedtrain.kernels import rope as K
from fusedtrain.ops._registry import function_apply, launcher
from fusedtrain.ops._validate import check_index_tensor, check_same, check_tensor

Tensor = torch.Tensor


@launcher("rope", traceable=True)
def _rope(x: Tensor, base: float, positions: Tensor | None, inverse: bool) -> Tensor:
    return K.rope(x, base, positions, inverse)


@_rope.register_fake
def _(x, base, positions, inverse):
    return torch.empty_like(x if x.stride(-1) == 1 else x.contiguous())


class RotaryFunction(torch.autograd.Function):
    """Saves the positions only: the backward is the rotation by the opposite angles."""

    @staticmethod
    def forward(ctx, x: Tensor, base: float, positions: Tensor | None):
        ctx.save_for_backward(positions)
        ctx.base = base
        return _rope(x, base, positions, False)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (positions,) = ctx.saved_tensors
        return _rope(dy, ctx.base, positions, True), None, None


_apply_rotary = function_apply(RotaryFunction)


def checked_rope(base, positions: Tensor | None, B: int, T: int, D: int, ref: Tensor) -> float:
    """Rotary arguments for (B, H, T, D) inputs on ref's device (ValueError/TypeError
    naming them); the base as a float."""
    if D % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got D={D}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not (
            1 < base < math.inf):
        raise ValueError(f"rope_base must be a finite number > 1, got {base!r}")
    if positions is not None:
        check_index_tensor("positions", positions, "positions")
        if tuple(positions.shape) != (B, T):
            raise ValueError(f"positions must have shape (B, T) = ({B}, {T}), got "
                             f"{tuple(positions.shape)}")
        check_same("x", ref, same_dtype=False, positions=positions)
    return float(base)


def rotary(x: Tensor, base: float, positions: Tensor | None = None) -> Tensor:
    """x: (B, H, T, D), D even -> x with dims d and d + D/2 of each head rotated by the
    angle p * base ** (-2d / D), p = positions[b, t] ((B, T) ints; default t):
    out[d] = x[d] cos - x[d + D/2] sin, out[d + D/2] = x[d + D/2] cos + x[d] sin.
    Computed in fp32 (fp64 for fp64 x); the output keeps x's layout where x is dense."""
    check_tensor("x", x, ndim=4)
    B, _, T, D = x.shape
    base = checked_rope(base, positions, B, T, D, x)
    if x.numel() == 0:
        return x.clone()
    return _apply_rotary(x, base, positions)
