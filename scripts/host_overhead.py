"""Host (CPU) cost of one call: forward, and forward+backward, of each LayerNorm form at a
size whose GPU time is negligible, so the wall time per call is what Python, autograd and
the kernel launchers cost. Also lists the process's Python threads (a busy one delays
every Python backward, which runs on autograd's device thread and needs the GIL).

  python scripts/host_overhead.py [--rows 64] [--cols 768] [--calls 300]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

from fusedtrain import eager, ops


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--cols", type=int, default=768)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (seconds)")
    args = p.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    w = torch.ones(args.cols, device="cuda", dtype=x.dtype, requires_grad=True)
    b = torch.zeros(args.cols, device="cuda", dtype=x.dtype, requires_grad=True)
    dy = torch.randn_like(x)
    impls = {"fused": ops.layer_norm, "eager": eager.layer_norm,
             "compile": torch.compile(eager.layer_norm, fullgraph=True),
             "fused, after compiling": ops.layer_norm}
    result = {}
    for name, fn in impls.items():
        def fwd(fn=fn):
            with torch.no_grad():
                fn(x, w, b)

        def fwd_bwd(fn=fn):
            torch.autograd.grad(fn(x, w, b), (x, w, b), dy)

        result[name] = {"fwd_us": per_call_us(fwd, args.calls),
                        "fwd_bwd_us": per_call_us(fwd_bwd, args.calls)}
    result["threads"] = [t.name for t in threading.enumerate()]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
