"""Input checks shared by the ops: errors name the argument; autocast handling."""

from __future__ import annotations

import torch

from fusedtrain.casts import autocast_dtype
from fusedtrain.kernels._device import SUPPORTED_DTYPES

GELU_FORMS = ("none", "tanh")


# Resolved once at import, not behind a cache: torch.compile traces check_tensor, and would
# warn about (and re-trace) a cached function.
if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor as _DTensor
else:
    _DTensor = ()


def check_tensor(name: str, t, *, ndim: int | None = None, min_ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(t, _DTensor):
        # FSDP and DDP hand the ops plain tensors; a DTensor arrives only under tensor
        # parallelism, where a kernel would see one shard and silently compute on it.
        raise TypeError(f"{name} is a DTensor (sharded): the fused ops take local tensors; "
                        f"pass {name}.full_tensor() or .to_local(), or use the eager path")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64"
        )
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}"
        )


def check_same(ref_name: str, ref: torch.Tensor, same_dtype: bool = True,
               **others: torch.Tensor | None) -> None:
    """Every given tensor has ref's device and (with same_dtype) dtype."""
    for name, t in others.items():
        if t is None:
            continue
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
        if same_dtype and t.dtype != ref.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 wname: str, bname: str, in_features: int, same_dtype: bool = True) -> None:
    """weight (N, in_features) and bias (N,) (or None) of a linear layer fed x, all on
    x's device and (with same_dtype) of its dtype; errors name the argument."""
    check_tensor(wname, weight, ndim=2)
    check_same("x", x, same_dtype, **{wname: weight, bname: bias})
    if weight.shape[1] != in_features:
        raise ValueError(
            f"{wname} has shape {tuple(weight.shape)}: expected (N, {in_features}) to match "
            f"the input's last dimension {in_features}"
        )
    if bias is not None:
        check_tensor(bname, bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"{bname} has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)"
            )


def check_index_tensor(name: str, t, what: str) -> None:
    """t holds integer ids (`what` names them in the error)."""
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() \
            or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of {what}")


def check_approximate(approximate: str) -> None:
    if approximate not in GELU_FORMS:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def autocast_cast(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Under autocast, cast floating inputs to the autocast dtype (as F.linear does);
    otherwise return them unchanged. Gradients flow back through the casts."""
    first = next(t for t in tensors if t is not None)
    dt = autocast_dtype(first) if isinstance(first, torch.Tensor) else None
    if dt is None:
        return tensors
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for t in tensors)


def autocast_params(x: torch.Tensor,
                    *params: torch.Tensor | None) -> tuple[torch.Tensor, torch.dtype | None]:
    """(x, compute dtype) for an op whose autograd.Function casts its parameters itself
    (fusedtrain.casts.cast_params) and returns their gradients in their own dtypes. Under
    autocast: x cast to the autocast dtype, and that dtype if some parameter has another;
    otherwise x unchanged and None (the parameters are used as they are)."""
    dt = autocast_dtype(x)
    if dt is None:
        return x, None
    if x.is_floating_point():
        x = x.to(dt)
    if all(p is None or p.dtype == dt or not p.is_floating_point() for p in params):
        return x, None
    return x, dt
