"""LightningModule: next-token loss, AdamW with warmup + cosine, throughput and MFU."""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import random
import time
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from fusedtrain.graph_chain import GraphChain
from fusedtrain.model import GPT, GPTConfig
from fusedtrain.ops import register_inductor_fallbacks
from fusedtrain.optim import AdamW

# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment, for MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


@functools.cache
def peak_flops(device: torch.device | None = None) -> tuple[str, float] | None:
    """(device name, dense bf16 peak) for a known CUDA GPU, else None."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return name, flops
    return None


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


def _distributed() -> bool:
    """Whether this process is one of a torch.distributed group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


class _Stage(torch.nn.Module):
    """One piece of the loss for GraphChain: `fn`, with the modules whose parameters it
    uses registered here, so that the piece's graphs take those parameters as inputs and
    return their gradients."""

    def __init__(self, fn, *modules: torch.nn.Module):
        super().__init__()
        self.fn = fn
        self.parts = torch.nn.ModuleList(modules)

    def forward(self, *args: torch.Tensor):
        return self.fn(*args)


class _GraphedLoss:
    """model.loss as CUDA graphs (GraphChain), a forward and a backward graph per piece.
    In pieces (`split`: the embedding, each block, the head and loss) the gradients of a
    block reach autograd (and DDP's all-reduce hooks) as soon as that block's backward
    has run, while earlier blocks' backward graphs still replay: communication overlaps
    compute. Unsplit (one process), the whole loss is one piece."""

    def __init__(self, model: GPT, idx: torch.Tensor, targets: torch.Tensor, split: bool):
        tr = model.transformer
        if split:
            self.pieces = [_Stage(model.embed, tr.wte, tr.wpe),
                           *(_Stage(block, block) for block in tr.h),
                           _Stage(model.head_loss, tr.ln_f, tr.wte)]
        else:
            self.pieces = [_Stage(model.loss, model)]
        self.chain = GraphChain(self.pieces, self._extras(idx, targets))

    def _extras(self, idx: torch.Tensor, targets: torch.Tensor) -> list[tuple]:
        """The caller's inputs of each piece: the tokens to the first, the targets to the
        last (first among its inputs), nothing to the others."""
        if len(self.pieces) == 1:
            return [(idx, targets)]
        return [(idx,), *([()] * (len(self.pieces) - 2)), (targets,)]

    def __call__(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        (loss,) = self.chain(*self._extras(idx, targets))
        return loss


class GPTModule(L.LightningModule):
    def __init__(self, model_cfg: GPTConfig, optim_cfg: OptimConfig, max_steps: int,
                 compile: bool | str = False, cuda_graph: bool = False,
                 autograd_threads: bool = False):
        super().__init__()
        self.save_hyperparameters({"model": model_cfg.to_dict(), "optim": vars(optim_cfg),
                                   "max_steps": max_steps, "compile": compile,
                                   "cuda_graph": cuda_graph,
                                   "autograd_threads": autograd_threads})
        self.model_cfg, self.optim_cfg, self.max_steps = model_cfg, optim_cfg, max_steps
        self.model = GPT(model_cfg)
        self.compile = compile
        # torch.compile wraps the whole loss function (a compiled module would compile
        # only forward, not `.loss`); it holds no parameters of its own, so checkpoints
        # hold them once, under `model.`, whether or not the model was compiled.
        # compile: True for torch.compile's default mode, or a mode's name.
        self._loss_fn = self.model.loss
        if compile:
            register_inductor_fallbacks()
            self._loss_fn = torch.compile(self.model.loss,
                                          mode=None if compile is True else compile)
        # Inductor's CUDA graphs (reduce-overhead) replay into buffers that the next
        # replay overwrites, as cuda_graph=true's do: each step is announced to Inductor
        # and the logged losses are copies.
        self._inductor_graphs = compile == "reduce-overhead"
        self._replayed = cuda_graph or self._inductor_graphs
        self.cuda_graph = cuda_graph
        self.autograd_threads = autograd_threads
        # (batch shape, graphed loss), made at the first training step; a tuple, so that
        # the graphed pieces are not registered as submodules (nor saved in checkpoints).
        self._graph: tuple[torch.Size, _GraphedLoss] | None = None
        self._pending_check: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None
        # This rank's loss of the latest step whose check has been read (one step late),
        # for the progress bar.
        self.last_loss: float | None = None
        self._params: tuple[torch.nn.Parameter, ...] | None = None  # for clipping, walked once

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self._inductor_graphs:  # a new step: earlier outputs may be reused
            torch.compiler.cudagraph_mark_step_begin()
        loss = self._train_loss(x, y)
        previous, self._pending_check = self._pending_check, self._queue_finite_check(loss)
        self._raise_if_non_finite(previous)
        # A graphed loss lives in the graph's output buffer, which the next step overwrites.
        logged = loss.detach().clone() if self._replayed else loss
        # For the loggers only (mean over ranks): Lightning reads every progress-bar metric
        # logged as a tensor back from the GPU at the end of every step, which would make
        # the host wait for the device each step. The bar shows last_loss (ProgressBar).
        self.log("train/loss", logged, sync_dist=True)
        return loss

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        """Backward on this thread unless autograd_threads: PyTorch runs the backward of
        CUDA tensors on a worker thread per device, and each Python backward node (every
        fused op's) then pays a hand-over between the threads; the plain fused gpt2 step on
        an H200 host ran 1.47x faster without it (docs/perf-notes.md, eleventh round)."""
        with torch.autograd.set_multithreading_enabled(self.autograd_threads):
            super().backward(loss, *args, **kwargs)

    def _train_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.cuda_graph:
            return self._loss_fn(x, y)
        if self._graph is None:
            self._graph = (x.shape, self._capture(x, y))
        shape, graphed = self._graph
        # Graphs replay fixed shapes; the loaders drop short batches, so this is a guard.
        return graphed(x, y) if x.shape == shape else self._loss_fn(x, y)

    def _capture(self, x: torch.Tensor, y: torch.Tensor) -> _GraphedLoss:
        """The loss's forward and backward captured as CUDA graphs (_GraphedLoss: in
        pieces under DDP, whole in one process), after three warm-up runs on a side
        stream (where Triton compiles and autotunes): each step then replays them,
        instead of the host issuing every kernel. Autocast's weight-cast cache is off
        while capturing (cached casts made during capture would be freed while the
        graphs still read them); the graphs hold the autocast casts themselves."""
        amp = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                             enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
        split = _distributed() and torch.distributed.get_world_size() > 1
        with amp:
            return _GraphedLoss(self.model, x.clone(), y.clone(), split)

    def _queue_finite_check(self, loss: torch.Tensor):
        """Start checking this step's loss without making the host wait for the GPU: the
        finite flag (min over ranks, so every rank stops at the same step and none waits
        forever in a collective) and the loss are copied to pinned host memory behind an
        event, and read one step later (or before a checkpoint is written)."""
        finite = torch.isfinite(loss.detach()).float()
        if _distributed():
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        stats = torch.stack([finite, loss.detach().float()])
        if not stats.is_cuda:
            return self.global_step, stats, None
        host = torch.empty(2, pin_memory=True)
        host.copy_(stats, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return self.global_step, host, done

    def _raise_if_non_finite(self, check) -> None:
        """Read a queued check (keeping its loss as last_loss); raise if the loss was not
        finite on some rank."""
        if check is None:
            return
        step, stats, done = check
        if done is not None:
            done.synchronize()
        self.last_loss = stats[1].item()
        if stats[0] < 1:
            raise NonFiniteLossError(
                f"non-finite training loss at step {step} (this rank's loss: "
                f"{stats[1].item()}); stopping, the last good checkpoint is kept")

    def on_train_end(self) -> None:
        self._raise_if_non_finite(self._pending_check)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Never write weights that a non-finite step has already updated. Every rank
        # builds the checkpoint, and every rank holds the same reduced flag.
        self._raise_if_non_finite(self._pending_check)
        checkpoint["rng"] = {"torch": torch.get_rng_state(),
                             "cuda": torch.cuda.get_rng_state_all()
                             if torch.cuda.is_available() else [],
                             "python": list(random.getstate()[1])}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        rng = checkpoint.get("rng")
        if rng is None:
            return
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        state = random.getstate()
        random.setstate((state[0], tuple(rng["python"]), state[2]))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self._inductor_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss = self._loss_fn(x, y)
        self.log("val/loss", loss.clone() if self._inductor_graphs else loss, prog_bar=True,
                 sync_dist=True)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None) -> None:
        """Clipping done here, not by Lightning's precision plugin: the plugin refuses
        optimizers that unscale internally, AdamW(fused=True) among them, though bf16
        and fp32 gradients need no unscaling (fused is not used under fp16 loss
        scaling). Under FSDP the norm goes through the root FSDP module, which reduces it
        over every rank's shard (a per-rank clip_grad_norm_ would see only its own)."""
        if not gradient_clip_val:
            return
        if gradient_clip_algorithm != "value" and torch.distributed.is_available():
            from torch.distributed.fsdp import FullyShardedDataParallel

            root = self.trainer.strategy.model
            if isinstance(root, FullyShardedDataParallel):
                root.clip_grad_norm_(gradient_clip_val)
                return
        if self._params is None:
            self._params = tuple(self.parameters())
        params = [p for p in self._params if p.grad is not None]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            clip_grad_norm(params, gradient_clip_val, optimizer)

    def _fused_adamw(self) -> bool:
        """One fused kernel per parameter group on CUDA (foreach AdamW makes ~8 passes
        over the fp32 state); not under fp16 loss scaling, where the gradients are
        unscaled inside the fused step, after clipping would have seen them scaled."""
        on_cuda = all(p.is_cuda for p in self.model.parameters())
        return on_cuda and str(self.trainer.precision) != "16-mixed"

    def _fusedtrain_adamw(self) -> tuple[bool, torch.dtype | None]:
        """(whether the fused ops step with fusedtrain.optim.AdamW, the dtype of the weight
        copies it writes). It does with fused ops on CUDA, unsharded (no copy of an FSDP
        shard is what an op reads), and writes bf16 copies where the ops read them: under
        bf16 autocast, compiled or not, but not in CUDA graphs (ours and Inductor's hold
        their casts: _capture, ops.published_cast). Without copies its kernel still beats
        AdamW(fused=True): 872 against 1006 us for GPT-2 on an H200 (docs/perf-notes.md,
        twenty-second round)."""
        sharded = "fsdp" in type(self.trainer.strategy).__name__.lower()
        if not (any(self.model.config.kernels.values()) and self._fused_adamw()
                and not sharded):
            return False, None
        copies = (not self._inductor_graphs and not self.cuda_graph
                  and str(self.trainer.precision) == "bf16-mixed")
        return True, torch.bfloat16 if copies else None

    def configure_optimizers(self):
        o = self.optim_cfg
        # Decay the matrices (embeddings, projections), not biases or LayerNorm scales;
        # decided by name, since FSDP exposes every parameter as a flat 1-D shard.
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if name.endswith("weight") and "ln_" not in name else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": o.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        ours, copy_dtype = self._fusedtrain_adamw()
        if ours:
            opt = AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), copy_dtype=copy_dtype)
        else:
            opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2),
                                    fused=self._fused_adamw())
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_multiplier(s, o.warmup_steps, self.max_steps, o.min_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SaveOnInterrupt(L.Callback):
    """On SIGINT / SIGTERM (or any other crash but a non-finite loss), write last.ckpt
    before the process exits, so a resume loses nothing."""

    def __init__(self, path: str):
        self.path = path

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, NonFiniteLossError) or trainer.global_step == 0:
            return
        trainer.save_checkpoint(self.path)
        print(f"interrupted at step {trainer.global_step}: saved {self.path}", flush=True)


