"""Sweep the tile shapes of the persistent TMA GEMMs (kernels/_tma.py) on this GPU.

    python scripts/tune_tma.py [--out DIR]

For each MLP GEMM (Linear+GELU forward, the dGELU backward GEMM, the gelu(h) weight
gradient) at the benchmark shapes and the QKV projection's forward at its own, times
every candidate TmaConfig with do_bench (bf16, fresh random data, L2 flushed between
runs), checks its output against torch, and prints milliseconds next to the bare cuBLAS
GEMM of the same size. The winners are what `tma_config` encodes, once the kernel
benchmark's CUDA-graph replays confirm them (they did not for two programs per SM).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

from fusedtrain.kernels import linear_gelu as K
from fusedtrain.kernels import qkv as Q
from fusedtrain.kernels._tma import TmaConfig

SHAPES = [(16384, 768, 3072), (16384, 1024, 4096), (16384, 2048, 8192), (16384, 3072, 768)]
QKV_SHAPES = [(16, 1024, 768, 12), (8, 2048, 2048, 16), (4, 4096, 4096, 32)]
# (block_m, block_n, block_k, warps, stages[, programs per SM, register cap]). The
# two-per-SM tilings fit two programs' registers and shared memory on an sm_90 SM
# (compiled with triton 3.6: <= 256 registers x 4 warps or 128 x 8, <= 113 KiB shared).
CANDIDATES = [TmaConfig(*c) for c in [
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
    (256, 128, 64, 8, 3), (128, 256, 128, 8, 2), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
    (128, 128, 64, 4, 3, 8, 2), (128, 128, 64, 4, 2, 8, 2), (128, 128, 64, 8, 3, 8, 2, 128),
    (128, 128, 64, 8, 2, 8, 2, 128), (64, 256, 64, 4, 2, 8, 2), (128, 64, 64, 4, 4, 8, 2),
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
        # the Linear+GELU forward as inference (and the benchmark's forward row) runs it
        "linear_gelu_fwd": (lambda c: K.linear_gelu_fwd(x, w, b, "tanh", False, config=c)[0],
                            lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
                            lambda: x @ w.t()),
        # ... and as in training, storing h for the backward too
        "linear_gelu_fwd_h": (lambda c: K.linear_gelu_fwd(x, w, b, "tanh", True, config=c)[0],
                              lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
                              lambda: x @ w.t()),
        "matmul_dgelu": (lambda c: K.matmul_dgelu(dy, w2, h, "tanh", config=c),
                         lambda: _dgelu_reference(dy @ w2, h),
                         lambda: dy @ w2),
        "matmul_gelu_rhs": (lambda c: K.matmul_gelu_rhs(dy, h, "tanh", config=c),
                            lambda: dy.t() @ F.gelu(h, approximate="tanh"),
                            lambda: dy.t() @ h),
    }


def qkv_cases(B: int, T: int, C: int, H: int) -> dict:
    """name -> (run(config): (q, k, v), reference: their (3, B, H, T, D) stack, cuBLAS
    x @ W_qkv.T), for the QKV forward."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, w, b = torch.randn(B, T, C, **bf), torch.randn(3 * C, C, **bf) / C ** 0.5, \
        torch.randn(3 * C, **bf)

    def reference():
        y = torch.nn.functional.linear(x, w, b).view(B, T, 3, H, C // H)
        return y.permute(2, 0, 3, 1, 4)

    return {"qkv_fwd": (lambda c: Q.qkv_fwd(x, w, b, H, config=c), reference,
                        lambda: x @ w.t())}


def all_cases():
    """(shape, kernel name, (run, reference, cuBLAS)) for every case, one shape's tensors
    at a time."""
    for shape in SHAPES:
        for name, case in cases(*shape).items():
            yield shape, name, case
    for shape in QKV_SHAPES:
        for name, case in qkv_cases(*shape).items():
            yield shape, name, case


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kernels", nargs="+", help="only these kernels")
    parser.add_argument("--quick", action="store_true", help="only the first four tilings")
    parser.add_argument("--configs", nargs="+", type=int,
                        help="only the candidate tilings of these indices")
    args = parser.parse_args(argv)
    results = []
    for shape, name, (run, ref, cublas) in all_cases():
        if args.kernels and name not in args.kernels:
            continue
        expect = ref().float()
        base = triton.testing.do_bench(cublas)
        row = {"kernel": name, "shape": shape, "cublas_ms": base, "configs": {}}
        chosen = ([CANDIDATES[i] for i in args.configs] if args.configs
                  else CANDIDATES[:4] if args.quick else CANDIDATES)
        for cfg in chosen:
            key = "x".join(map(str, (cfg.block_m, cfg.block_n, cfg.block_k))) + \
                f"-w{cfg.num_warps}-s{cfg.num_stages}-p{cfg.per_sm}" + \
                (f"-r{cfg.maxnreg}" if cfg.maxnreg else "")
            try:
                out = run(cfg)
                out = torch.stack(out) if isinstance(out, tuple) else out
                err = (out.float() - expect).abs().max().item()
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
