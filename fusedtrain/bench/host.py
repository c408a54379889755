"""`bench.py host`: what each public op costs the host, beside its eager twin.

Per op and shape, in one process, bf16 on the GPU: the plain-loop time of one forward +
backward (host and GPU together, as a user's loop runs it: `torch.autograd.grad` with
autograd's default threads), which at the tiny shape, where the GPU idles, is the host's
cost; the same with the backward on the calling thread (what autograd's hand-over to its
device thread adds is the difference) and that call's forward alone (the backward is
the rest); the GPU time of the same call replayed as a CUDA
graph; which kernels one call launches (torch.profiler's CUDA kernel events, by name);
and how many of its backward nodes ran an op's Python backward (0 once every replayed
backward is recorded). Three variants: "fused" (the op as a user calls it: replayed from
a C++ node once its call signature is recorded, ops/_replay.py), "python" (the same op on
its Python autograd.Function, replay off) and "eager". The loops of an op run in alternating
blocks, so that a change in the host's speed (the lent hosts' Python speed moves by up
to 2x between phases) falls on all. The row `function_floor` is an autograd.Function
that launches nothing, beside F.layer_norm: the host cost under which no op written as a
Python Function can go. Rows go to JSON, and a chart shows the host-bound times of the
three variants.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from fusedtrain import eager, ops
from fusedtrain.bench.kernels import fwd_bwd, randn
from fusedtrain.ops import _replay

SHAPES = {"tiny": (1, 64), "gpt2": (16, 1024)}  # (B, T); C = 768, 12 heads, vocab 50304
WIDTH, HEADS, VOCAB = 768, 12, 50304


def op_cases(B: int, T: int) -> dict[str, tuple[Callable, Callable, list]]:
    """name -> (fused op, eager twin, inputs) for every public op at (B, T, 768)."""
    C, H, V = WIDTH, HEADS, VOCAB
    D, F = C // H, 8 * C // 3  # F: llama-124m's SwiGLU width, 2048 at 768
    x, r, w, b = randn(B, T, C), randn(B, T, C), randn(C), randn(C)
    fc_w, fc_b = randn(4 * C, C, scale=C ** -0.5), randn(4 * C)
    proj_w, proj_b = randn(C, 4 * C, scale=(4 * C) ** -0.5), randn(C)
    qkv_w, qkv_b = randn(3 * C, C, scale=C ** -0.5), randn(3 * C)
    q, k, v = (randn(B, H, T, D) for _ in range(3))
    head_w = randn(V, C, scale=C ** -0.5)
    logits = randn(B * T, V)
    idx = torch.randint(0, V, (B, T), device="cuda")
    targets = idx.view(-1)
    wpe = randn(T, C)
    return {
        "linear": (ops.linear, eager.linear, [x, randn(C, C, scale=C ** -0.5), proj_b]),
        "linear_gelu": (ops.linear_gelu, eager.linear_gelu, [x, fc_w, fc_b]),
        "fused_mlp": (ops.fused_mlp, eager.fused_mlp, [x, fc_w, fc_b, proj_w, proj_b]),
        "qkv_projection": (lambda *a: ops.qkv_projection(*a, H),
                           lambda *a: eager.qkv_projection(*a, H), [x, qkv_w, qkv_b]),
        "qkv_projection_llama": (  # llama-124m's: 4 key/value heads, rotated q and k
            lambda *a: ops.qkv_projection(*a, None, H, 4, 10000.0),
            lambda *a: eager.qkv_projection_packed(*a, None, H, 4, 10000.0),
            [x, randn(C + 8 * D, C, scale=C ** -0.5)]),
        "flash_attention": (ops.flash_attention, eager.flash_attention, [q, k, v]),
        "qkv_attention": (lambda *a: ops.qkv_attention(*a, H),
                          lambda *a: eager.qkv_attention(*a, H), [x, qkv_w, qkv_b]),
        "layer_norm": (ops.layer_norm, eager.layer_norm, [x, w, b]),
        "layer_norm_stream": (ops.layer_norm_stream, eager.layer_norm_stream, [x, w, b]),
        "add_layer_norm": (ops.add_layer_norm, eager.add_layer_norm, [x, r, w, b]),
        "layer_norm_gelu": (ops.layer_norm_gelu, eager.layer_norm_gelu, [x, w, b]),
        "rms_norm": (ops.rms_norm, eager.rms_norm, [x, w]),
        "add_rms_norm": (ops.add_rms_norm, eager.add_rms_norm, [x, r, w]),
        "swiglu_mlp": (ops.swiglu_mlp, eager.swiglu_mlp,
                       [x, *(randn(F, C, scale=C ** -0.5) for _ in range(2)),
                        randn(C, F, scale=F ** -0.5)]),
        "rotary": (lambda t: ops.rotary(t, 10000.0), lambda t: eager.rotary(t, 10000.0), [q]),
        "cross_entropy": (ops.cross_entropy, eager.cross_entropy, [logits, targets]),
        "linear_cross_entropy": (ops.linear_cross_entropy, eager.linear_cross_entropy,
                                 [x.view(B * T, C), head_w, targets]),
        "embedding": (ops.embedding, eager.embedding, [idx, head_w]),
        "gpt_embedding": (ops.gpt_embedding, eager.gpt_embedding, [idx, head_w, wpe]),
        "function_floor": (_FloorFunction.apply, eager.layer_norm, [x, w, b]),
    }


class _FloorFunction(torch.autograd.Function):
    """LayerNorm's interface with no work: saves x and weight, returns an uninitialised
    x-shaped output and three uninitialised gradients. Timed beside F.layer_norm."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _output_grads(fn: Callable, inputs: list) -> list[torch.Tensor]:
    """Random gradients for fn's floating outputs, made once (not inside the timed call)."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    return [torch.randn_like(o) for o in outs]


def _fresh(inputs: list) -> list:
    """The inputs as new leaves (same values), integer tensors as they are."""
    return [t.detach().clone().requires_grad_(t.requires_grad) if t.is_floating_point() else t
            for t in inputs]


def plain_loop_us(run: Callable[[], None], calls: int) -> float:
    """Microseconds a call of `run`, issued back to back from Python, one sync at each end."""
    for _ in range(10):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def graph_us(run: Callable[[], None]) -> float:
    """GPU microseconds of `run` replayed as a CUDA graph (median)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3


