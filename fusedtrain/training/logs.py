"""What a run leaves to read: metrics.csv that survives a resume, progress lines in train.log."""

from __future__ import annotations

import csv
import logging
import os

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

log = logging.getLogger("fusedtrain")


class _ResumedWriter(ExperimentWriter):
    """Lightning's CSV writer, which deletes an existing metrics.csv when it starts, made
    to keep that file's rows of the steps before `resume_step` (the crashed run's later
    rows go: the resumed run logs those steps again) and to append after them."""

    def __init__(self, log_dir: str, resume_step: int):
        self.resume_step = resume_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        path = self.metrics_file_path
        if not os.path.isfile(path):
            return
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            keys = list(reader.fieldnames or [])
            kept = [r for r in reader if r.get("step") and int(r["step"]) < self.resume_step]
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(kept)
        self.metrics_keys = keys


class ResumableCSVLogger(CSVLogger):
    """CSVLogger writing save_dir/metrics.csv; resuming at `resume_step` in the same run dir
    (None: a fresh run), it keeps the rows logged before that step."""

    def __init__(self, save_dir: str, resume_step: int | None = None):
        super().__init__(save_dir, name="", version="")
        self._resume_step = resume_step

    @property
    @rank_zero_experiment  # the other ranks get a stand-in, and leave the file alone
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = (ExperimentWriter(self.log_dir) if self._resume_step is None
                                else _ResumedWriter(self.log_dir, self._resume_step))
        return self._experiment


class LogProgress(L.Callback):
    """A train.log line every `every` steps: the step, the training loss the host already
    holds (GPTModule.last_loss, one step behind: no read from the GPU) and tokens/s."""

    def __init__(self, every: int, throughput=None):
        self.every, self.throughput = every, throughput

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every:
            return
        loss = getattr(pl_module, "last_loss", None)
        rate = None if self.throughput is None else self.throughput.tokens_per_s
        log.info("step %d: loss %s, %s tokens/s", step,
                 "n/a" if loss is None else f"{loss:.4f}",
                 "n/a" if rate is None else f"{rate:.4g}")
