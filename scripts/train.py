"""Train a GPT: python scripts/train.py [fused=true|false] [model=...] [data=...] [trainer=...]"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from fusedtrain.config import ConfigError, build_run_config
from fusedtrain.data import DataError, TokenDataModule
from fusedtrain.model import GPTConfig
from fusedtrain.training.callbacks import (
    FreezeHeapAfterWarmup,
    ProgressBar,
    SaveOnInterrupt,
    ThroughputMonitor,
)
from fusedtrain.training.checkpoint import CheckpointError, SafeCheckpointIO, load_checkpoint
from fusedtrain.training.lightning_module import GPTModule, NonFiniteLossError

log = logging.getLogger("fusedtrain")


def resolve_ckpt(ckpt_path: str | None, run_dir: Path) -> tuple[str, dict] | None:
    """'last' -> this run dir's last.ckpt, else the newest last.ckpt under outputs/.
    The checkpoint is verified (hash, safe load) before any training starts; a bad
    'last' falls back to the newest good checkpoint beside it, named in the log.
    Returns (path, loaded checkpoint)."""
    if ckpt_path is None:
        return None
    if ckpt_path != "last":
        return ckpt_path, load_checkpoint(ckpt_path)  # raises CheckpointError naming it
    here = run_dir / "checkpoints" / "last.ckpt"
    found = [here] if here.is_file() else sorted(
        Path("outputs").glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ConfigError("ckpt_path=last: no last.ckpt in this run dir or under outputs/")
    last = found[-1]
    candidates = [last] + sorted((p for p in last.parent.glob("*.ckpt") if p != last),
                                 key=lambda p: p.stat().st_mtime, reverse=True)
    for cand in candidates:
        try:
            loaded = load_checkpoint(cand)
        except CheckpointError as e:
            log.warning("%s", e)
            continue
        if cand != last:
            log.warning("resuming from %s instead", cand)
        return str(cand), loaded
    raise CheckpointError(f"ckpt_path=last: no loadable checkpoint in {last.parent}")


ARCHITECTURE = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias")


def check_resumable(path: str, ckpt: dict, model: GPTConfig) -> None:
    """The checkpoint's model must have this run's shapes (fused or eager, dropout and the
    GELU form may differ: they share every parameter)."""
    saved = ckpt.get("hyper_parameters", {}).get("model", {})
    diff = [f"model.{k}={saved[k]!r} there, {getattr(model, k)!r} here"
            for k in ARCHITECTURE if k in saved and saved[k] != getattr(model, k)]
    if diff:
        raise ConfigError(f"ckpt_path: {path} was trained with another model shape ("
                          + "; ".join(diff) + ")")
    if saved.get("gelu", model.gelu) != model.gelu:
        log.warning("resuming a model trained with gelu=%s as gelu=%s", saved["gelu"],
                    model.gelu)


def ddp_strategy():
    """DDP with the gradients living in the all-reduce buckets (no copy in or out) and the
    graph declared static (every step uses every parameter the same way)."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(gradient_as_bucket_view=True, static_graph=True)


def fsdp_strategy():
    """FSDP with one unit per transformer block (the blocks' parameters are gathered one
    block at a time) and whole (unsharded) state dicts in checkpoints."""
    from lightning.pytorch.strategies import FSDPStrategy

    from fusedtrain.model import Block

    return FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")


def train(cfg: DictConfig) -> dict:
    run = build_run_config(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    log.info("config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
    fused = [k for k, on in run.model.kernels.items() if on]
    log.info("fused components: %s", ", ".join(fused) if fused else "none (all eager)")

    L.seed_everything(run.seed, workers=True)
    trainer_kwargs = dict(run.trainer)
    if trainer_kwargs.get("precision") is None:
        on_gpu = torch.cuda.is_available() and trainer_kwargs.get("accelerator") != "cpu"
        trainer_kwargs["precision"] = "bf16-mixed" if on_gpu else "32-true"
    if run.deterministic:
        trainer_kwargs["deterministic"] = True
    if trainer_kwargs.get("strategy") == "fsdp":
        trainer_kwargs["strategy"] = fsdp_strategy()
    elif trainer_kwargs.get("strategy") == "ddp":
        trainer_kwargs["strategy"] = ddp_strategy()
    max_steps = trainer_kwargs["max_steps"]
    if trainer_kwargs.get("limit_val_batches") == 0:
        trainer_kwargs.pop("val_check_interval", None)

    datamodule = TokenDataModule(run.data, run.model.block_size, run.model.vocab_size,
                                 run.seed, max_steps)
    module = GPTModule(run.model, run.optim, max_steps, compile=run.compile,
                       cuda_graph=run.cuda_graph, autograd_threads=run.autograd_threads)
    throughput = ThroughputMonitor(skip_steps=run.throughput_skip_steps)
    ckpt_dir = run_dir / "checkpoints"
    checkpoints = ModelCheckpoint(dirpath=str(ckpt_dir), filename="step{step}",
                                  auto_insert_metric_name=False, save_last=True,
                                  monitor="val/loss", save_top_k=1)
    resume = resolve_ckpt(run.ckpt_path, run_dir)
    if resume is not None:
        check_resumable(resume[0], resume[1], run.model)
    ckpt_path = resume[0] if resume is not None else None
    loggers = [CSVLogger(run_dir, name="", version="")]
    if run.tensorboard:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(run_dir, name="tensorboard", version=""))
    callbacks = [throughput, checkpoints, SaveOnInterrupt(str(ckpt_dir / "last.ckpt")),
                 FreezeHeapAfterWarmup(after=run.throughput_skip_steps)]
    if trainer_kwargs.get("enable_progress_bar", True):
        callbacks.append(ProgressBar(throughput,
                                     refresh_rate=trainer_kwargs.get("log_every_n_steps", 10)))
    trainer = L.Trainer(
        default_root_dir=run_dir, logger=loggers, callbacks=callbacks,
        plugins=[SafeCheckpointIO()], use_distributed_sampler=False,  # SkipSampler shards
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    summary = {
        "steps": trainer.global_step,
        "train_loss": metrics.get("train/loss"),
        "val_loss": metrics.get("val/loss"),
        "tokens_per_s": throughput.tokens_per_s,
        "devices": trainer.world_size,
        "mfu": throughput.mfu,
        "run_dir": str(run_dir),
    }
    if torch.cuda.is_available() and trainer_kwargs.get("accelerator") != "cpu":
        summary["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30  # this rank's
    fmt = lambda v: "n/a" if v is None else f"{v:.4g}"  # noqa: E731
    if not trainer.is_global_zero:
        return summary
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"done: {summary['steps']} steps, train loss {fmt(summary['train_loss'])}, "
          f"val loss {fmt(summary['val_loss'])}, {fmt(summary['tokens_per_s'])} tokens/s"
          + (f" ({fmt(summary['tokens_per_s'] / trainer.world_size)} per device on "
             f"{trainer.world_size})" if trainer.world_size > 1 and summary["tokens_per_s"]
             else "")
          + (f", MFU {summary['mfu']:.3f}" if summary["mfu"] is not None else "")
          + f", outputs in {run_dir}")
    return summary


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except (CheckpointError, NonFiniteLossError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        sys.exit(4)


if __name__ == "__main__":
    main()
