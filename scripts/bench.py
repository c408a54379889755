"""Benchmarks, every competitor in this one process, on fresh random data.

  python scripts/bench.py kernels [--family linear_gelu qkv attention layernorm cross_entropy]
      [--out DIR]
      kernel microbenchmarks (triton.testing.do_bench medians): fused vs eager vs
      torch.compile vs the library ceiling -> DIR/kernels.json, DIR/kernels.png;
      --graph times CUDA-graph replays instead (GPU time only) -> DIR/kernels-graph.*
  python scripts/bench.py train [--model gpt2] [--batch 16] [--seq 1024] [--steps 20] [--out DIR]
      training steps (forward, backward, AdamW; bf16 autocast) for the variants eager-math,
      eager-sdpa, compile-sdpa, fused, compile-fused, fused-graph and eager-sdpa-graph
      (the whole step as one CUDA graph) and the per-family ablation:
      tokens/s, step ms, MFU, peak memory -> DIR/train.json, DIR/train.png
  python scripts/bench.py parity [--model tiny] [--steps 100] [--out DIR]
      fused and eager trained from one seed on the same stdlib batches: overlaid loss
      curves and the max |difference| -> DIR/parity.json, DIR/parity.png
  python scripts/bench.py profile [--variant fused] [--model gpt2] [--out DIR]
      torch.profiler over a few training steps: GPU-busy share of the step and the top
      kernels by GPU time -> DIR/profile-VARIANT.txt

A table goes to stdout. Needs a CUDA GPU (the train part also runs on CPU for a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fusedtrain import eager, ops

DTYPE = torch.bfloat16


GRAPH_TIMING = False  # kernels --graph: time CUDA-graph replays, without the host's cost
GELU_FORM = "tanh"  # kernels --approximate: the GELU of the Linear+GELU and MLP rows


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


# ---------------------------------------------------------------- training


def train_variants(ablation: bool, compile_mode: str = "default") -> dict[str, dict]:
    """name -> {kernels, eager_attention, compile}; compile is False or a torch.compile
    mode, the same for every compiled variant."""
    from fusedtrain.model import KERNEL_FAMILIES

    none = dict.fromkeys(KERNEL_FAMILIES, False)
    every = dict.fromkeys(KERNEL_FAMILIES, True)
    v = {
        "eager-math": dict(kernels=none, eager_attention="math", compile=False),
        "eager-sdpa": dict(kernels=none, eager_attention="sdpa", compile=False),
        "compile-sdpa": dict(kernels=none, eager_attention="sdpa", compile=compile_mode),
        "fused": dict(kernels=every, eager_attention="sdpa", compile=False),
        "compile-fused": dict(kernels=every, eager_attention="sdpa", compile=compile_mode),
        # The whole step (forward, backward, AdamW) captured once as one CUDA graph and
        # replayed: the GPU work of `fused` without the host's per-launch cost.
        "fused-graph": dict(kernels=every, eager_attention="sdpa", compile=False, graph=True),
        "eager-sdpa-graph": dict(kernels=none, eager_attention="sdpa", compile=False,
                                 graph=True),
    }
    if ablation:
        for fam in KERNEL_FAMILIES:
            v[f"fused-no-{fam}"] = dict(kernels={**every, fam: False}, eager_attention="sdpa",
                                        compile=False)
    return v


def training_batches(source: str, n: int, batch: int, seq: int, vocab: int,
                     device: str) -> torch.Tensor:
    """(n, batch, seq + 1) token windows: uniform random tokens, or windows of the
    stdlib corpus (the same for every variant)."""
    if source == "synthetic":
        gen = torch.Generator(device=device).manual_seed(0)
        return torch.randint(0, vocab, (n, batch, seq + 1), device=device, generator=gen)
    from fusedtrain.data import DataConfig, RandomWindows, load_tokens

    tokens = load_tokens(DataConfig(source=source, max_files=200), vocab, seed=0)
    windows = RandomWindows(tokens, seq, seed=0, length=n * batch)
    x = torch.stack([torch.cat([w[0], w[1][-1:]]) for w in (windows[i] for i in range(n * batch))])
    return x.view(n, batch, seq + 1).to(device)


def train_setup(model_name: str, batch: int, seq: int, n_batches: int, variant: dict,
                device: str, data_source: str = "synthetic"):
    """(model, step, data): step(i) runs forward, backward and AdamW on data[i] under bf16
    autocast and returns the loss tensor (no host sync). torch.compile, where asked,
    wraps the whole loss function (forward, head and cross-entropy)."""
    from omegaconf import OmegaConf

    from fusedtrain.model import GPT, GPTConfig

    base = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "conf" / "model"
                                                 / f"{model_name}.yaml"))
    cfg = GPTConfig(**{**base, "block_size": max(seq, base["block_size"]),
                       "kernels": variant["kernels"],
                       "eager_attention": variant["eager_attention"]})
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    mode = variant["compile"]
    if mode:
        ops.register_inductor_fallbacks()
    loss_fn = torch.compile(model.loss, mode=None if mode == "default" else mode) if mode \
        else model.loss
    graphs = mode == "reduce-overhead"
    whole_step_graph = variant.get("graph", False) and device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda",
                            capturable=whole_step_graph)
    data = training_batches(data_source, n_batches, batch, seq, cfg.vocab_size, device)
    # Autocast's weight-cast cache would hold tensors made during capture; graphs need it off.
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda",
                         cache_enabled=not whole_step_graph)

    def train_on(batch: torch.Tensor) -> torch.Tensor:
        """batch: (B, T + 1) tokens -> the loss, after backward and the optimizer step."""
        if graphs:  # CUDA-graph replays reuse their output memory: one step per replay
            torch.compiler.cudagraph_mark_step_begin()
        with amp:
            loss = loss_fn(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=not whole_step_graph)
        return loss.detach()

    if whole_step_graph:
        return model, _graphed_step(train_on, data), data
    return model, lambda i: train_on(data[i]).clone(), data


def _graphed_step(train_on, data: torch.Tensor):
    """train_on captured as one CUDA graph over a static batch buffer: three eager steps on
    a side stream first (Triton compiles and autotunes there, AdamW makes its state), then
    each call copies batch i into the buffer and replays the graph. Those three steps
    train the model on batches 0-2, which the timed loop then starts with again: the
    graphed variants' first losses sit below the others', a curve shifted by 3 steps."""
    batch = data[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            train_on(data[i])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = train_on(batch)

    def step(i: int) -> torch.Tensor:
        batch.copy_(data[i])
        graph.replay()
        return loss.clone()

    return step


def bench_train_variant(model_name: str, batch: int, seq: int, steps: int, warmup: int,
                        variant: dict, device: str, data_source: str = "synthetic") -> dict:
    """Warm-up steps (compilation, autotuning), then `steps` timed steps issued back to
    back as a training loop would: tokens/s from the wall time of the timed steps (one
    sync at each end), per-step ms from CUDA events read afterwards."""
    from fusedtrain.module import peak_flops

    cuda = device == "cuda"
    if cuda:  # from before setup: a graphed variant allocates its step's memory at capture
        torch.cuda.reset_peak_memory_stats()
    model, step, _ = train_setup(model_name, batch, seq, warmup + steps, variant, device,
                                 data_source)
    losses, first_step_s = [], None
    for i in range(warmup):
        t_step = time.perf_counter()
        losses.append(step(i))
        if i == 0:  # compilation and autotuning happen here
            if cuda:
                torch.cuda.synchronize()
            first_step_s = time.perf_counter() - t_step
    if cuda:
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
    t0 = time.perf_counter()
    marks = [t0]
    for i in range(warmup, warmup + steps):
        losses.append(step(i))
        if cuda:
            events[i - warmup + 1].record()
        else:
            marks.append(time.perf_counter())
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    times = ([a.elapsed_time(b) for a, b in zip(events, events[1:])] if cuda
             else [(b - a) * 1e3 for a, b in zip(marks, marks[1:])])
    times_t = torch.tensor(times)
    tokens_per_s = batch * seq * steps / wall
    losses = [x.item() for x in losses]
    out = {"tokens_per_s": tokens_per_s, "step_ms_median": times_t.median().item(),
           "step_ms_p10": times_t.quantile(0.1).item(),
           "step_ms_p90": times_t.quantile(0.9).item(),
           "first_step_s": first_step_s, "final_loss": losses[-1], "losses": losses,
           "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}
    known = peak_flops() if cuda else None
    if known is not None:
        out["mfu"] = model.flops_per_token(seq) * tokens_per_s / known[1]
        out["peak_flops"] = known[1]
    return out


def run_profile(args) -> str:
    """torch.profiler over a few steps of one variant after warm-up: GPU busy time against
    wall time (how CPU-bound the step is) and the top kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    device = "cuda"
    variant = train_variants(ablation=True)[args.variant]
    _, step, _ = train_setup(args.model, args.batch, args.seq, args.warmup + args.steps,
                             variant, device, "synthetic")
    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages()
                 if e.device_type == torch.autograd.DeviceType.CUDA) / args.steps
    if args.host:
        import cProfile
        import io
        import pstats

        host = cProfile.Profile()
        host.enable()
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
        torch.cuda.synchronize()
        host.disable()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(args.top)
    lines = [f"profile: {args.variant}, model={args.model}, B={args.batch}, T={args.seq}, "
             f"{args.steps} steps after {args.warmup} warm-up",
             f"wall {wall_ms:.1f} ms/step (under the profiler), GPU kernels {gpu_us / 1e3:.1f} "
             f"ms/step: the GPU is busy {gpu_us / 1e3 / wall_ms:.0%} of the step",
             prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.top,
                                       max_name_column_width=60)]
    if args.host:
        lines += ["host (cProfile, the same steps again, top functions by own time):",
                  text.getvalue()]
    return "\n".join(lines)


