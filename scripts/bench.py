"""Kernel microbenchmarks: fused vs eager vs torch.compile vs the library ceiling.

  python scripts/bench.py kernels [--family linear_gelu qkv attention layernorm] [--out DIR]

Every figure is a triton.testing.do_bench median on fresh random data, with all
competitors in this one process; results go to DIR/kernels.json and DIR/kernels.png,
and a table to stdout. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fusedtrain import eager, ops

DTYPE = torch.bfloat16


def bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of fn()."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def fwd_bwd(fn, inputs, grad=None):
    """A closure running fn(*inputs) and its backward (no .grad accumulation)."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def run():
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        grads = grad if grad is not None else [torch.ones_like(o) for o in outs]
        torch.autograd.grad(outs, leaves, grads)

    return run


def compiled(fn):
    return torch.compile(fn, fullgraph=True)


def randn(*shape, scale=1.0, grad=True):
    return (torch.randn(*shape, device="cuda", dtype=DTYPE) * scale).requires_grad_(grad)


def env() -> dict:
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "dtype": str(DTYPE), "date": time.strftime("%Y-%m-%d %H:%M")}


# ---------------------------------------------------------------- families


def bench_linear_gelu(rows: list[dict]) -> None:
    for M, K, N in [(16384, 768, 3072), (16384, 1024, 4096), (16384, 2048, 8192)]:
        x, w, b = randn(M, K), randn(N, K, scale=K ** -0.5), randn(N)
        w2, b2 = randn(K, N, scale=N ** -0.5), randn(K)
        shape = f"M={M} K={K} N={N}"
        lg = lambda f: (lambda x, w, b: f(x, w, b, "tanh"))  # noqa: E731
        mlp = lambda f: (lambda *a: f(*a, "tanh"))  # noqa: E731
        peers = {"fused": ops, "eager": eager}
        r = {"family": "linear_gelu", "shape": shape}
        with torch.no_grad():
            r["fwd"] = {k: bench(lambda f=lg(m.linear_gelu): f(x, w, b)) for k, m in peers.items()}
            r["fwd"]["compile"] = bench(lambda f=compiled(lg(eager.linear_gelu)): f(x, w, b))
            r["fwd"]["cublas"] = bench(lambda: x @ w.t())
        r["fwd_bwd"] = {k: bench(fwd_bwd(lg(m.linear_gelu), (x, w, b))) for k, m in peers.items()}
        r["fwd_bwd"]["compile"] = bench(fwd_bwd(compiled(lg(eager.linear_gelu)), (x, w, b)))
        rows.append(r)
        m = {"family": "mlp", "shape": f"M={M} C={K} H={N}"}
        args = (x, w, b, w2, b2)
        m["fwd_bwd"] = {k: bench(fwd_bwd(mlp(mod.fused_mlp), args)) for k, mod in peers.items()}
        m["fwd_bwd"]["compile"] = bench(fwd_bwd(compiled(mlp(eager.fused_mlp)), args))
        m["saved_MiB"] = {k: saved_mib(mlp(mod.fused_mlp), args) for k, mod in peers.items()}
        rows.append(m)


def saved_mib(fn, args) -> float:
    param_ptrs = {a.untyped_storage().data_ptr() for a in args[1:] if a is not None}
    seen = {}

    def pack(t):
        p = t.untyped_storage().data_ptr()
        if p not in param_ptrs:
            seen[p] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values()) / 2 ** 20


