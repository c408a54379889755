"""Run every traceable launcher's traced graph on CPU tensors and check that it computes
what the launcher computes when called directly: the same outputs and the same writes to
its inputs, bit for bit; then the tiny GPT, gpt2's and llama's blocks, compiled under
trace_kernels without Inductor, against the uncompiled model's gradients.

traced_graphs.py checks a graph's structure; this checks its meaning, which
functionalization can change while the structure looks right (a written tensor passed to
one launch under three names came back unwritten: docs/journal.md). Both runs take the
same path decisions, on traced_graphs.py's fake Hopper, and run each Triton launch
through its interpreter twin: the same kernel defined again under TRITON_INTERPRET=1,
with the few PTX instructions its GPU form uses emulated in numpy. Not a check of
Inductor's code or of the GPU's results: those need the GPU (the `-m gpu` tests in
tests/test_registration.py).

  python scripts/traced_execution.py [--cases attention_bwd ...] [--models gpt2 llama]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import pkgutil
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.utils._pytree as pytree
import traced_graphs as TG  # before fusedtrain: fake CUDA, kernels defined for the GPU
from triton.runtime import interpreter
from triton.runtime.autotuner import Autotuner


def _interpreter_twins() -> dict[str, object]:
    """fusedtrain.kernels' modules imported a second time under TRITON_INTERPRET=1, by
    name; sys.modules is put back, so the GPU-form modules stay the ones in use."""
    ours = [name for name in sys.modules if name.split(".")[0] == "fusedtrain"]
    saved = {name: sys.modules.pop(name) for name in ours}
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        package = importlib.import_module("fusedtrain.kernels")
        return {f"fusedtrain.kernels.{m.name}": importlib.import_module(
            f"fusedtrain.kernels.{m.name}") for m in pkgutil.iter_modules(package.__path__)}
    finally:
        del os.environ["TRITON_INTERPRET"]
        for name in [n for n in sys.modules if n.split(".")[0] == "fusedtrain"]:
            del sys.modules[name]
        sys.modules.update(saved)


# The PTX the GPU forms inline (kernels/_primitives.py), as numpy computes it.
_PTX = {"tanh.approx.f32": np.tanh, "rcp.approx.ftz.f32": np.reciprocal,
        "sin.approx.ftz.f32": np.sin, "cos.approx.ftz.f32": np.cos, "mul.rn.f32": np.multiply}


class _OneResult:
    def __init__(self, handle):
        self.handle = handle

    def get_result(self, _: int):
        return self.handle


def _emulated_inline_asm(self, asm, constraints, values, types, is_pure, pack):
    out = _PTX[asm.split(" ")[0]](*[v.data for v in values]).astype(values[0].data.dtype)
    return _OneResult(interpreter.TensorHandle(out, values[0].dtype.scalar))


class _Twin:
    """Stands in for a GPU kernel (a JITFunction or an Autotuner over one): launches its
    interpreter twin, an autotuned kernel with its first config, as both runs do."""

    def __init__(self, kernel, twins: dict[str, object]):
        self.tuner = kernel if isinstance(kernel, Autotuner) else None
        self.fn = kernel.fn if self.tuner else kernel  # what Triton's wrappers read
        self.arg_names = self.fn.arg_names
        self.configs = kernel.configs if self.tuner else None
        twin = getattr(twins[self.fn.fn.__module__], self.fn.fn.__name__)
        while type(twin) is not interpreter.InterpretedFunction:  # FastLaunch, Autotuner
            twin = twin.fn
        self.twin = twin

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            config = dict(self.tuner.configs[0].kwargs) if self.tuner else {}
            meta = {**dict(zip(self.arg_names, args)), **kwargs, **config}
            self.twin[grid(meta) if callable(grid) else grid](*args, **kwargs, **config)
        return launch


@contextlib.contextmanager
def _interpreted(twins: dict[str, object]) -> Iterator[None]:
    """Within: every launch, from a graph (the triton wrapper's side table) or from a
    launcher called directly (FastLaunch.run), goes to its interpreter twin."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from fusedtrain.kernels import _launch

    get_kernel, run, enabled = kernel_side_table.get_kernel, _launch.FastLaunch.run, _launch.ENABLED
    builder, current_device = (interpreter.InterpreterBuilder.create_inline_asm,
                               torch.cuda.current_device)
    kernel_side_table.get_kernel = lambda idx: _Twin(get_kernel(idx), twins)

    def direct(self, grid, args, kwargs, plan_key=None):
        if _launch.tracing():  # a graph being traced records the launch, as ever
            return run(self, grid, args, kwargs, plan_key)
        return _Twin(self.fn, twins)[grid](*args, **kwargs)

    _launch.FastLaunch.run = direct
    _launch.ENABLED = False  # no compiled-kernel plans: there is no compiled kernel
    interpreter.InterpreterBuilder.create_inline_asm = _emulated_inline_asm
    torch.cuda.current_device = lambda: 0  # the fake Hopper's properties are device 0's
    try:
        yield
    finally:
        kernel_side_table.get_kernel, _launch.FastLaunch.run = get_kernel, run
        _launch.ENABLED = enabled
        interpreter.InterpreterBuilder.create_inline_asm = builder
        torch.cuda.current_device = current_device


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _with_inputs(call):
    """call's outputs, then its tensor arguments: their values after the call, so that
    a graph's writes to its inputs are compared too (functionalization returns them as
    values; AOTAutograd copies them back)."""
    return lambda *args: (call(*args), _tensors(args))


def _graph(call, real: list) -> torch.fx.GraphModule:
    """The launcher traced as traced_graphs.traced_graph does, on fake CUDA tensors laid
    out as `real`, its devices then moved to the CPU."""
    gm = TG.functionalized(_with_inputs(call), lambda: [
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda")
        if isinstance(a, torch.Tensor) else a for a in real])
    for node in gm.graph.nodes:
        if str(node.kwargs.get("device", "")).startswith("cuda"):
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    gm.recompile()
    return gm


def differences(name: str, twins: dict[str, object]) -> list[str]:
    """What differs between the traced graph's run and the launcher's direct run."""
    from fusedtrain import ops

    call, make_args, _ = TG.CASES[name]
    torch.manual_seed(0)
    TG.DEVICE = "cpu"
    try:
        real = list(make_args())
    finally:
        TG.DEVICE = "cuda"
    ops.trace_kernels(True)
    try:
        gm = _graph(call, real)
    finally:
        ops.trace_kernels(False)

    def fresh() -> list:
        return [a.clone() if isinstance(a, torch.Tensor) else a for a in real]

    with _interpreted(twins):
        traced = _tensors(gm(*fresh()))
        direct = _tensors(_with_inputs(call)(*fresh()))
    if len(traced) != len(direct):
        return [f"{len(traced)} tensors out of the graph, {len(direct)} from the launcher"]
    wrong = []
    for i, (got, want) in enumerate(zip(traced, direct)):
        if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
            worst = ((got.double() - want.double()).abs().max().item()
                     if got.shape == want.shape and got.numel() else "shape/dtype")
            wrong.append(f"tensor {i} of {len(direct)} ({tuple(want.shape)}, {want.dtype}) "
                         f"differs: max |traced - direct| = {worst}")
    return wrong


def model_differences(blocks: str, twins: dict[str, object]) -> list[str]:
    """The tiny GPT (every family fused; gpt2's blocks or llama's) compiled under
    trace_kernels with AOTAutograd and no Inductor (`backend="aot_eager"`), one loss and
    backward on the CPU against the uncompiled model's, launches through the twins.
    Traced inside the patch, so Triton's mutation analysis cannot read the kernels and
    counts every pointer as written: the worst case for a tensor passed twice. Gradients
    agree within fp32 rounding (the compiled graph orders some sums differently)."""
    from fusedtrain import ops
    from fusedtrain.model import GPT, KERNEL_FAMILIES, GPTConfig

    shape = dict(block_size=32, vocab_size=128, n_layer=1, n_head=2, n_embd=64)
    if blocks == "llama":
        shape.update(n_kv_head=1, bias=False, norm="rmsnorm", mlp="swiglu", mlp_hidden=128,
                     pos="rope", tie_head=False)
    # its "assuming every input is mutated", with a traceback, for every launch traced
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape, kernels=dict.fromkeys(KERNEL_FAMILIES, True)))
    idx = torch.randint(0, 128, (2, 33))

    def step(loss_fn) -> dict[str, torch.Tensor]:
        loss = loss_fn(idx[:, :-1], idx[:, 1:])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return {**grads, "loss": loss.detach()}

    with _interpreted(twins):
        want = step(model.loss)
        torch._dynamo.reset()
        ops.trace_kernels(True)
        try:
            got = step(torch.compile(model.loss, backend="aot_eager", fullgraph=True))
        finally:
            ops.trace_kernels(False)
            torch._dynamo.reset()
    wrong = [f"{name}: missing from the compiled model's gradients" for name in want
             if name not in got]
    for name, w in want.items():
        if name in got and not torch.allclose(got[name], w, rtol=1e-5, atol=1e-6):
            wrong.append(f"{name}: max |compiled - uncompiled| = "
                         f"{(got[name] - w).abs().max().item():.3g} (|max| {w.abs().max():.3g})")
    return wrong


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=list(TG.CASES), default=list(TG.CASES))
    p.add_argument("--models", nargs="*", choices=["gpt2", "llama"], default=["gpt2", "llama"])
    args = p.parse_args()
    TG._on_a_fake_hopper()
    twins = _interpreter_twins()
    failed = 0
    for name in args.cases:
        start = time.perf_counter()
        try:
            wrong = differences(name, twins)
        except Exception as e:  # noqa: BLE001 (reported per case, the others still run)
            wrong = [f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"]
        failed += bool(wrong)
        print(f"{name:28s} {'FAIL' if wrong else 'ok  '} {time.perf_counter() - start:5.1f} s"
              + "".join(f"\n    {w}" for w in wrong), flush=True)
    print(f"{len(args.cases) - failed} of {len(args.cases)} traced graphs compute what their "
          "launchers compute")
    models_failed = 0
    for blocks in args.models:
        start = time.perf_counter()
        try:
            wrong = model_differences(blocks, twins)
        except Exception as e:  # noqa: BLE001
            wrong = [f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"]
        models_failed += bool(wrong)
        print(f"model {blocks:22s} {'FAIL' if wrong else 'ok  '} "
              f"{time.perf_counter() - start:5.1f} s" + "".join(f"\n    {w}" for w in wrong))
    print(f"{len(args.models) - models_failed} of {len(args.models)} traced models compute "
          "the uncompiled model's gradients")
    return 1 if failed or models_failed else 0


if __name__ == "__main__":
    sys.exit(main())