@contextlib.contextmanager
def _time_limit(seconds: int):
    """Raise TimeoutError in this (main) thread after `seconds` (0: no limit), so a variant
    whose compilation runs away is recorded as failed and the others still run."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"variant took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_train(args, save=lambda results: None) -> dict:
    """Every variant in turn; `save(results)` after each, so an interrupted run keeps
    what it measured."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    variants = train_variants(args.ablation, args.compile_mode)
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants}
    results = {}
    for name, v in variants.items():
        t0 = time.time()
        try:
            with _time_limit(args.variant_timeout):
                results[name] = bench_train_variant(args.model, args.batch, args.seq,
                                                    args.steps, args.warmup, v, device,
                                                    args.data)
        except torch.OutOfMemoryError as e:
            results[name] = {"error": f"out of memory: {str(e)[:100]}"}
        except Exception as e:  # one failing variant must not lose the others' figures
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        save(results)
        if device == "cuda":
            torch.cuda.empty_cache()
        r = results[name]
        print(f"{name:<20} " + ("  ".join(f"{k} {v:.4g}" for k, v in r.items()
                                          if isinstance(v, float))
                               or r.get("error", "")) + f"  [{time.time() - t0:.0f}s]",
              flush=True)
    base = {k: results[k]["tokens_per_s"] for k in ("eager-math", "eager-sdpa", "compile-sdpa")
            if "tokens_per_s" in results.get(k, {})}
    for r in results.values():
        if "tokens_per_s" in r:
            r["speedup_vs"] = {k: r["tokens_per_s"] / v for k, v in base.items()}
    return results