def kernels_of_a_call(run: Callable[[], None]) -> list[str]:
    """The CUDA kernels one call of `run` launches, by name, in launch order (memsets and
    copies left out): what a count above the eager twin's is made of."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [e.name[:80] for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memset", "Memcpy"))]


def python_backwards_of_a_call(run: Callable[[], None]) -> int:
    """How many backward nodes of one call of `run` went to an op's Python backward instead
    of its recorded program (ops/_replay.py): 0 where every replayed op's backward replays."""
    run()
    before = sum(_replay.python_backwards.values())
    run()
    return sum(_replay.python_backwards.values()) - before


def _interleaved_us(runs: dict[str, Callable[[], None]], calls: int,
                    blocks: int = 6) -> dict[str, float]:
    """Per named run, the median over `blocks` plain-loop blocks of calls // blocks calls,
    the runs' blocks alternating (in turned order every other block)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for block in range(blocks):
        for name in order if block % 2 == 0 else order[::-1]:
            times[name].append(plain_loop_us(runs[name], max(1, calls // blocks)))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def _python_function(fn: Callable) -> Callable:
    """fn with every op on its Python autograd.Function (no C++ replay)."""

    def call(*args):
        with _replay.disabled():
            return fn(*args)

    return call


def _forward_only(fn: Callable, inputs: list) -> Callable[[], None]:
    """fn(*inputs) with its autograd graph built and dropped: a call's forward half."""

    def fwd():
        fn(*inputs)

    return fwd


def _single_threaded(run: Callable[[], None]) -> Callable[[], None]:
    """run with autograd's backward on the calling thread."""

    def st():
        with torch.autograd.set_multithreading_enabled(False):
            run()

    return st


