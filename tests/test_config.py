from pathlib import Path

import pytest
import torch
from conftest import ROOT
from hydra import compose, initialize_config_dir

from fusedtrain.config import ConfigError, build_run_config

CONF = str(ROOT / "conf")


def _compose(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _group_options():
    for group in sorted(p for p in Path(CONF).iterdir() if p.is_dir()):
        for f in sorted(group.glob("*.yaml")):
            yield group.name, f.stem


@pytest.mark.parametrize("group,option", list(_group_options()))
def test_every_group_file_composes(group, option):
    overrides = [f"{group}={option}"]
    if option == "text":
        overrides.append("data.files=[a.txt]")
    if option == "hub":
        overrides.append("data.name=some/dataset")
    cfg = _compose(overrides)
    if option == "fsdp" and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="fsdp needs CUDA"):
            build_run_config(cfg)
    elif group != "data" or option in ("stdlib", "synthetic"):
        build_run_config(cfg)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_switch_sets_every_component(fused):
    run = build_run_config(_compose([f"fused={fused}"]))
    assert set(run.model.kernels.values()) == {fused}


def test_per_component_override():
    run = build_run_config(_compose(["fused=true", "model.kernels.attention=false"]))
    assert run.model.kernels == {"mlp": True, "qkv": True, "attention": False,
                                 "layernorm": True, "cross_entropy": True,
                                 "embedding": True}


def test_grouped_heads_and_window_reach_the_model():
    run = build_run_config(_compose(["model.n_kv_head=1", "model.attention_window=16"]))
    assert (run.model.n_kv_head, run.model.attention_window) == (1, 16)
    assert build_run_config(_compose([])).model.n_kv_head == run.model.n_head


@pytest.mark.parametrize("override,match", [
    ("optim.lr=-1", "optim.lr"), ("model.n_head=3", "divisible"),
    ("data.batch_size=0", "data.batch_size"), ("trainer.max_steps=0", "max_steps"),
    ("+model.kernels.conv=true", "conv"), ("+optim.momentum=0.9", "optim.momentum"),
    ("model.n_kv_head=3", "n_kv_head"), ("model.attention_window=-2", "attention_window"),
])
def test_bad_settings_are_named(override, match):
    with pytest.raises(ConfigError, match=match):
        build_run_config(_compose([override]))


@pytest.mark.parametrize("value,setting", [("false", False), ("true", True), ("default", True),
                                           ("reduce-overhead", "reduce-overhead")])
def test_compile_takes_a_mode(value, setting):
    assert build_run_config(_compose([f"compile={value}"])).compile == setting


def test_unknown_compile_mode_is_named():
    with pytest.raises(ConfigError, match="compile must be"):
        build_run_config(_compose(["compile=fastest"]))


@pytest.mark.parametrize("overrides,match", [
    (["cuda_graph=true", "compile=true"], "choose one"),
    (["cuda_graph=true", "trainer=fsdp"], "cannot capture FSDP"),
    (["cuda_graph=true", "trainer.devices=2"], "needs trainer=ddp"),
])
def test_cuda_graph_refuses_what_it_cannot_capture(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_run_config(_compose(overrides))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_graph_needs_a_gpu():
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        build_run_config(_compose(["cuda_graph=true"]))


def test_trace_kernels_needs_compile_and_a_gpu():
    with pytest.raises(ConfigError, match="set compile=true"):
        build_run_config(_compose(["trace_kernels=true"]))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs a CUDA GPU"):
            build_run_config(_compose(["trace_kernels=true", "compile=true"]))
    assert build_run_config(_compose([])).trace_kernels is False


def test_autograd_threads_is_off_unless_asked():
    assert build_run_config(_compose([])).autograd_threads is False
    assert build_run_config(_compose(["autograd_threads=true"])).autograd_threads is True


@pytest.mark.parametrize("name", ["autograd_threads", "cuda_graph", "deterministic",
                                  "tensorboard"])
def test_switches_take_true_or_false_only(name):
    with pytest.raises(ConfigError, match=f"{name} must be true or false"):
        build_run_config(_compose([f"{name}=maybe"]))
