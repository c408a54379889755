"""Trace every traceable launcher as torch.compile's functionalization does under
`ops.trace_kernels()`, on a machine without a GPU, and check each graph: the op is gone,
its Triton launches are there (`triton_kernel_wrapper_functional`), and no launch copies
a tensor it only reads (Triton's mutation analysis of the kernel, for sm_90, found what
the kernel writes).

Fake CUDA tensors stand in for the data and the kernels are defined for the GPU, not the
interpreter (Triton's interpreter cannot be traced). A check of the graphs' structure, not
of Inductor's code or the GPU's result: those need the GPU (`bench.py train --variants
compile-fused compile-fused-traced`, and the GPU tests).

  python scripts/traced_graphs.py [--ops layer_norm_fwd ...]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import types
from operator import getitem

import torch

# Before fusedtrain is imported: kernels defined for the GPU, not the interpreter.
os.environ.pop("TRITON_INTERPRET", None)
torch.cuda.is_available = lambda: True

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from fusedtrain import ops  # noqa: E402
from fusedtrain.kernels import _device  # noqa: E402
from fusedtrain.ops._registry import TRACEABLE  # noqa: E402
from fusedtrain.ops.bias_grad import column_sums  # noqa: E402

# modules by path: fusedtrain.ops exports functions of the same names
CE, EMB, LN, ROPE = (importlib.import_module(f"fusedtrain.ops.{m}")
                     for m in ("cross_entropy", "embedding", "layernorm", "rope"))

torch.cuda.is_available = lambda: False  # torch itself has no CUDA here: no RNG state to save


class _HopperDriver:
    """What Triton's mutation analysis asks of a driver: the target it compiles for."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0


def _on_a_fake_hopper() -> None:
    triton.runtime.driver.set_active(_HopperDriver())
    torch.cuda.get_device_capability = lambda *_: (9, 0)
    _device._properties = lambda _: types.SimpleNamespace(multi_processor_count=132,
                                                           L2_cache_size=50 * 2**20)


BF16, F32 = torch.bfloat16, torch.float32


def _t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _ids(*shape: int, high: int = 1000) -> torch.Tensor:
    return torch.randint(0, high, shape, device="cuda")


# torch's mutation analysis follows a store's address back through the loads it came
# from, so kernels that store at rows read from an id tensor count the ids as written:
# Inductor copies them each call (N int64s, 128 KB at gpt2's 16 x 1024 tokens; the ids
# again as pid_ptr, the position ids' stand-in, in gpt_embedding_bwd).
_IDS = frozenset({"idx_ptr"})
_NONE: frozenset[str] = frozenset()

# name -> (launcher call, its arguments at a gpt2-like shape, made under the fake mode, the
# inputs Inductor will copy)
CASES = {
    "layer_norm_fwd": (LN._layer_norm_fwd, lambda: (
        _t(4, 64, 768), _t(768, dtype=F32), _t(768, dtype=F32), 1e-5, "", BF16, True), _NONE),
    "add_layer_norm_fwd": (LN._add_layer_norm_fwd, lambda: (
        _t(4, 64, 768), _t(4, 64, 768), _t(768, dtype=F32), None, 1e-5, BF16, BF16, True),
        _NONE),
    "layer_norm_bwd": (LN._layer_norm_bwd, lambda: (
        _t(4, 64, 768), _t(4, 64, 768), _t(768, dtype=F32), _t(768, dtype=F32),
        _t(2, 256, dtype=F32), _t(4, 64, 768), "tanh", BF16, F32), _NONE),
    "bias_grad": (column_sums, lambda: (_t(4096, 768), F32), _NONE),
    "cross_entropy_fwd": (CE._cross_entropy_fwd, lambda: (_t(256, 1000), _ids(256), -100),
                          _NONE),
    "kept_mean": (CE._kept_mean, lambda: (_t(256, dtype=F32), _ids(256), -100), _NONE),
    "cross_entropy_bwd": (CE._cross_entropy_bwd, lambda: (
        _t(256, 1000), _ids(256), _t(256, dtype=F32), _t(1, dtype=F32), -100), _NONE),
    "scaled": (CE._scaled, lambda: (_t(256, 768), _t(1, dtype=F32)), _NONE),
    "rope": (ROPE._rope, lambda: (_t(4, 12, 64, 64), 10000.0, _ids(4, 64, high=64), False),
             _NONE),
    "embedding_bwd": (EMB._embedding_bwd, lambda: (_ids(256), _t(256, 768), 1000), _IDS),
    "gpt_embedding_fwd": (EMB._gpt_embedding_fwd, lambda: (
        _ids(4, 64), _t(1000, 768, dtype=F32), _t(64, 768, dtype=F32), None), _IDS),
    "gpt_embedding_bwd": (EMB._gpt_embedding_bwd, lambda: (
        _ids(4, 64), _t(4, 64, 768), None, 1000, 64, None), _IDS | {"pid_ptr"}),
}


def traced_graph(name: str) -> torch.fx.GraphModule:
    """The launcher's graph as AOTAutograd's functionalization traces it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    call, make_args, _ = CASES[name]
    with FakeTensorMode():
        args = make_args()
        return make_fx(dispatch_functionalize(lambda *a: call(*a)), tracing_mode="fake")(*args)


def _allocated(node: torch.fx.Node) -> bool:
    """Whether node is a tensor the launcher allocated (or an earlier launch's output)."""
    return node.target in (torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default,
                           torch.ops.aten.empty_like.default) or node.target is getitem


def problems(name: str, gm: torch.fx.GraphModule) -> tuple[list[str], list[str]]:
    """(the kernels the graph launches, what is wrong with it)."""
    kernels, wrong = [], []
    for node in gm.graph.nodes:
        target = str(node.target)
        if "fusedtrain" in target:
            wrong.append(f"{target} stayed opaque")
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            jit = getattr(kernel, "fn", kernel)
            kernels.append(getattr(jit, "__name__", type(jit).__name__))
            # these launchers write only tensors they allocate: another tensor among those
            # to copy is a copy Inductor will make of it on every call
            copied = {arg for arg in node.kwargs["tensors_to_clone"]
                      if not _allocated(node.kwargs["kwargs"][arg])}
            if copied != CASES[name][2]:
                wrong.append(f"{kernels[-1]} copies {sorted(copied)}, expected "
                             f"{sorted(CASES[name][2])}")
    if not kernels:
        wrong.append("no Triton launch in the graph")
    return kernels, wrong


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", choices=list(CASES), default=list(CASES))
    args = p.parse_args()
    _on_a_fake_hopper()
    ops.trace_kernels(True)
    failed = 0
    for name in sorted(set(TRACEABLE) - set(CASES)):
        print(f"{name:20s} FAIL\n    registered traceable, but no case here traces it")
        failed += 1
    for name in args.ops:
        try:
            kernels, wrong = problems(name, traced_graph(name))
        except Exception as e:  # noqa: BLE001 (reported per op, the others still traced)
            kernels, wrong = [], [f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"]
        failed += bool(wrong)
        print(f"{name:20s} {'FAIL' if wrong else 'ok  '} {' '.join(kernels)}"
              + "".join(f"\n    {w}" for w in wrong))
    print(f"{len(args.ops) + len(set(TRACEABLE) - set(CASES)) - failed} of "
          f"{len(set(TRACEABLE) | set(args.ops))} traceable launchers traced into their kernels")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
