"""Kernel microbenchmarks: each fused op against its eager twin, torch.compile of the
twin and the library ceiling (cuBLAS, SDPA's FlashAttention-2 and cuDNN, a device copy),
every competitor in one process on fresh random bf16 data. `python scripts/bench.py
kernels` runs them."""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fusedtrain import eager, ops

DTYPE = torch.bfloat16
GRAPH_TIMING = False  # time CUDA-graph replays (GPU time only), set by configure()
GELU_FORM = "tanh"  # the GELU of the Linear+GELU and MLP rows, set by configure()


def configure(graph: bool, approximate: str) -> None:
    """Time CUDA-graph replays instead of Python launches (graph); the GELU form of the
    Linear+GELU and MLP rows (approximate: "tanh" or "none")."""
    global GRAPH_TIMING, GELU_FORM
    GRAPH_TIMING, GELU_FORM = graph, approximate


def bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of fn(): launched from Python as a user's code would, or (with
    GRAPH_TIMING) captured once in a CUDA graph and replayed, which leaves the GPU time."""
    import triton.testing

    if GRAPH_TIMING:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
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
        lg = lambda f: (lambda x, w, b: f(x, w, b, GELU_FORM))  # noqa: E731
        mlp = lambda f: (lambda *a: f(*a, GELU_FORM))  # noqa: E731
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
        # As in the model: dq, dk, dv arrive as slices of one (B, T, 3, H, D) buffer, the
        # layout the fused attention's backward writes them in.
        from_attention = randn(B, T, 3, H, C // H, grad=False).permute(2, 0, 3, 1, 4).unbind(0)
        r["fwd_bwd_attn"] = {k: bench(fwd_bwd(lambda *a, f=f: f(*a, H), (x, w, b),
                                              from_attention)) for k, f in peers.items()}
        rows.append(r)


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _time_attention(row: dict, peers: dict, flops: float, name_kernels: bool = False) -> dict:
    """Fills row's forward and forward+backward milliseconds and TFLOP/s (forward+backward
    counted as 3.5 forwards) for each peer name -> (fn, inputs); with name_kernels, the
    kernels each peer but fused ran (ran_kernels). A peer that fails is left out, its error
    printed."""
    row.update(fwd={}, fwd_bwd={})
    for name, (f, args) in peers.items():
        try:
            with torch.no_grad():
                row["fwd"][name] = bench(lambda f=f, a=args: f(*a))
            row["fwd_bwd"][name] = bench(fwd_bwd(f, args))
            if name_kernels and name != "fused":
                with torch.no_grad():
                    row.setdefault("peer_kernels", {})[name] = ran_kernels(
                        lambda f=f, a=args: f(*a))
        except (RuntimeError, torch.OutOfMemoryError) as e:
            print(f"  {name} at {row['shape']}: {type(e).__name__}: {str(e)[:80]}",
                  file=sys.stderr)
        torch.cuda.empty_cache()
    row["fwd_tflops"] = {k: flops / ms / 1e9 for k, ms in row["fwd"].items()}
    row["fwd_bwd_tflops"] = {k: 3.5 * flops / ms / 1e9 for k, ms in row["fwd_bwd"].items()}
    return row


def bench_attention(rows: list[dict]) -> None:
    from torch.nn.attention import SDPBackend

    peers = {"fused": ops.flash_attention, "eager": eager.flash_attention,
             "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
             "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION)}
    for B, H, T, D in [(16, 12, 1024, 64), (4, 16, 4096, 128), (2, 16, 8192, 128)]:
        for causal in (True, False):
            q, k, v = randn(B, H, T, D), randn(B, H, T, D), randn(B, H, T, D)
            flops = 4 * B * H * T * T * D / (2 if causal else 1)
            shape = f"B={B} H={H} T={T} D={D} {'causal' if causal else 'full'}"
            rows.append(_time_attention(
                {"family": "attention", "shape": shape},
                {name: (lambda *a, f=f: f(*a, causal), (q, k, v)) for name, f in peers.items()},
                flops))


def ran_kernels(fn) -> list[str]:
    """The CUDA kernels fn() launches, by GPU time, longest first (the peers' own choice
    of backend, named as the profiler sees it)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.device_time_total)
    return [e.key[:120] for e in events[:3]]