def bench_qkv(rows: list[dict]) -> None:
    for B, T, C, H in [(16, 1024, 768, 12), (8, 2048, 2048, 16), (4, 4096, 4096, 32)]:
        x, w, b = randn(B, T, C), randn(3 * C, C, scale=C ** -0.5), randn(3 * C)
        peers = {"fused": ops.qkv_projection, "eager3": eager.qkv_projection,
                 "linear": eager.qkv_projection_packed,
                 "compile": compiled(eager.qkv_projection_packed)}
        r = {"family": "qkv", "shape": f"B={B} T={T} C={C} H={H}"}
        with torch.no_grad():
            r["fwd"] = {k: bench(lambda f=f: f(x, w, b, H)) for k, f in peers.items()}
            r["fwd"]["cublas"] = bench(lambda: x @ w.t())
        r["fwd_bwd"] = {k: bench(fwd_bwd(lambda *a, f=f: f(*a, H), (x, w, b)))
                        for k, f in peers.items()}
        rows.append(r)


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def bench_attention(rows: list[dict]) -> None:
    from torch.nn.attention import SDPBackend

    peers = {"fused": ops.flash_attention, "eager": eager.flash_attention,
             "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
             "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION)}
    for B, H, T, D in [(16, 12, 1024, 64), (4, 16, 4096, 128), (2, 16, 8192, 128)]:
        for causal in (True, False):
            q, k, v = randn(B, H, T, D), randn(B, H, T, D), randn(B, H, T, D)
            flops = 4 * B * H * T * T * D / (2 if causal else 1)
            r = {"family": "attention", "shape": f"B={B} H={H} T={T} D={D} "
                 f"{'causal' if causal else 'full'}", "fwd": {}, "fwd_bwd": {}}
            for name, f in peers.items():
                try:
                    with torch.no_grad():
                        r["fwd"][name] = bench(lambda f=f: f(q, k, v, causal))
                    r["fwd_bwd"][name] = bench(fwd_bwd(lambda *a, f=f: f(*a, causal), (q, k, v)))
                except (RuntimeError, torch.OutOfMemoryError) as e:
                    print(f"  {name} at {r['shape']}: {type(e).__name__}: {str(e)[:80]}",
                          file=sys.stderr)
                torch.cuda.empty_cache()
            r["fwd_tflops"] = {k: flops / ms / 1e9 for k, ms in r["fwd"].items()}
            r["fwd_bwd_tflops"] = {k: 3.5 * flops / ms / 1e9 for k, ms in r["fwd_bwd"].items()}
            rows.append(r)


def bench_layernorm(rows: list[dict]) -> None:
    buf = torch.empty(2 ** 30, device="cuda", dtype=torch.uint8)
    copy_ms = bench(lambda: buf.clone())
    copy_gbs = 2 * buf.numel() / copy_ms / 1e6
    del buf
    for M, C in [(16384, 768), (16384, 2048), (16384, 4096), (65536, 1024)]:
        x, r_, w, b = randn(M, C), randn(M, C), randn(C, scale=0.1), randn(C, scale=0.1)
        w, b = (w.detach() + 1).requires_grad_(), b
        cases = {
            "layer_norm": ((x, w, b), 2, "layer_norm"),
            "add_layer_norm": ((x, r_, w, b), 4, "add_layer_norm"),
            "layer_norm_gelu": ((x, w, b), 2, "layer_norm_gelu"),
        }
        for op, (args, n_tensors, name) in cases.items():
            fns = {"fused": getattr(ops, name), "eager": getattr(eager, name),
                   "compile": compiled(getattr(eager, name))}
            row = {"family": "layernorm", "op": op, "shape": f"{op} M={M} C={C}"}
            with torch.no_grad():
                row["fwd"] = {k: bench(lambda f=f: f(*args)) for k, f in fns.items()}
            row["fwd_bwd"] = {k: bench(fwd_bwd(f, args)) for k, f in fns.items()}
            fwd_bytes = n_tensors * M * C * 2
            row["fwd_GBps"] = {k: fwd_bytes / ms / 1e6 for k, ms in row["fwd"].items()}
            row["copy_GBps"] = copy_gbs
            rows.append(row)


FAMILIES = {"linear_gelu": bench_linear_gelu, "qkv": bench_qkv, "attention": bench_attention,
            "layernorm": bench_layernorm}


# ---------------------------------------------------------------- report


def print_table(rows: list[dict]) -> None:
    for r in rows:
        for key in ("fwd", "fwd_bwd"):
            if key not in r:
                continue
            t = r[key]
            base = t.get("fused")
            cells = "  ".join(
                f"{k} {v:.3f}ms" + (f" ({v / base:.2f}x)" if base and k != "fused" else "")
                for k, v in t.items())
            print(f"{r['family']:<11} {r['shape']:<38} {key:<7} {cells}")
        for extra in ("saved_MiB", "fwd_bwd_tflops", "fwd_GBps"):
            if extra in r:
                vals = "  ".join(f"{k} {v:.1f}" for k, v in r[extra].items())
                print(f"{'':<11} {r['shape']:<38} {extra}: {vals}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [r for r in rows if "fwd_bwd" in r]
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(panels) + 2))
    labels, y = [], 0
    colors = {}
    for r in panels:
        t = r["fwd_bwd"]
        base = t["fused"]
        for i, (k, v) in enumerate(t.items()):
            c = colors.setdefault(k, f"C{len(colors)}")
            ax.barh(y + i * 0.8 / len(t), base / v, height=0.8 / len(t), color=c,
                    label=k if k not in ax.get_legend_handles_labels()[1] else None)
        labels.append(f"{r['family']} {r['shape']}")
        y += 1
    ax.set_yticks([i + 0.4 for i in range(len(labels))], labels, fontsize=7)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speed relative to fused (forward+backward; <1 = slower than fused)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels", help="kernel microbenchmarks")
    k.add_argument("--family", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    k.add_argument("--out", default="results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.py kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows: list[dict] = []
    info = env()
    print(json.dumps(info))
    for fam in args.family:
        t0 = time.time()
        FAMILIES[fam](rows)
        print(f"[{fam}: {time.time() - t0:.0f}s]", file=sys.stderr)
        (out / "kernels.json").write_text(json.dumps({"env": info, "rows": rows}, indent=1))
    print_table(rows)
    plot(rows, out / "kernels.png", f"{info['gpu']}, torch {info['torch']}, triton "
         f"{info['triton']}, {info['dtype']}, {info['date']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