def freeze_python_heap() -> None:
    """Collect garbage, then move every object alive now (torch, Lightning, the model,
    Triton's and Inductor's caches: ~500k of them) out of the collector's reach until
    gc.unfreeze(), as after a process's warm-up. Python's full collections walk every
    tracked object: on a lent H200 host one took up to 287 ms, landing inside whatever
    step it fell in (four in 40 timed steps of the fused gpt2 step, none after a freeze;
    docs/perf-notes.md, twenty-eighth round). Objects made later are collected as before;
    frozen ones are still freed when their last reference goes, but a reference cycle
    among them only after gc.unfreeze()."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def python_heap_frozen():
    """freeze_python_heap() for the duration of the block."""
    freeze_python_heap()
    try:
        yield
    finally:
        gc.unfreeze()


class FreezeHeapAfterWarmup(L.Callback):
    """freeze_python_heap() once this process has run `after` steps (the warm-up steps
    that compile, autotune and build the caches that stay; counted from the resumed step
    when resuming), gc.unfreeze() when training ends or stops on an exception."""

    def __init__(self, after: int = 5):
        self.after = after
        self._at: int | None = None  # the global step to freeze at

    def on_train_start(self, trainer, pl_module):
        self._at = trainer.global_step + self.after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self._at:
            freeze_python_heap()

    def on_train_end(self, trainer, pl_module):
        gc.unfreeze()

    def on_exception(self, trainer, pl_module, exception):
        gc.unfreeze()


class ThroughputMonitor(L.Callback):
    """Logs tokens/s over all devices (and per device, when there are several) and MFU
    (per device, on a known GPU), each over the last `window` steps, to the loggers; the
    latest values stay in `tokens_per_s` and `mfu` for ProgressBar.

    The first `skip_steps` steps of each fit (torch.compile, Triton autotuning,
    allocator warm-up; counted from the resumed step when resuming, as this process
    compiles and tunes again) are left out of the rate. The device is synchronised only at
    window boundaries (and at the last step), so the rate covers finished device work
    while the host keeps running ahead of the GPU in between.
    """

    def __init__(self, skip_steps: int = 5, window: int = 10):
        self.skip_steps, self.window = skip_steps, window
        self._first = skip_steps  # the global step of the first boundary
        self._mark: tuple[float, int] | None = None  # (time, step) of the last boundary
        self.tokens_per_s: float | None = None
        self.mfu: float | None = None

    def on_train_start(self, trainer, pl_module):
        self._first = trainer.global_step + self.skip_steps
        self._mark = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step < self._first or ((step - self._first) % self.window
                                  and step != trainer.max_steps):
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now, mark = time.perf_counter(), self._mark
        self._mark = (now, step)
        if mark is None or step == mark[1]:
            return
        x = batch[0]
        tokens = (step - mark[1]) * trainer.accumulate_grad_batches * x.numel()
        self.tokens_per_s = tokens * trainer.world_size / (now - mark[0])
        pl_module.log("tokens_per_s", self.tokens_per_s)  # all devices
        if trainer.world_size > 1:
            pl_module.log("tokens_per_s_per_device", self.tokens_per_s / trainer.world_size)
        peak = peak_flops()
        if peak is not None:
            flops = pl_module.model.flops_per_token(x.shape[1]) * self.tokens_per_s
            self.mfu = flops / (peak[1] * trainer.world_size)
            pl_module.log("mfu", self.mfu)


class ProgressBar(TQDMProgressBar):
    """Lightning's bar, showing values the host already holds: the training loss of the
    last step whose finite check was read (GPTModule.last_loss, one step behind) and the
    ThroughputMonitor's tokens/s and MFU. Metrics logged with `prog_bar=True` are tensors
    that Lightning converts to numbers (`.item()`) at the end of every step, whatever the
    refresh rate: a read from the GPU that makes the host wait for the device every step,
    instead of issuing the next step while the GPU runs this one."""

    def __init__(self, throughput: ThroughputMonitor | None = None, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)
        self.throughput = throughput

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        loss = getattr(pl_module, "last_loss", None)
        if loss is not None:
            items["loss"] = f"{loss:.4g}"
        rate = self.throughput
        if rate is not None and rate.tokens_per_s is not None:
            items["tokens/s"] = f"{rate.tokens_per_s:.4g}"
            if rate.mfu is not None:
                items["mfu"] = f"{rate.mfu:.3f}"
        return items