def _flex(mask_mod, T: int, score_mod=None):
    """Compiled FlexAttention over T tokens with the block mask of mask_mod(b, h, q_idx,
    kv_idx) and an optional score_mod(score, b, h, q_idx, kv_idx)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(mask_mod, None, None, T, T, device="cuda")
    flex = torch.compile(flex_attention)

    def run(q, k, v):
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                    enable_gqa=k.shape[1] != q.shape[1])

    return run


def bench_attention_features(rows: list[dict]) -> None:
    """Grouped-query heads, a sliding window, a softcap and D = 256, against SDPA's default
    backend (grouped heads through enable_gqa) or FlexAttention where SDPA has no such
    mask; the kernel each peer ran is recorded beside its time."""
    window, cap = 1024, 50.0

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def softcapped(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])

    cases = [  # (name, B, Hq, Hkv, T, D, fused kwargs, peers)
        ("gqa", 4, 32, 8, 4096, 128, {}, {"sdpa_default": sdpa,
                                          "flex": _flex(causal_mod, 4096)}),
        ("window", 2, 16, 16, 8192, 128, {"window": (window, 0)},
         {"flex": _flex(sliding, 8192)}),
        ("softcap", 4, 16, 16, 4096, 128, {"softcap": cap},
         {"flex": _flex(causal_mod, 4096, softcapped)}),
        ("head_dim_256", 4, 16, 16, 4096, 256, {}, {"sdpa_default": sdpa}),
    ]
    for name, B, Hq, Hkv, T, D, kwargs, peers in cases:
        q, k, v = randn(B, Hq, T, D), randn(B, Hkv, T, D), randn(B, Hkv, T, D)
        seen = eager.attention_mask(T, T, True, kwargs.get("window"), q.device)
        flops = 4 * B * Hq * int(seen.sum()) * D
        fns = {"fused": lambda q, k, v, kw=kwargs: ops.flash_attention(q, k, v, True, **kw),
               **peers}
        shape = f"{name} B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} causal"
        rows.append(_time_attention({"family": "attention_features", "shape": shape},
                                    {p: (f, (q, k, v)) for p, f in fns.items()}, flops,
                                    name_kernels=True))


def document_lengths(n_docs: int = 16, total: int = 32768, shortest: int = 128,
                     longest: int = 4096, seed: int = 0) -> list[int]:
    """n_docs lengths in [shortest, longest] summing to total, drawn at random (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        w = torch.rand(n_docs, generator=gen)
        lengths = (shortest + w / w.sum() * (total - n_docs * shortest)).long().tolist()
        lengths[-1] += total - sum(lengths)
        if max(lengths) <= longest and min(lengths) >= shortest:
            return lengths


def bench_attention_varlen(rows: list[dict]) -> None:
    """Packed documents (document_lengths: 16 of 128..4096 tokens, 32768 in all), causal,
    16 heads of 128: the fused packed op against FlexAttention with a document mask and
    SDPA's default backend on the same documents padded into a dense batch."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lengths, H, D = document_lengths(), 16, 128
    N, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda",
                      dtype=torch.int32)
    q, k, v = randn(N, H, D), randn(N, H, D), randn(N, H, D)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                  torch.tensor(lengths, device="cuda"))

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(same_doc_causal, None, None, N, N, device="cuda")
    flex = torch.compile(flex_attention)
    padded = [randn(len(lengths), H, longest, D) for _ in range(3)]
    fns = {"fused": (lambda q, k, v: ops.flash_attention_varlen(q, k, v, cu, cu, longest,
                                                                longest, True), (q, k, v)),
           "flex": (lambda q, k, v: flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], block_mask=block_mask),
                    (q, k, v)),
           "sdpa_default_padded": (lambda q, k, v: F.scaled_dot_product_attention(
               q, k, v, is_causal=True), padded)}
    flops = 4 * H * D * sum(n * (n + 1) // 2 for n in lengths)
    shape = f"varlen docs={len(lengths)} N={N} longest={longest} H={H} D={D} causal"
    rows.append(_time_attention({"family": "attention_features", "shape": shape}, fns, flops,
                                name_kernels=True))


def copy_bandwidth(n_bytes: int = 2 ** 30) -> float:
    """Device-to-device copy GB/s, counting bytes read plus bytes written: the faster of a
    memcpy and an elementwise copy kernel, each into a buffer allocated beforehand."""
    src = torch.randn(n_bytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = min(bench(lambda: dst.copy_(src)), bench(lambda: torch.mul(src, 1, out=dst)))
    return 2 * n_bytes / ms / 1e6


def bench_layernorm(rows: list[dict]) -> None:
    copy_gbs = copy_bandwidth()
    for M, C in [(16384, 768), (16384, 2048), (16384, 4096), (65536, 1024)]:
        x, r_, w, b = randn(M, C), randn(M, C), randn(C, scale=0.1), randn(C, scale=0.1)
        w, b = (w.detach() + 1).requires_grad_(), b
        cases = {
            "layer_norm": ((x, w, b), 2, "layer_norm"),
            "add_layer_norm": ((x, r_, w, b), 4, "add_layer_norm"),
            "layer_norm_gelu": ((x, w, b), 2, "layer_norm_gelu"),
            "rms_norm": ((x, w), 2, "rms_norm"),
            "add_rms_norm": ((x, r_, w), 4, "add_rms_norm"),
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


def bench_cross_entropy(rows: list[dict]) -> None:
    """The loss over GPT-2's vocabulary: fused against F.cross_entropy on fp32-upcast
    logits (the model's eager loss) and its torch.compile."""
    for M, V in [(16384, 50304), (8192, 128256)]:
        logits = randn(M, V, scale=3.0)
        t = torch.randint(0, V, (M,), device="cuda")
        fns = {"fused": ops.cross_entropy, "eager": eager.cross_entropy,
               "compile": compiled(eager.cross_entropy)}
        row = {"family": "cross_entropy", "shape": f"M={M} V={V}"}
        with torch.no_grad():
            row["fwd"] = {k: bench(lambda f=f: f(logits, t)) for k, f in fns.items()}
        row["fwd_bwd"] = {k: bench(fwd_bwd(f, (logits, t))) for k, f in fns.items()}
        for k, f in fns.items():
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fwd_bwd(f, (logits, t))()
            row.setdefault("peak_MiB", {})[k] = (torch.cuda.max_memory_allocated() - base) / 2**20
        rows.append(row)


def bench_swiglu(rows: list[dict]) -> None:
    """swiglu_mlp at #52's shapes: fused against the eager twin and its torch.compile, with
    the activations each saves for backward."""
    for M, C, H in [(16384, 768, 2048), (16384, 4096, 11008)]:
        args = (randn(M, C), randn(H, C, scale=C ** -0.5), randn(H, C, scale=C ** -0.5),
                randn(C, H, scale=H ** -0.5))
        fns = {"fused": ops.swiglu_mlp, "eager": eager.swiglu_mlp,
               "compile": compiled(eager.swiglu_mlp)}
        row = {"family": "swiglu", "shape": f"M={M} C={C} H={H}"}
        with torch.no_grad():
            row["fwd"] = {k: bench(lambda f=f: f(*args)) for k, f in fns.items()}
        row["fwd_bwd"] = {k: bench(fwd_bwd(f, args)) for k, f in fns.items()}
        row["saved_MiB"] = {k: saved_mib(f, args) for k, f in fns.items() if k != "compile"}
        rows.append(row)


def _rotated_after(x: torch.Tensor, w: torch.Tensor, H: int, HK: int) -> tuple[torch.Tensor, ...]:
    """The projection, then ops.rotary's own kernel on q and k: two passes."""
    q, k, v = ops.qkv_projection(x, w, None, H, HK)
    return ops.rotary(q, 10000.0), ops.rotary(k, 10000.0), v


def bench_rope(rows: list[dict]) -> None:
    """The QKV projection with q and k rotated in its epilogue against the same projection
    without them (fused, the target: <= 1.05x its time; on an sm_90 GPU both run the
    Gluon kernel up to C = 1024, the TMA kernel past it), the rotary kernel as a second
    pass, and the eager form with rotary."""
    for B, T, C, H, HK in [(16, 1024, 768, 12, 12), (16, 1024, 768, 12, 4),
                           (4, 4096, 4096, 32, 8)]:
        x = randn(B, T, C)
        rows_w = C + 2 * HK * (C // H)
        w = randn(rows_w, C, scale=C ** -0.5)
        fns = {"fused": lambda x, w: ops.qkv_projection(x, w, None, H, HK, 10000.0),
               "fused_no_rope": lambda x, w: ops.qkv_projection(x, w, None, H, HK),
               "fused_two_pass": lambda x, w: _rotated_after(x, w, H, HK),
               "eager": lambda x, w: eager.qkv_projection_packed(x, w, None, H, HK, 10000.0)}
        row = {"family": "rope", "shape": f"B={B} T={T} C={C} H={H} HK={HK}"}
        with torch.no_grad():
            row["fwd"] = {k: bench(lambda f=f: f(x, w)) for k, f in fns.items()}
        row["fwd_bwd"] = {k: bench(fwd_bwd(f, (x, w))) for k, f in fns.items()}
        rows.append(row)


FAMILIES = {"linear_gelu": bench_linear_gelu, "qkv": bench_qkv, "attention": bench_attention,
            "attention_features": bench_attention_features,
            "attention_varlen": bench_attention_varlen, "layernorm": bench_layernorm,
            "cross_entropy": bench_cross_entropy, "swiglu": bench_swiglu, "rope": bench_rope}



# ---------------------------------------------------------------- report


def print_table(rows: list[dict]) -> None:
    for r in rows:
        for key in ("fwd", "fwd_bwd", "fwd_bwd_attn"):
            if key not in r:
                continue
            t = r[key]
            base = t.get("fused")
            cells = "  ".join(
                f"{k} {v:.3f}ms" + (f" ({v / base:.2f}x)" if base and k != "fused" else "")
                for k, v in t.items())
            print(f"{r['family']:<11} {r['shape']:<38} {key:<12} {cells}")
        for extra in ("saved_MiB", "fwd_bwd_tflops", "fwd_GBps", "peak_MiB", "peer_kernels"):
            if extra in r:
                vals = "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in r[extra].items())
                print(f"{'':<11} {r['shape']:<38} {extra}: {vals}")


def plot_kernels(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [r for r in rows if "fwd_bwd" in r]
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(panels) + 2))
    labels = []
    colors = {}
    for y, r in enumerate(panels):
        t = r["fwd_bwd"]
        base = t["fused"]
        for i, (k, v) in enumerate(t.items()):
            c = colors.setdefault(k, f"C{len(colors)}")
            ax.barh(y + i * 0.8 / len(t), base / v, height=0.8 / len(t), color=c,
                    label=k if k not in ax.get_legend_handles_labels()[1] else None)
        labels.append(f"{r['family']} {r['shape']}")
    ax.set_yticks([i + 0.4 for i in range(len(labels))], labels, fontsize=7)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speed relative to fused (forward+backward; <1 = slower than fused)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
