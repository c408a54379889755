"""Hydra config -> validated dataclasses, with one clear message per bad setting."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from fusedtrain.data import DataConfig
from fusedtrain.model import GPTConfig
from fusedtrain.module import OptimConfig


class ConfigError(ValueError):
    """A setting is out of range or unknown; the message names it."""


@dataclass
class RunConfig:
    model: GPTConfig
    data: DataConfig
    optim: OptimConfig
    trainer: dict
    seed: int
    compile: bool
    ckpt_path: str | None
    throughput_skip_steps: int
    deterministic: bool = False
    tensorboard: bool = False


def _build(cls, section: str, values: dict):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(f'{section}.{k}' for k in unknown)}")
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e


def build_run_config(cfg: DictConfig) -> RunConfig:
    """Validate everything before any work starts."""
    c = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    model = _build(GPTConfig, "model", c["model"])
    data = _build(DataConfig, "data", c["data"])
    optim = _build(OptimConfig, "optim", c["optim"])
    trainer = dict(c["trainer"])
    max_steps = trainer.get("max_steps", -1)
    if not isinstance(max_steps, int) or max_steps <= 0:
        raise ConfigError(f"trainer.max_steps must be a positive integer, got {max_steps!r}")
    if trainer.get("strategy") == "fsdp" and (trainer.get("accelerator") == "cpu"
                                              or not torch.cuda.is_available()):
        raise ConfigError("trainer.strategy=fsdp needs CUDA GPUs (Lightning's FSDP is "
                          "GPU-only); on CPUs use trainer=ddp trainer.accelerator=cpu")
    skip = c.get("throughput_skip_steps", 5)
    if not isinstance(skip, int) or skip < 0:
        raise ConfigError(f"throughput_skip_steps must be a non-negative integer, got {skip!r}")
    return RunConfig(model=model, data=data, optim=optim, trainer=trainer, seed=int(c["seed"]),
                     compile=bool(c.get("compile", False)), ckpt_path=c.get("ckpt_path"),
                     throughput_skip_steps=skip, deterministic=bool(c.get("deterministic")),
                     tensorboard=bool(c.get("tensorboard")))