def run_host(shapes: list[str], op_names: list[str] | None, calls: int,
             save: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """One row per (op, shape, variant): plain_us, plain_st_us, forward_us, gpu_us, kernels,
    python_backwards; `save(rows)`
    after each figure, so an interrupted run keeps what it measured. Every plain loop runs
    before any graph is captured: plain loops timed after captures in the same process ran
    up to 2.4x slower on an H200 (docs/journal.md)."""
    rows, runs = [], []
    for shape in shapes:
        B, T = SHAPES[shape]
        cases = op_cases(B, T)
        for name in op_names or list(cases):
            fused, twin, inputs = cases[name]
            n = calls if shape == "tiny" else max(12, calls // 10)
            # Leaves of its own for each measurement: autograd keeps a leaf's gradient
            # node, with the stream it was made on, which a graph capture cannot use.
            loops = {}
            variants = (("fused", fused), ("python", _python_function(fused)), ("eager", twin))
            for variant, fn in variants:
                leaves = _fresh(inputs)
                run = fwd_bwd(fn, leaves, _output_grads(fn, inputs))
                loops[variant] = run
                loops[variant + "/st"] = _single_threaded(run)
                loops[variant + "/fwd"] = _forward_only(fn, leaves)
            timed = _interleaved_us(loops, 2 * n)
            for variant, fn in variants:
                grads = _output_grads(fn, inputs)
                row = {"op": name, "shape": shape, "B": B, "T": T, "C": WIDTH,
                       "variant": variant, "plain_us": timed[variant],
                       "plain_st_us": timed[variant + "/st"],
                       "forward_us": timed[variant + "/fwd"],
                       "kernel_names": kernels_of_a_call(fwd_bwd(fn, _fresh(inputs), grads))}
                row["kernels"] = len(row["kernel_names"])
                row["python_backwards"] = python_backwards_of_a_call(
                    fwd_bwd(fn, _fresh(inputs), grads))
                rows.append(row)
                save(rows)
                runs.append(fwd_bwd(fn, _fresh(inputs), grads))
                print(f"{name:22s} {shape:5s} {variant:6s} plain {row['plain_us']:8.1f} us  "
                      f"one thread {row['plain_st_us']:8.1f} us  forward "
                      f"{row['forward_us']:8.1f} us  kernels {row['kernels']}  Python "
                      f"backwards {row['python_backwards']}", flush=True)
    for row, run in zip(rows, runs):
        row["gpu_us"] = graph_us(run)
        save(rows)
        print(f"{row['op']:22s} {row['shape']:5s} {row['variant']:6s} GPU "
              f"{row['gpu_us']:8.1f} us", flush=True)
    return rows


def _halves(row: dict) -> tuple[float, float]:
    """(forward, backward) us of a row's one-thread call: the forward timed alone, the
    backward the rest; NaN for rows measured before the forward was."""
    fwd = row.get("forward_us", float("nan"))
    return fwd, row["plain_st_us"] - fwd


def host_table(rows: list[dict]) -> str:
    """Per op and shape: plain-loop and GPU us, fused and eager, and fused / eager (also
    with the backward on the calling thread: `1-thread`, and that call's forward and
    backward halves: `fwd`, `bwd`); `py bwd`: the fused call's backward nodes that ran
    Python."""
    by = {(r["op"], r["shape"], r["variant"]): r for r in rows}
    lines = [f"{'op':22s} {'shape':5s} {'fused us':>9s} {'eager us':>9s} {'ratio':>6s} "
             f"{'python':>7s} {'1-thread':>9s} {'fwd':>6s} {'bwd':>6s} {'fused GPU':>9s} "
             f"{'eager GPU':>9s} {'kernels f/e':>11s} {'py bwd':>6s}"]
    for op, shape in dict.fromkeys((r["op"], r["shape"]) for r in rows):
        f, e = by[(op, shape, "fused")], by[(op, shape, "eager")]
        p = by.get((op, shape, "python"))
        (f_fwd, f_bwd), (e_fwd, e_bwd) = _halves(f), _halves(e)
        lines.append(f"{op:22s} {shape:5s} {f['plain_us']:9.1f} {e['plain_us']:9.1f} "
                     f"{f['plain_us'] / e['plain_us']:6.2f} "
                     f"{p['plain_us'] / e['plain_us'] if p else float('nan'):7.2f} "
                     f"{f['plain_st_us'] / e['plain_st_us']:9.2f} {f_fwd / e_fwd:6.2f} "
                     f"{f_bwd / e_bwd:6.2f} {f['gpu_us']:9.1f} "
                     f"{e['gpu_us']:9.1f} {f['kernels']:>5d}/{e['kernels']:<5d} "
                     f"{f.get('python_backwards', '-'):>6}")
    return "\n".join(lines)


def plot_host(rows: list[dict], path: Path, title: str) -> None:
    """Per op, the plain-loop time of one forward+backward at each shape, fused beside eager
    (horizontal bars, shorter is faster), with each variant's GPU time as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    ops_ = list(dict.fromkeys(r["op"] for r in rows))
    by = {(r["op"], r["shape"], r["variant"]): r for r in rows}
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 0.45 * len(ops_) + 1.5),
                             squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for j, (variant, color, label) in enumerate((
                ("fused", "tab:orange", "fused (C++ replay)"),
                ("python", "tab:gray", "fused (Python Function)"),
                ("eager", "tab:blue", "eager"))):
            ys = [i + 0.27 - 0.27 * j for i in range(len(ops_))]
            got = [by.get((op, shape, variant)) for op in ops_]
            ax.barh(ys, [g["plain_us"] if g else 0 for g in got], height=0.26, color=color,
                    label=f"{label}, plain loop")
            ax.scatter([g["gpu_us"] if g else 0 for g in got], ys, marker="|", s=120,
                       color="black", label="GPU time (graph)" if j == 0 else None)
        ax.set_yticks(range(len(ops_)), ops_)
        ax.invert_yaxis()
        ax.set_xlabel("us per forward+backward")
        ax.set_title(f"{shape} (B, T) = {SHAPES[shape]}")
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cprofile_op(name: str, calls: int, top: int = 30) -> str:
    """cProfile's top functions by own time over `calls` fused forward+backward calls of
    op `name` at the tiny shape, after a warm-up; backward on the calling thread (autograd's
    worker thread would hide it from cProfile)."""
    import cProfile
    import io
    import pstats

    fused, _, inputs = op_cases(*SHAPES["tiny"])[name]
    run = fwd_bwd(fused, inputs, _output_grads(fused, inputs))
    plain_loop_us(run, 10)
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return f"{name}: {calls} fused forward+backward calls\n" + text.getvalue()
