"""Hydra config -> validated dataclasses, with one clear message per bad setting."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from fusedtrain.data import DataConfig
from fusedtrain.model import GPTConfig
from fusedtrain.training.optimizer import OptimConfig


class ConfigError(ValueError):
    """A setting is out of range or unknown; the message names it."""


@dataclass
class RunConfig:
    model: GPTConfig
    data: DataConfig
    optim: OptimConfig
    trainer: dict
    seed: int
    compile: bool | str  # False, True (torch.compile's default mode) or a mode's name
    ckpt_path: str | None
    throughput_skip_steps: int
    deterministic: bool = False
    tensorboard: bool = False
    cuda_graph: bool = False
    autograd_threads: bool = False
    checkpoint_every_n_steps: int | None = None
    trace_kernels: bool = False  # with compile: see fusedtrain.ops.trace_kernels


def _build(cls, section: str, values: dict):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(f'{section}.{k}' for k in unknown)}")
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e


def _check_trainer(t: dict) -> None:
    """The Trainer settings this project's configs use, before Lightning sees them."""
    devices = t.get("devices", "auto")
    if not (devices == "auto" or devices == -1 or (isinstance(devices, int) and devices > 0)
            or (isinstance(devices, (list, str)) and len(devices) > 0)):
        raise ConfigError(f"trainer.devices must be a positive count, -1, 'auto' or a list of "
                          f"device ids, got {devices!r}")
    for name in ("num_nodes", "log_every_n_steps"):
        v = t.get(name, 1)
        if not isinstance(v, int) or v <= 0:
            raise ConfigError(f"trainer.{name} must be a positive integer, got {v!r}")
    interval = t.get("val_check_interval")
    if interval is not None and not (isinstance(interval, (int, float)) and interval > 0):
        raise ConfigError(f"trainer.val_check_interval must be positive, got {interval!r}")
    clip = t.get("gradient_clip_val")
    if clip is not None and not (isinstance(clip, (int, float)) and clip >= 0):
        raise ConfigError(f"trainer.gradient_clip_val must be >= 0 or null, got {clip!r}")
    limit = t.get("limit_val_batches")
    if limit is not None and not (isinstance(limit, (int, float)) and limit >= 0):
        raise ConfigError(f"trainer.limit_val_batches must be >= 0, got {limit!r}")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def _compile_setting(value) -> bool | str:
    """`compile=`: false, true (the default mode) or a torch.compile mode's name."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if value in COMPILE_MODES:
        return True if value == "default" else value
    raise ConfigError(f"compile must be true, false or one of {', '.join(COMPILE_MODES)}; "
                      f"got {value!r}")


def _flag(c: dict, name: str) -> bool:
    """A true/false setting (absent or null: false)."""
    value = c.get(name)
    if value is None or isinstance(value, bool):
        return bool(value)
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def _check_cuda_graph(trainer: dict, compile: bool | str) -> None:
    """cuda_graph=true captures each GPU's training step; say plainly where it cannot."""
    if compile:
        raise ConfigError("cuda_graph=true and compile=true are two ways to the same end; "
                          "choose one")
    strategy = trainer.get("strategy")
    if strategy == "fsdp":
        raise ConfigError("cuda_graph=true cannot capture FSDP's step: FSDP gathers and "
                          "frees parameter shards inside forward and backward (use "
                          "trainer=ddp or trainer=gpu)")
    devices = trainer.get("devices", 1)
    one_device = devices == 1 or (isinstance(devices, list) and len(devices) == 1)
    if not one_device and strategy != "ddp":
        raise ConfigError("cuda_graph=true on several devices needs trainer=ddp (each rank "
                          "replays its own step; DDP all-reduces the gradients after it)")
    if trainer.get("accelerator") == "cpu" or not torch.cuda.is_available():
        raise ConfigError("cuda_graph=true needs a CUDA GPU")


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
    _check_trainer(trainer)
    cuda_graph = _flag(c, "cuda_graph")
    compile = _compile_setting(c.get("compile", False))
    if cuda_graph and data.pack:
        raise ConfigError("cuda_graph=true replays one fixed set of shapes, and with "
                          "data.pack=true each batch's cu_seqlens has its own length (one "
                          "entry per document); train packed rows without cuda_graph")
    if cuda_graph:
        _check_cuda_graph(trainer, compile)
    if trainer.get("strategy") == "fsdp" and (trainer.get("accelerator") == "cpu"
                                              or not torch.cuda.is_available()):
        raise ConfigError("trainer.strategy=fsdp needs CUDA GPUs (Lightning's FSDP is "
                          "GPU-only); on CPUs use trainer=ddp trainer.accelerator=cpu")
    trace_kernels = _flag(c, "trace_kernels")
    if trace_kernels and not compile:
        raise ConfigError("trace_kernels=true lets torch.compile trace into the fused ops' "
                          "kernels; set compile=true (or a mode) with it")
    if trace_kernels and (trainer.get("accelerator") == "cpu" or not torch.cuda.is_available()):
        raise ConfigError("trace_kernels=true needs a CUDA GPU: on the CPU the kernels run "
                          "in Triton's interpreter, which torch.compile cannot trace")
    tensorboard = _flag(c, "tensorboard")
    if tensorboard and not any(importlib.util.find_spec(m) for m in ("tensorboard",
                                                                      "tensorboardX")):
        raise ConfigError("tensorboard=true needs the tensorboard package, which is not "
                          "installed: pip install -e '.[tb]'")
    every = (c.get("checkpoint") or {}).get("every_n_steps")
    if every is not None and not (isinstance(every, int) and not isinstance(every, bool)
                                  and every > 0):
        raise ConfigError(f"checkpoint.every_n_steps must be a positive integer or null, "
                          f"got {every!r}")
    unknown = sorted(set(c.get("checkpoint") or {}) - {"every_n_steps"})
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join('checkpoint.' + k for k in unknown)}")
    skip = c.get("throughput_skip_steps", 5)
    if not isinstance(skip, int) or skip < 0:
        raise ConfigError(f"throughput_skip_steps must be a non-negative integer, got {skip!r}")
    return RunConfig(model=model, data=data, optim=optim, trainer=trainer, seed=int(c["seed"]),
                     compile=compile, ckpt_path=c.get("ckpt_path"),
                     throughput_skip_steps=skip, deterministic=_flag(c, "deterministic"),
                     tensorboard=tensorboard, cuda_graph=cuda_graph,
                     autograd_threads=_flag(c, "autograd_threads"),
                     checkpoint_every_n_steps=every, trace_kernels=trace_kernels)
