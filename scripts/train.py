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
from fusedtrain.training.logs import LogProgress, ResumableCSVLogger

log = logging.getLogger("fusedtrain")


def resolve_ckpt(ckpt_path: str | None, run_dir: Path) -> tuple[str, dict] | None:
    """'last' -> this run dir's checkpoints/last.ckpt (a ConfigError naming the dir if there
    is none); 'latest' -> the newest last.ckpt under outputs/, the run it belongs to named
    in the log; else a path. The checkpoint is verified (hash, safe load) before any
    training starts; a bad last.ckpt falls back to the newest good checkpoint beside it,
    named in the log. Returns (path, loaded checkpoint)."""
    if ckpt_path is None:
        return None
    if ckpt_path not in ("last", "latest"):
        return ckpt_path, load_checkpoint(ckpt_path)  # raises CheckpointError naming it
    if ckpt_path == "last":
        last = run_dir / "checkpoints" / "last.ckpt"
        if not last.is_file():
            raise ConfigError(f"ckpt_path=last: no checkpoints/last.ckpt in this run dir "
                              f"({run_dir}); ckpt_path=latest resumes the newest run under "
                              "outputs/, ckpt_path=PATH a given checkpoint")
    else:
        found = sorted(Path("outputs").glob("**/checkpoints/last.ckpt"),
                       key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigError("ckpt_path=latest: no checkpoints/last.ckpt under outputs/")
        last = found[-1]
        log.info("ckpt_path=latest: resuming the run in %s", last.parent.parent)
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
    raise CheckpointError(f"ckpt_path={ckpt_path}: no loadable checkpoint in {last.parent}")


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
    try:  # before any training: the corpus can be read and holds the windows
        datamodule.check_size()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    resume = resolve_ckpt(run.ckpt_path, run_dir)
    resume_step = None
    if resume is not None:
        check_resumable(resume[0], resume[1], run.model)
        resume_step = int(resume[1].get("global_step", 0))
        log.info("resuming from %s at step %d", resume[0], resume_step)
    module = GPTModule(run.model, run.optim, max_steps, compile=run.compile,
                       cuda_graph=run.cuda_graph, autograd_threads=run.autograd_threads,
                       trace_kernels=run.trace_kernels)
    throughput = ThroughputMonitor(skip_steps=run.throughput_skip_steps)
    ckpt_dir = run_dir / "checkpoints"
    checkpoints = [ModelCheckpoint(dirpath=str(ckpt_dir), filename="step{step}",
                                   auto_insert_metric_name=False, save_last=True,
                                   monitor="val/loss", save_top_k=1)]
    if run.checkpoint_every_n_steps:
        checkpoints.append(ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True, save_top_k=0,
                                           every_n_train_steps=run.checkpoint_every_n_steps))
    ckpt_path = resume[0] if resume is not None else None
    # Resuming in this run dir, the loggers keep what the earlier run logged before the
    # checkpoint's step and drop its later rows (the resumed run logs those steps again).
    same_dir = resume is not None and Path(resume[0]).resolve().is_relative_to(run_dir.resolve())
    loggers = [ResumableCSVLogger(str(run_dir), resume_step if same_dir else None)]
    if run.tensorboard:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(run_dir, name="tensorboard", version="",
                                         **({"purge_step": resume_step} if same_dir else {})))
    log_every = trainer_kwargs.get("log_every_n_steps", 10)
    callbacks = [throughput, *checkpoints, SaveOnInterrupt(str(ckpt_dir / "last.ckpt")),
                 FreezeHeapAfterWarmup(after=run.throughput_skip_steps),
                 LogProgress(log_every, throughput)]
    if trainer_kwargs.get("enable_progress_bar", True):
        callbacks.append(ProgressBar(throughput, refresh_rate=log_every))
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
    line = (f"done: {summary['steps']} steps, train loss {fmt(summary['train_loss'])}, "
            f"val loss {fmt(summary['val_loss'])}, {fmt(summary['tokens_per_s'])} tokens/s"
            + (f" ({fmt(summary['tokens_per_s'] / trainer.world_size)} per device on "
               f"{trainer.world_size})" if trainer.world_size > 1 and summary["tokens_per_s"]
               else "")
            + (f", MFU {summary['mfu']:.3f}" if summary["mfu"] is not None else "")
            + f", outputs in {run_dir}")
    log.info("%s", line)  # the console and train.log
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


def composition_error(argv: list[str]) -> str | None:
    """What Hydra's composition of this command line's overrides raises (an unknown key, a
    group option that does not exist, a malformed override), as one line; None if it
    composes, or if a Hydra flag (--cfg, -m, --help, ...) asks for Hydra's own handling.
    Hydra itself would print it and exit 1, where this script's bad settings exit 2."""
    if any(a.startswith("-") for a in argv):
        return None
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose("config", overrides=argv, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        return " ".join(str(e).split())
    return None


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

if __name__ == "__main__":
    error = composition_error(sys.argv[1:])
    if error is not None:
        print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)
    main()