def run_parity(args) -> dict:
    """Fused and eager trained from the same seed on the same batches: loss curves."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    variants = train_variants(ablation=False)
    curves = {}
    for name in ("eager-sdpa", "fused"):
        r = bench_train_variant(args.model, args.batch, args.seq, args.steps, 0,
                                variants[name], device, args.data)
        curves[name] = r["losses"]
    diff = max(abs(a - b) for a, b in zip(curves["eager-sdpa"], curves["fused"]))
    print(f"loss parity over {args.steps} steps: max |fused - eager| = {diff:.3g} "
          f"(final eager {curves['eager-sdpa'][-1]:.4f}, fused {curves['fused'][-1]:.4f})")
    return {"curves": curves, "max_abs_diff": diff}


def plot_parity(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, losses in result["curves"].items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{title}\nmax |fused - eager| = {result['max_abs_diff']:.3g}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_train(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, r in results.items() if "tokens_per_s" in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.4 * len(names) + 2), sharey=True)
    axes[0].barh(names, [results[k]["tokens_per_s"] / 1e3 for k in names], color="C0")
    axes[0].set_xlabel("tokens/s (thousands)")
    axes[1].barh(names, [results[k]["peak_mem_GiB"] or 0 for k in names], color="C1")
    axes[1].set_xlabel("peak memory (GiB)")
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


FAMILIES = {"linear_gelu": bench_linear_gelu, "qkv": bench_qkv, "attention": bench_attention,
            "layernorm": bench_layernorm, "cross_entropy": bench_cross_entropy}


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
        for extra in ("saved_MiB", "fwd_bwd_tflops", "fwd_GBps", "peak_MiB"):
            if extra in r:
                vals = "  ".join(f"{k} {v:.1f}" for k, v in r[extra].items())
                print(f"{'':<11} {r['shape']:<38} {extra}: {vals}")


def plot(rows: list[dict], path: Path, title: str) -> None:
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


def _run_shape_args(parser: argparse.ArgumentParser, steps: int) -> None:
    """The model and step options that `train` and `profile` share."""
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--autograd-threads", action="store_true",
                        help="run backward on autograd's per-GPU worker thread (PyTorch's "
                             "default) instead of the calling thread, as scripts/train.py "
                             "does with autograd_threads=true")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels", help="kernel microbenchmarks")
    k.add_argument("--family", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    k.add_argument("--out", default="results")
    k.add_argument("--graph", action="store_true",
                   help="time CUDA-graph replays (GPU time without Python's launch cost); "
                        "writes kernels-graph.json/png")
    k.add_argument("--approximate", choices=["tanh", "none"], default="tanh",
                   help="GELU of the Linear+GELU and MLP rows: tanh (GPT-2's, the default) "
                        "or none (erf)")
    t = sub.add_parser("train", help="training throughput, fused vs eager vs torch.compile")
    _run_shape_args(t, steps=20)
    t.add_argument("--ablation", action="store_true", help="also fused minus one family")
    t.add_argument("--compile-mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                   help="torch.compile mode of the compiled variants (reduce-overhead: CUDA "
                        "graphs, which also remove the host's launch cost)")
    t.add_argument("--variants", nargs="+", help="run only these variants")
    t.add_argument("--variant-timeout", type=int, default=0, metavar="S",
                   help="record a variant that runs longer than S seconds (setup, "
                        "compilation and steps) as failed and go on (0: no limit)")
    t.add_argument("--data", default="synthetic", choices=["synthetic", "stdlib"])
    t.add_argument("--out", default="results")
    f = sub.add_parser("profile", help="torch.profiler summary of training steps")
    f.add_argument("--variant", default="fused")
    _run_shape_args(f, steps=5)
    f.add_argument("--top", type=int, default=25)
    f.add_argument("--host", action="store_true", help="also cProfile the host side")
    f.add_argument("--out", default="results")
    q = sub.add_parser("parity", help="fused vs eager loss curves, same seed and data")
    q.add_argument("--model", default="tiny")
    q.add_argument("--batch", type=int, default=8)
    q.add_argument("--seq", type=int, default=64)
    q.add_argument("--steps", type=int, default=100)
    q.add_argument("--data", default="stdlib", choices=["synthetic", "stdlib"])
    q.add_argument("--out", default="results")
    args = p.parse_args(argv)
    # `train` and `profile` run backward on this thread unless --autograd-threads, as
    # train.py does (autograd_threads=false): the fused ops' Python backward nodes then
    # skip a hand-over to autograd's worker thread. The other commands keep PyTorch's
    # default. (Called, not entered: the setting holds for the whole process.)
    torch.autograd.set_multithreading_enabled(getattr(args, "autograd_threads", True))
    if args.cmd == "parity":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = run_parity(args)
        (out / "parity.json").write_text(json.dumps(result, indent=1))
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, fp32"
        plot_parity(result, out / "parity.png", f"{args.model}, B={args.batch}, T={args.seq}, "
                    f"{args.data} data, {dev}")
        return 0
    if args.cmd == "profile":
        if not torch.cuda.is_available():
            print("bench.py profile needs a CUDA GPU", file=sys.stderr)
            return 2
        report = run_profile(args)
        print(report)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile-{args.variant}.txt").write_text(report + "\n")
        return 0
    if args.cmd == "train":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        info = env() if torch.cuda.is_available() else {"device": "cpu"}
        info.update(model=args.model, batch=args.batch, seq=args.seq, steps=args.steps,
                    compile_mode=args.compile_mode, autograd_threads=args.autograd_threads)
        print(json.dumps(info), flush=True)
        def save(results):
            (out / "train.json").write_text(json.dumps({"env": info, "results": results},
                                                       indent=1))

        results = run_train(args, save)
        save(results)
        plot_train(results, out / "train.png", json.dumps(info)[:150])
        return 0
    if not torch.cuda.is_available():
        print("bench.py kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    global GRAPH_TIMING, GELU_FORM
    GRAPH_TIMING, GELU_FORM = args.graph, args.approximate
    name = "kernels-graph" if args.graph else "kernels"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows: list[dict] = []
    info = env()
    info["timing"] = "CUDA-graph replay" if args.graph else "Python launches"
    info["gelu"] = args.approximate
    print(json.dumps(info))
    for fam in args.family:
        t0 = time.time()
        FAMILIES[fam](rows)
        print(f"[{fam}: {time.time() - t0:.0f}s]", file=sys.stderr)
        (out / f"{name}.json").write_text(json.dumps({"env": info, "rows": rows}, indent=1))
    print_table(rows)
    plot(rows, out / f"{name}.png", f"{info['gpu']}, torch {info['torch']}, triton "
         f"{info['triton']}, {info['dtype']}, {info['date']}, {info['timing']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
