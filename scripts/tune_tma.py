"""Sweep the tile shapes of the persistent TMA GEMMs (kernels/_tma.py) on this GPU.

    python scripts/tune_tma.py [--out DIR]

For each MLP GEMM (Linear+GELU forward, the dGELU backward GEMM, the gelu(h) weight
gradient) at the benchmark shapes, times every candidate TmaConfig with do_bench
(bf16, fresh random data), checks its output against torch, and prints milliseconds next
to the bare cuBLAS GEMM of the same size. The winners are what `tma_config` encodes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

from fusedtrain.kernels import linear_gelu as K
from fusedtrain.kernels._tma import TmaConfig

SHAPES = [(16384, 768, 3072), (16384, 1024, 4096), (16384, 2048, 8192), (16384, 3072, 768)]
CANDIDATES = [TmaConfig(*c) for c in [
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
    (256, 128, 64, 8, 3), (128, 256, 128, 8, 2), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
]]


def _dgelu_reference(g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    hf = h.float().requires_grad_()
    out = torch.nn.functional.gelu(hf, approximate="tanh")
    return torch.autograd.grad(out, hf, g.float())[0]


def cases(M: int, K_: int, N: int) -> dict:
    """name -> (run(config), reference output, cuBLAS GEMM of the same size)."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, w = torch.randn(M, K_, **bf), torch.randn(N, K_, **bf) / K_ ** 0.5
    b = torch.randn(N, **bf)
    h = torch.randn(M, N, **bf)
    dy, w2 = torch.randn(M, K_, **bf), torch.randn(K_, N, **bf) / K_ ** 0.5
    F = torch.nn.functional
    return {
        "linear_gelu_fwd": (lambda c: K.linear_gelu_fwd(x, w, b, "tanh", False, config=c)[0],
                            lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
                            lambda: x @ w.t()),
        "matmul_dgelu": (lambda c: K.matmul_dgelu(dy, w2, h, "tanh", config=c),
                         lambda: _dgelu_reference(dy @ w2, h),
                         lambda: dy @ w2),
        "matmul_gelu_rhs": (lambda c: K.matmul_gelu_rhs(dy, h, "tanh", config=c),
                            lambda: dy.t() @ F.gelu(h, approximate="tanh"),
                            lambda: dy.t() @ h),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kernels", nargs="+", help="only these kernels")
    parser.add_argument("--quick", action="store_true", help="only the first four tilings")
    args = parser.parse_args(argv)
    results = []
    for shape in SHAPES:
        for name, (run, ref, cublas) in cases(*shape).items():
            if args.kernels and name not in args.kernels:
                continue
            expect = ref().float()
            base = triton.testing.do_bench(cublas)
            row = {"kernel": name, "shape": shape, "cublas_ms": base, "configs": {}}
            for cfg in CANDIDATES[:4] if args.quick else CANDIDATES:
                key = "x".join(map(str, (cfg.block_m, cfg.block_n, cfg.block_k))) + \
                    f"-w{cfg.num_warps}-s{cfg.num_stages}"
                try:
                    err = (run(cfg).float() - expect).abs().max().item()
                    row["configs"][key] = {"ms": triton.testing.do_bench(lambda c=cfg, r=run: r(c)),
                                           "max_err": err}
                except Exception as e:  # a tile that does not fit in shared memory
                    row["configs"][key] = {"error": type(e).__name__}
            timed = {k: v["ms"] for k, v in row["configs"].items() if "ms" in v}
            best = min(timed, key=timed.get)
            print(f"{name:16s} {str(shape):20s} cuBLAS {base:.3f} ms  best {best} "
                  f"{timed[best]:.3f} ms ({timed[best] / base:.2f}x)  "
                  + " ".join(f"{k}:{v:.3f}" for k, v in timed.items()), flush=True)
            results.append(row)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune_tma.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
             "triton": triton.__version__, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
