"""Trace every traceable launcher as torch.compile's functionalization does under
`ops.trace_kernels()`, on a machine without a GPU, and check each graph: the op is gone,
its Triton launches are there (`triton_kernel_wrapper_functional`), no launch copies a
tensor it only reads (Triton's mutation analysis of the kernel, for sm_90, found what the
kernel writes), and no launch is given a tensor the launcher made under two names that
count as written (see _aliased_writes). scripts/traced_execution.py runs the graphs.

Fake CUDA tensors stand in for the data and the kernels are defined for the GPU, not the
interpreter (Triton's interpreter cannot be traced). A check of the graphs' structure, not
of Inductor's code or the GPU's result: those need the GPU (`bench.py train --variants
compile-fused compile-fused-traced`, and the GPU tests).

  python scripts/traced_graphs.py [--cases layer_norm_fwd ...]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import types
from collections.abc import Callable
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
ATT, CE, EMB, LG, LN, QKV, ROPE, SW = (importlib.import_module(f"fusedtrain.ops.{m}") for m in (
    "attention", "cross_entropy", "embedding", "linear_gelu", "layernorm", "qkv", "rope",
    "swiglu"))

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
# Where the cases' tensors are made: fake CUDA ones under a FakeTensorMode to trace, real
# ones on the CPU to run the traced graphs (scripts/traced_execution.py).
DEVICE = "cuda"


def _t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def _ids(*shape: int, high: int = 1000) -> torch.Tensor:
    return torch.randint(0, high, shape, device=DEVICE)


# torch's mutation analysis follows a store's address back through the loads it came
# from, so kernels that store at rows read from an id tensor count the ids as written:
# Inductor copies them each call (N int64s, 128 KB at gpt2's 16 x 1024 tokens; the ids
# again as pid_ptr, the position ids' stand-in, in gpt_embedding_bwd).
_IDS = frozenset({"idx_ptr"})
# The same for the attention kernels' sequence starts: a packed batch's cu_seqlens
# ((batch + 1,) int32s) are copied.
_CU = frozenset({"cu_q_ptr", "cu_k_ptr"})
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
    # up to 2048 tokens the table sweep, which stores at its own rows; beyond, the per-id
    # rows of a 16-bit gradient (fewer tokens than rows) or the atomic fp32 table
    "embedding_bwd": (EMB._embedding_bwd, lambda: (_ids(256), _t(256, 768), 1000), _NONE),
    "embedding_bwd_rows": (EMB._embedding_bwd, lambda: (
        _ids(4096, high=8192), _t(4096, 768), 8192), _IDS),
    "embedding_bwd_table": (EMB._embedding_bwd, lambda: (_ids(4096), _t(4096, 768), 1000),
                            _IDS),
    "gpt_embedding_fwd": (EMB._gpt_embedding_fwd, lambda: (
        _ids(4, 64), _t(1000, 768, dtype=F32), _t(64, 768, dtype=F32), None), _IDS),
    "gpt_embedding_bwd": (EMB._gpt_embedding_bwd, lambda: (
        _ids(4, 64), _t(4, 64, 768), None, 1000, 64, None), _IDS | {"pid_ptr"}),
    "attention_fwd": (ATT.attention_fwd, lambda: (*_heads(12, 12, 12), True, 0.125), _NONE),
    "attention_bwd": (ATT.attention_bwd, lambda: (
        *_heads(12, 12, 12, 12, 12), _t(2, 12, 256, dtype=F32), True, 0.125, -1, -1, 0.0, F32),
        _NONE),
    "attention_bwd_no_bias": (ATT.attention_bwd, lambda: (
        *_heads(12, 12, 12, 12, 12), _t(2, 12, 256, dtype=F32), False, 0.125), _NONE),
    "attention_bwd_grouped": (ATT.attention_bwd_grouped, lambda: (
        *_heads(12, 12, 4, 4, 12), _t(2, 12, 256, dtype=F32), True, 0.125, 128, 0, 30.0),
        _NONE),
    "attention_fwd_varlen": (ATT.attention_fwd_varlen, lambda: (
        *_packed(12, 4, 4), *_cu(), 300, 300, True, 0.125, -1, -1, 0.0), _CU),
    "attention_bwd_varlen": (ATT.attention_bwd_varlen, lambda: (
        *_packed(12, 12, 4, 4, 12), _t(3, 12, 300, dtype=F32), *_cu(), 300, 300, True, 0.125,
        -1, -1, 0.0), _CU),
    "attention_bwd_varlen_packed": (ATT.attention_bwd_varlen_packed, lambda: (
        *_packed(12, 12, 4, 4, 12), _t(3, 12, 300, dtype=F32), *_cu(), 300, 300, True, 0.125,
        -1, -1, 0.0, None, None), _CU),
    "attention_bwd_varlen_packed_rope": (ATT.attention_bwd_varlen_packed, lambda: (
        *_packed(12, 12, 4, 4, 12), _t(3, 12, 300, dtype=F32), *_cu(), 300, 300, True, 0.125,
        -1, -1, 0.0, 10000.0, _ids(1, 600)), _CU),
    "linear_gelu_fwd": (LG._linear_gelu_fwd, lambda: (
        _t(256, 768), _t(3072, 768), _t(3072), "tanh"), _NONE),
    "linear_gelu_infer": (LG._linear_gelu_infer, lambda: (
        _t(256, 768), _t(3072, 768), _t(3072), "tanh"), _NONE),
    "matmul_dgelu": (LG._matmul_dgelu, lambda: (
        _t(256, 768), _t(768, 3072), _t(256, 3072), "tanh", F32), _NONE),
    "matmul_gelu_rhs": (LG._matmul_gelu_rhs, lambda: (
        _t(4096, 768), _t(4096, 3072), "tanh", F32), _NONE),
    "gelu_bwd": (LG._gelu_bwd, lambda: (_t(256, 3072), _t(256, 3072), "tanh", F32), _NONE),
    "swiglu_fwd": (SW._swiglu_fwd, lambda: (_t(256, 768), _t(2048, 768), _t(2048, 768)),
                   _NONE),
    "swiglu_bwd": (SW._swiglu_bwd, lambda: (
        _t(256, 768), _t(768, 2048), _t(256, 2048), _t(256, 2048)), _NONE),
    "qkv_fwd": (QKV.qkv_fwd, lambda: (
        _t(2, 128, 768), _t(2304, 768), _t(2304), 12, 12, None, None), _NONE),
    "qkv_fwd_grouped_rotated": (QKV.qkv_fwd, lambda: (
        _t(2, 128, 768), _t(1536, 768), None, 12, 6, 10000.0, _ids(2, 128, high=128)), _NONE),
    "qkv_bwd": (QKV.qkv_bwd, lambda: (
        *_heads(12, 12, 12), _t(2, 256, 768), _t(2304, 768), F32, F32, None, None), _NONE),
    # The two ops that write an input by contract: the logits' gradient over the logits,
    # the input embedding's rows added into the head's gradient.
    "cross_entropy_fwd_grad_into": (CE._cross_entropy_fwd_grad_into, lambda: (
        _t(256, 1000), _ids(256), -100), frozenset({"dlogits_ptr"})),
    "gpt_embedding_bwd_into": (EMB._gpt_embedding_bwd_into, lambda: (
        _ids(4, 64), _t(4, 64, 768), _t(1000, 768, dtype=F32), 64, None),
        _IDS | {"pid_ptr", "dw_ptr"}),
}


def _heads(*heads: int) -> list[torch.Tensor]:
    """(2, H, 256, 64) tensors laid out as the model's, (B, T, H, D) transposed."""
    return [_t(2, 256, h, 64).transpose(1, 2) for h in heads]


