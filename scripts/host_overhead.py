"""Host (CPU) cost of one call of each fused op and of its eager twin, forward and
forward+backward, at sizes whose GPU time is small, so the wall time per call is what
Python, autograd and the kernel launchers cost. The backward is timed both on autograd's
worker thread per GPU (PyTorch's default) and on the calling thread (what scripts/train.py
does, autograd_threads=false): every fused op's backward is a Python node, which the
worker thread must be handed.

  python scripts/host_overhead.py [--tokens 2048] [--width 768] [--heads 12] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch

from fusedtrain import eager, ops
from fusedtrain.bench.kernels import fwd_bwd, randn


def per_call_us(fn: Callable[[], None], calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def op_cases(tokens: int, width: int, heads: int) -> dict[str, tuple[Callable, Callable, list]]:
    """name -> (fused op, eager twin, inputs): bf16 on the GPU, x of shape (2, tokens / 2,
    width), q/k/v of shape (2, heads, tokens / 2, width / heads)."""
    B, T, C, H = 2, tokens // 2, width, heads
    x, r, w, b = randn(B, T, C), randn(B, T, C), randn(C), randn(C)
    mlp = [x, randn(4 * C, C, scale=C ** -0.5), randn(4 * C),
           randn(C, 4 * C, scale=(4 * C) ** -0.5), randn(C)]
    qkv = [x, randn(3 * C, C, scale=C ** -0.5), randn(3 * C)]
    q, k, v = (randn(B, H, T, C // H) for _ in range(3))
    return {
        "layer_norm": (ops.layer_norm, eager.layer_norm, [x, w, b]),
        "add_layer_norm": (ops.add_layer_norm, eager.add_layer_norm, [x, r, w, b]),
        "fused_mlp": (lambda *a: ops.fused_mlp(*a, "tanh"),
                      lambda *a: eager.fused_mlp(*a, "tanh"), mlp),
        "qkv_projection": (lambda *a: ops.qkv_projection(*a, H),
                           lambda *a: eager.qkv_projection(*a, H), qkv),
        "flash_attention": (ops.flash_attention, eager.flash_attention, [q, k, v]),
    }


def timings(fn: Callable, inputs: list, calls: int) -> dict[str, float]:
    def fwd():
        with torch.no_grad():
            fn(*inputs)

    result = {"fwd_us": per_call_us(fwd, calls)}
    for threads in (True, False):
        with torch.autograd.set_multithreading_enabled(threads):
            key = "fwd_bwd_us_worker_thread" if threads else "fwd_bwd_us_calling_thread"
            result[key] = per_call_us(fwd_bwd(fn, inputs), calls)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.tokens < 2 or args.tokens % 2 or args.width % args.heads:
        print("--tokens must be even and --width divisible by --heads", file=sys.stderr)
        return 2
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tokens": args.tokens, "width": args.width, "heads": args.heads}
    for name, (fused, twin, inputs) in op_cases(args.tokens, args.width, args.heads).items():
        result[name] = {"fused": timings(fused, inputs, args.calls),
                        "eager": timings(twin, inputs, args.calls)}
        print(name, json.dumps(result[name]), flush=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
