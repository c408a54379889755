"""Lightning callbacks of the training loop: save on interrupt, heap freezing after
warm-up, throughput and MFU, the progress bar."""

from __future__ import annotations

import gc
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from fusedtrain.training.heap import freeze_python_heap
from fusedtrain.training.lightning_module import NonFiniteLossError
from fusedtrain.training.mfu import peak_flops


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
