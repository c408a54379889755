import importlib
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from fusedtrain import gradcheck as G
from fusedtrain import ops
from fusedtrain.model import KERNEL_FAMILIES, GPTConfig
from fusedtrain.ops import layernorm as ln_ops

TINY = dict(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)
ALL = dict.fromkeys(KERNEL_FAMILIES, True)


def test_ops_and_model_parts_pass():
    results = G.check_ops(ALL) + G.check_model(GPTConfig(**TINY, kernels=ALL), torch.float32,
                                                "cpu")
    failed = [r.name for r in results if not r.passed]
    assert not failed
    assert any(r.name.startswith("ops/flash_attention") for r in results)
    assert any(r.name.endswith("mlp.c_fc.weight") for r in results)


@pytest.mark.gpu
def test_ops_and_model_parts_pass_on_the_gpu():
    # The fp64 kernels compiled for the GPU, not interpreted: the interpreter accepts what
    # triton's compiler rejects (an fp64 accumulator in tl.dot without out_dtype did).
    results = G.check_ops(ALL, "cuda") + G.check_model(GPTConfig(**TINY, kernels=ALL),
                                                        torch.bfloat16, "cuda")
    failed = [f"{r.name}: {r.detail}" for r in results if not r.passed]
    assert not failed


def test_a_wrong_gradient_fails_and_is_named(monkeypatch):
    original = ln_ops.LayerNormFunction.backward

    def scaled(ctx, *grads):
        dx, *rest = original(ctx, *grads)
        return (dx * 1.5, *rest)

    monkeypatch.setattr(ln_ops.LayerNormFunction, "backward", staticmethod(scaled))
    # One op is enough: on a failure gradcheck rebuilds both Jacobians in full to report
    # them, ~20 s an op through the interpreter.
    cases = G.op_cases
    monkeypatch.setattr(G, "op_cases", lambda device: {"layernorm": [
        c for c in cases(device)["layernorm"] if c[0] == "layer_norm"]})
    kernels = {**dict.fromkeys(KERNEL_FAMILIES, False), "layernorm": True}
    failed = [r.name for r in G.check_ops(kernels) if not r.passed]
    assert failed == ["ops/layer_norm"]
    model_failed = [r.name for r in G.check_model(GPTConfig(**TINY, kernels=kernels),
                                                  torch.float32, "cpu") if not r.passed]
    assert model_failed  # parameters upstream of the wrong LayerNorm gradient


@pytest.mark.parametrize("family", ["layernorm"])
def test_script_summary_and_exit_code(tmp_path, family):
    off = [f"model.kernels.{k}=false" for k in KERNEL_FAMILIES if k != family]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gradcheck.py"),
                        f"hydra.run.dir={tmp_path}", *off], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].startswith("gradcheck: ")
    assert ", 0 failed" in r.stdout


def test_the_tolerances_catch_a_one_percent_error(monkeypatch):
    ce = importlib.import_module("fusedtrain.ops.cross_entropy")  # ops.cross_entropy: the op
    original = ce.CrossEntropyFunction.backward

    def off_by_one_percent(ctx, *grads):
        dlogits, *rest = original(ctx, *grads)
        return (dlogits * 1.01, *rest)

    # A shape and draw at which torch's default tolerances pass the wrong gradient.
    logits = torch.randn(8, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (8,))
    fn = lambda x: ops.cross_entropy(x, targets)  # noqa: E731
    assert G.gradcheck(fn, (logits,), fast_mode=True)
    monkeypatch.setattr(ce.CrossEntropyFunction, "backward", staticmethod(off_by_one_percent))
    assert not G.gradcheck(fn, (logits,), fast_mode=True, raise_exception=False)
