"""The optimizer: its settings and schedule, which AdamW a run steps with (and whether it
writes weight copies for the fused ops), gradient clipping."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fusedtrain.optim import AdamW


@dataclass
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be positive, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at `total` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _foreach_supported(tensors: list[torch.Tensor]) -> bool:
    """torch's own test for its foreach kernels (private: where a torch release lacks it,
    clipping takes torch's public function instead of failing at import)."""
    try:
        from torch.utils._foreach_utils import _has_foreach_support
    except ImportError:
        return False
    return _has_foreach_support(tensors, tensors[0].device)


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float,
                   optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm, foreach) in its own three operations where
    every gradient has one device and dtype, the usual case: the same norms, coefficient
    and products, bit for bit, without its Python per gradient (a `.to()` each, two
    groupings by device and dtype): for GPT-2's 148 parameters (small CPU tensors, so that
    the Python shows) 0.6-0.8 ms a call against torch's 1.4-1.6. Anything else goes to
    torch's. With fusedtrain's AdamW as `optimizer`, the products are its next step's:
    it multiplies each gradient by the coefficient as it reads it (the same fp32 products;
    the .grad tensors are left unclipped), which saves a pass over the gradients (0.28 ms
    a GPT-2 step on an H200). Returns the total norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or len({(g.device, g.dtype) for g in grads}) > 1 \
            or not _foreach_supported(grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    if isinstance(optimizer, AdamW) and coefficient.dtype == torch.float32:
        optimizer.scale_gradients_in_step(coefficient)
    else:
        torch._foreach_mul_(grads, coefficient)
    return total


log = logging.getLogger("fusedtrain")
_announced: set[AdamWPlan] = set()

CAPTURES = ("none", "loss", "step", "inductor")


class AdamWPlan(NamedTuple):
    """Which AdamW a run steps with: fusedtrain's (`ours`, writing weight copies in
    `copy_dtype` or none) or torch's (`torch_fused`: its fused kernel; `capturable`)."""

    ours: bool
    copy_dtype: torch.dtype | None
    torch_fused: bool
    capturable: bool

    def describe(self) -> str:
        if self.ours:
            copies = (f"writing {str(self.copy_dtype).removeprefix('torch.')} weight copies "
                      "for the fused ops" if self.copy_dtype else "no weight copies")
            return f"fusedtrain AdamW (one kernel per parameter group), {copies}"
        return f"torch AdamW (fused={self.torch_fused}, capturable={self.capturable})"


def adamw_plan(*, fused_ops: bool, on_cuda: bool, precision: str, sharded: bool = False,
               capture: str = "none", optimizer: str = "auto") -> AdamWPlan:
    """The optimizer decision, made here for the Lightning loop and the benchmarks alike.
    `precision`: Lightning's name ("bf16-mixed", "16-mixed", "32-true", ...); `capture`:
    what a CUDA graph holds, "none", "loss" (the loss's forward and backward: the Lightning
    loop's cuda_graph=true), "step" (the whole step, optimizer included) or "inductor"
    (torch.compile's reduce-overhead graphs).

    - fusedtrain.optim.AdamW (one kernel per parameter group) where fused ops train on
      CUDA, unsharded (no copy of an FSDP shard is what an op reads), not under fp16 loss
      scaling (a fused step unscales after clipping has seen scaled gradients). Without
      copies its kernel still beats AdamW(fused=True): 872 against 1006 us for GPT-2 on an
      H200.
    - It also writes bf16 weight copies for the ops to read (fusedtrain.weight_copies)
      under bf16 autocast, unless a graph that does not hold the optimizer holds the ops:
      a replay reads the addresses captured, and the copies would go stale.
    - Otherwise, or with optimizer="torch" (a user's own loop, as a benchmark runs it),
      torch's AdamW, fused on CUDA (not under fp16 loss scaling), capturable when the
      whole step is a graph."""
    if capture not in CAPTURES:
        raise ValueError(f"capture must be one of {CAPTURES}, got {capture!r}")
    if optimizer not in ("auto", "torch"):
        raise ValueError(f"optimizer must be 'auto' or 'torch', got {optimizer!r}")
    torch_fused = on_cuda and precision != "16-mixed"
    ours = fused_ops and torch_fused and not sharded and optimizer == "auto"
    copies = ours and precision == "bf16-mixed" and capture in ("none", "step")
    return AdamWPlan(ours, torch.bfloat16 if copies else None, torch_fused,
                     capturable=capture == "step")


def build_optimizer(params, plan: AdamWPlan, *, lr: float,
                    betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """The AdamW of `plan` over `params` (parameters or parameter groups); each distinct
    plan is logged once."""
    if plan not in _announced:
        _announced.add(plan)
        log.info("optimizer: %s", plan.describe())
    if plan.ours:
        return AdamW(params, lr=lr, betas=betas, copy_dtype=plan.copy_dtype)
    return torch.optim.AdamW(params, lr=lr, betas=betas, fused=plan.torch_fused,
                             capturable=plan.capturable)
