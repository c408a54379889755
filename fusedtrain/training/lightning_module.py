"""GPTModule, the LightningModule: next-token loss, the optimizer and schedule, the graphed or
compiled loss, the finite-loss check."""

from __future__ import annotations

import random

import lightning as L
import torch

from fusedtrain import ops
from fusedtrain.model import GPT, GPTConfig
from fusedtrain.training.graph_capture import GraphedLoss, capture_loss
from fusedtrain.training.optimizer import (
    AdamWPlan,
    OptimConfig,
    adamw_plan,
    build_optimizer,
    clip_grad_norm,
    lr_multiplier,
)


def _distributed() -> bool:
    """Whether this process is one of a torch.distributed group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


class GPTModule(L.LightningModule):
    def __init__(self, model_cfg: GPTConfig, optim_cfg: OptimConfig, max_steps: int,
                 compile: bool | str = False, cuda_graph: bool = False,
                 autograd_threads: bool = False, trace_kernels: bool = False):
        super().__init__()
        self.save_hyperparameters({"model": model_cfg.to_dict(), "optim": vars(optim_cfg),
                                   "max_steps": max_steps, "compile": compile,
                                   "cuda_graph": cuda_graph,
                                   "autograd_threads": autograd_threads,
                                   "trace_kernels": trace_kernels})
        self.model_cfg, self.optim_cfg, self.max_steps = model_cfg, optim_cfg, max_steps
        self.model = GPT(model_cfg)
        self.compile = compile
        # torch.compile wraps the whole loss function (a compiled module would compile
        # only forward, not `.loss`); it holds no parameters of its own, so checkpoints
        # hold them once, under `model.`, whether or not the model was compiled.
        # compile: True for torch.compile's default mode, or a mode's name; with
        # trace_kernels, Inductor emits the fused ops' kernels itself (ops.trace_kernels).
        self._loss_fn = self.model.loss
        if compile:
            ops.register_inductor_fallbacks()
            ops.trace_kernels(trace_kernels)
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
        self._graph: tuple[torch.Size, GraphedLoss] | None = None
        self._pending_check: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None
        # This rank's loss of the latest step whose check has been read (one step late),
        # for the progress bar.
        self.last_loss: float | None = None
        self._params: tuple[torch.nn.Parameter, ...] | None = None  # for clipping, walked once

    def training_step(self, batch, batch_idx):
        x, y, *docs = batch  # docs: [cu_seqlens] with data.pack=true
        if self._inductor_graphs:  # a new step: earlier outputs may be reused
            torch.compiler.cudagraph_mark_step_begin()
        loss = self._train_loss(x, y, *docs)
        previous, self._pending_check = self._pending_check, self._queue_finite_check(loss)
        self._raise_if_non_finite(previous)
        # A graphed loss lives in the graph's output buffer, which the next step overwrites.
        logged = loss.detach().clone() if self._replayed else loss
        # For the loggers only (mean over ranks): Lightning reads every progress-bar metric
        # logged as a tensor back from the GPU at the end of every step, which would make
        # the host wait for the device each step. The bar shows last_loss (ProgressBar).
        self.log("train/loss", logged, sync_dist=True, batch_size=x.shape[0])
        return loss

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        """Backward on this thread unless autograd_threads: PyTorch runs the backward of
        CUDA tensors on a worker thread per device, and each Python backward node (every
        fused op's) then pays a hand-over between the threads; the plain fused gpt2 step on
        an H200 host ran 1.47x faster without it (docs/journal.md)."""
        with torch.autograd.set_multithreading_enabled(self.autograd_threads):
            super().backward(loss, *args, **kwargs)

    def _train_loss(self, x: torch.Tensor, y: torch.Tensor, *docs: torch.Tensor
                    ) -> torch.Tensor:
        if not self.cuda_graph:  # (config.py refuses cuda_graph=true with packed rows)
            return self._loss_fn(x, y, *docs)
        if self._graph is None:
            self._graph = (x.shape, capture_loss(self.model, x, y))
        shape, graphed = self._graph
        # Graphs replay fixed shapes; the loaders drop short batches, so this is a guard.
        return graphed(x, y) if x.shape == shape else self._loss_fn(x, y)

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
        x, y, *docs = batch
        if self._inductor_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss = self._loss_fn(x, y, *docs)
        self.log("val/loss", loss.clone() if self._inductor_graphs else loss, prog_bar=True,
                 sync_dist=True, batch_size=x.shape[0])

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

    def _on_cuda(self) -> bool:
        return all(p.is_cuda for p in self.model.parameters())

    def _adamw_plan(self) -> AdamWPlan:
        sharded = "fsdp" in type(self.trainer.strategy).__name__.lower()
        capture = "inductor" if self._inductor_graphs else "loss" if self.cuda_graph else "none"
        return adamw_plan(fused_ops=any(self.model.config.kernels.values()),
                          on_cuda=self._on_cuda(), precision=str(self.trainer.precision),
                          sharded=sharded, capture=capture)

    def configure_optimizers(self):
        o = self.optim_cfg
        # Decay the matrices (embeddings, projections), not biases or LayerNorm scales;
        # decided by name, since FSDP exposes every parameter as a flat 1-D shard.
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if name.endswith("weight") and "ln_" not in name else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": o.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        opt = build_optimizer(groups, self._adamw_plan(), lr=o.lr, betas=(o.beta1, o.beta2))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_multiplier(s, o.warmup_steps, self.max_steps, o.min_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