def _packed(*heads: int) -> list[torch.Tensor]:
    """A packed batch's (600, H, 64) tensors."""
    return [_t(600, h, 64) for h in heads]


def _cu() -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens of three documents, for the queries and the keys."""
    cu = torch.tensor([0, 300, 300, 600], device=DEVICE, dtype=torch.int32)
    return cu, cu


def functionalized(fn: Callable, make_args: Callable[[], list]) -> torch.fx.GraphModule:
    """fn's graph as AOTAutograd's functionalization traces it, on the fake tensors
    make_args() makes under a FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        return make_fx(dispatch_functionalize(fn), tracing_mode="fake")(*make_args())


def traced_graph(name: str) -> torch.fx.GraphModule:
    """The launcher's graph as AOTAutograd's functionalization traces it."""
    call, make_args, _ = CASES[name]
    return functionalized(lambda *a: call(*a), make_args)


# What a tensor handed to a kernel may be derived through and still be the same memory.
_VIEWS = (getitem, torch.ops.aten.unbind.int, torch.ops.aten.select_scatter.default,
          torch.ops.aten.slice_scatter.default)


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor node is a view of (itself if none). A launch's outputs, items of its
    node, are tensors of their own."""
    while node.op == "call_function" and (getattr(node.target, "is_view", False)
                                          or node.target in _VIEWS):
        if node.args[0].target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            break
        node = node.args[0]
    return node


def _graph_input(node: torch.fx.Node) -> bool:
    """Whether node is a graph input, or a view of one (not a tensor the launcher
    allocated, nor an earlier launch's output)."""
    return _root(node).op == "placeholder"


def _aliased_writes(kernel: str, node: torch.fx.Node) -> list[str]:
    """A tensor handed to one launch under two names, one of them a name it writes.
    Functionalization copies each name counted as written apart and then puts every copy
    back over the one input in turn, so the last name's copy wins: should Triton's
    mutation analysis count a second name (as it does a pointer whose loads feed a store's
    address, and every pointer where it fails), the kernel's writes through the first are
    lost (torch's TODO in triton_kernel_wrap.py; `_launch.stand_in`). Graph inputs are
    left out: these launchers only read them (ids, sequence starts), so every copy put
    back is equal."""
    written = node.kwargs["tensors_to_clone"]
    names: dict[torch.fx.Node, list[str]] = {}
    views: dict[torch.fx.Node, set[torch.fx.Node]] = {}  # written views, by their buffer
    for key, value in node.kwargs["kwargs"].items():
        if isinstance(value, torch.fx.Node):
            names.setdefault(value, []).append(key)
            if key in written and not _graph_input(value):
                views.setdefault(_root(value), set()).add(value)
    wrong = [f"{kernel}: one tensor passed as {', '.join(keys)}, written as "
             f"{', '.join(k for k in keys if k in written)}"
             for node, keys in names.items()
             if len(keys) > 1 and any(k in written for k in keys) and not _graph_input(node)]
    # Two written views of one buffer: functionalization copies each apart from the
    # storage's start to its own end (clone_preserve_strides), and Inductor (torch 2.11)
    # read the second view's copy out of the first's, past its end: an illegal memory
    # access on the GPU at gpt2's shape (the attention's dk and dv).
    return wrong + [f"{kernel}: written views of one buffer passed as "
                    f"{', '.join(k for v in sorted(vs, key=str) for k in names[v])}"
                    for vs in views.values() if len(vs) > 1]


def problems(name: str, gm: torch.fx.GraphModule) -> tuple[list[str], list[str]]:
    """(the kernels the graph launches, what is wrong with it)."""
    kernels, wrong, copied = [], [], set()
    for node in gm.graph.nodes:
        target = str(node.target)
        if "fusedtrain" in target:
            wrong.append(f"{target} stayed opaque")
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            jit = getattr(kernel, "fn", kernel)
            kernels.append(getattr(jit, "__name__", type(jit).__name__))
            # these launchers write only tensors they allocate: a graph input among those
            # to copy is a copy Inductor will make of it on every call
            copied |= {arg for arg in node.kwargs["tensors_to_clone"]
                       if _graph_input(node.kwargs["kwargs"][arg])}
            wrong += _aliased_writes(kernels[-1], node)
    if not kernels:
        wrong.append("no Triton launch in the graph")
    if copied != CASES[name][2]:
        wrong.append(f"its launches copy {sorted(copied)}, expected {sorted(CASES[name][2])}")
    return kernels, wrong


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = p.parse_args()
    _on_a_fake_hopper()
    ops.trace_kernels(True)
    uncovered = sorted(set(TRACEABLE) - {CASES[c][0].op_name for c in CASES})
    for name in uncovered:
        print(f"{name:28s} FAIL\n    registered traceable, but no case here traces it")
    failed = 0
    for name in args.cases:
        try:
            kernels, wrong = problems(name, traced_graph(name))
        except Exception as e:  # noqa: BLE001 (reported per case, the others still traced)
            kernels, wrong = [], [f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"]
        failed += bool(wrong)
        print(f"{name:28s} {'FAIL' if wrong else 'ok  '} {' '.join(kernels)}"
              + "".join(f"\n    {w}" for w in wrong))
    print(f"{len(args.cases) - failed} of {len(args.cases)} cases traced into their kernels; "
          f"{len(TRACEABLE) - len(uncovered)} of {len(TRACEABLE)} traceable launchers covered")
    return 1 if failed or uncovered else 0


if __name__ == "__main__":
    sys.exit(main())
