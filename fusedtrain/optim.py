"""AdamW whose step also writes the weights the next forward reads (kernels.adamw).

`AdamW` is torch.optim.AdamW (same hyperparameters, state, checkpoints) with its step run
by one Triton launch per parameter group that also writes each parameter's copy in
`copy_dtype`, the autocast dtype. The copies are published to fusedtrain.weight_copies,
so the fused ops read them instead of casting the fp32 weights again: at GPT-2's size 2
bytes a parameter written in the optimizer's pass against 6 read and written by the casts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels import adamw as kernel
from fusedtrain.weight_copies import WEIGHT_COPIES

# Tables kept per optimizer, one per set of addresses seen lately; those made while a
# CUDA graph was captured are kept for good: a replay re-copies its table from the pinned
# host buffer it was made from.
_TABLES_KEPT = 8


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step also writes every parameter's `copy_dtype` copy (None:
    no copies) and publishes it (fusedtrain.weight_copies).

    Runs where Triton does (CUDA; CPU under the interpreter) for contiguous, 16-byte
    aligned fp32 parameters and gradients with the plain options; with torch's others
    (`options`: amsgrad, maximize, differentiable; or a tensor lr) or other parameters,
    each step is torch's own, without copies. A group's step count is one device tensor
    shared by its parameters' states (they advance together), so that a step captured in
    a CUDA graph replays with the right bias corrections.

    A copy stays in use while its parameter's version counter and storage are unchanged:
    change a parameter in place through the parameter itself (as load_state_dict and
    torch.nn.init do), not through `p.data`, whose changes no counter sees."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, copy_dtype: torch.dtype | None = torch.bfloat16,
                 **options):
        if copy_dtype not in (None, *kernel.COPY_DTYPES):
            raise ValueError(f"copy_dtype must be None or one of {kernel.COPY_DTYPES}, "
                             f"got {copy_dtype}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         **options)
        if "capturable" not in options:
            # The shared step tensor lives on the device: torch's own step (for the options
            # the kernel lacks) then reads it there instead of syncing once a parameter.
            for group in self.param_groups:
                group["capturable"] = all(p.is_cuda for p in group["params"])
        self.copy_dtype = copy_dtype
        self._tables: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._chunks: dict[tuple, torch.Tensor] = {}  # (device, numels) -> chunk table
        self._copies: dict[int, torch.Tensor] = {}
        self._fitting: tuple | None = None  # the parameters' addresses when they last fit
        self._captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._grad_scale: torch.Tensor | None = None  # for the next step only

    def scale_gradients_in_step(self, scale: torch.Tensor) -> None:
        """Make the next step use every gradient times `scale` (a 0-dim fp32 tensor on
        the parameters' device, e.g. gradient clipping's coefficient), multiplied as the
        kernel reads it instead of by a pass of its own over the gradients: at GPT-2's
        size 1 GB of traffic less a step. The .grad tensors keep their unscaled values
        (a step through torch's own AdamW scales them in place first)."""
        if scale.dtype != torch.float32 or scale.dim() != 0:
            raise ValueError(f"scale must be a 0-dim float32 tensor, got {scale.dtype} "
                             f"of shape {tuple(scale.shape)}")
        self._grad_scale = scale

    def _runs_here(self) -> bool:
        """Whether every group steps through the kernel (see the class docstring)."""
        for group in self.param_groups:
            if (group["amsgrad"] or group["maximize"] or group["differentiable"]
                    or isinstance(group["lr"], torch.Tensor)
                    or not all(0.0 < b < 1.0 for b in group["betas"])):  # logs of betas
                return False
        if not self._params_fit():
            return False
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad  # the kernel's loads: fp32, dense, 16-byte aligned
                if g is not None and (g.dtype != torch.float32 or g.is_sparse
                                      or not g.is_contiguous() or g.data_ptr() % 16):
                    return False
        return True

    def _params_fit(self) -> bool:
        """Whether every parameter is one the kernel takes, checked again only when one
        moves (the checks cost more host time than the step's launch)."""
        key = tuple(p.data_ptr() for group in self.param_groups for p in group["params"])
        if key != self._fitting:
            fit = all(p.dtype == torch.float32 and p.is_contiguous() and p.data_ptr() % 16 == 0
                      and (p.is_cuda or (INTERPRET and p.device.type == "cpu"))
                      and p.device == group["params"][0].device  # one table per group
                      for group in self.param_groups for p in group["params"])
            self._fitting = key if fit else None
        return self._fitting is not None

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:  # first: it makes the gradients that decide the path
            with torch.enable_grad():
                loss = closure()
        scale, self._grad_scale = self._grad_scale, None
        if not self._runs_here():
            if scale is not None:  # rare (torch's options): a product per gradient
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(scale.to(p.grad.device))
            super().step()
            return loss
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params, scale)
        return loss

    def _state(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The group's shared step tensor (fp32, on the parameters' device), its
        parameters' moments made where missing."""
        first = self.state[params[0]]
        step = first.get("step", 0.0)
        if (not isinstance(step, torch.Tensor) or step.device != params[0].device
                or step.dtype != torch.float32):
            step = torch.tensor(float(step), dtype=torch.float32, device=params[0].device)
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = step  # one tensor: a loaded checkpoint gives each its own
        return step

    def _copy(self, p: torch.Tensor) -> torch.Tensor | None:
        if self.copy_dtype is None:
            return None
        copy = self._copies.get(id(p))
        if copy is None or copy.shape != p.shape or copy.device != p.device:
            copy = self._copies[id(p)] = torch.empty_like(p, dtype=self.copy_dtype)
        return copy

    def _table(self, params, grads, moments, copies) -> torch.Tensor:
        """The kernel's tensor table on the parameters' device, made once per set of
        addresses (gradients move between steps unless the step is a graph's replay;
        moments, when a checkpoint is loaded)."""
        key = tuple(t.data_ptr() for t in (*params, *grads, *moments[0], *moments[1],
                                           *(copies or ())))
        table = self._tables.get(key)
        if table is None:
            rows = torch.tensor(kernel.tensor_table(params, grads, *moments, copies),
                                dtype=torch.int64).view(-1, kernel.TABLE_COLUMNS.value)
            if params[0].is_cuda:  # a pinned source: copied asynchronously, capturable
                rows = rows.pin_memory()
            table = (rows, rows.to(params[0].device, non_blocking=True))
            self._tables[key] = table
            if params[0].is_cuda and torch.cuda.is_current_stream_capturing():
                self._captured.append(table)  # its graph re-copies it on every replay
            if len(self._tables) > _TABLES_KEPT:
                self._tables.popitem(last=False)
        return table[1]

    def _step_group(self, group: dict, params: list[torch.Tensor],
                    scale: torch.Tensor | None) -> None:
        step = self._state(params)
        grads = [p.grad for p in params]
        moments = ([self.state[p]["exp_avg"] for p in params],
                   [self.state[p]["exp_avg_sq"] for p in params])
        copies = [self._copy(p) for p in params] if self.copy_dtype is not None else None
        numels = tuple(p.numel() for p in params)
        chunks = self._chunks.get((params[0].device, numels))
        if chunks is None:
            chunks = kernel.chunk_table(list(numels), params[0].device)
            self._chunks[(params[0].device, numels)] = chunks
        step.add_(1)
        beta1, beta2 = group["betas"]
        kernel.adamw_step(self._table(params, grads, moments, copies), chunks, step,
                          group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                          self.copy_dtype,
                          None if scale is None else scale.to(params[0].device))
        if copies is not None:
            WEIGHT_COPIES.publish(params, copies)
