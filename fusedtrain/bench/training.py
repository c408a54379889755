"""Training-throughput benchmarks: the model's forward, backward and AdamW step for each
variant (eager, SDPA, torch.compile, fused, fused as one CUDA graph, fused minus one
family), timed in one process; loss parity; one step's gradients against the fp32
model's; a torch.profiler summary. `python scripts/bench.py
train|parity|gradients|profile` runs them."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import fmean

import torch

from fusedtrain import ops
from fusedtrain.bench.gpu_clocks import ClockSampler
from fusedtrain.bench.host_load import HostLoad, python_speed_ns

MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "conf" / "model"  # Hydra's model group


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
    }
    # The whole step (forward, backward, AdamW) captured once as one CUDA graph and
    # replayed: the GPU work of `fused` without the host's per-launch cost. Last: in one
    # H200 run, two plain variants timed after these captures in the same process ran 2.2x
    # and 2.4x slower than in a fresh one (docs/perf-notes.md, twelfth round).
    v["fused-graph"] = dict(kernels=every, eager_attention="sdpa", compile=False, graph=True)
    v["eager-sdpa-graph"] = dict(kernels=none, eager_attention="sdpa", compile=False, graph=True)
    if ablation:
        # Graphed too: the plain fused step is bound by the host's launches, which would
        # hide what a family's kernels cost on the GPU.
        for fam in KERNEL_FAMILIES:
            v[f"fused-graph-no-{fam}"] = {**fused_but(fam), "graph": True}
    return v


def fused_but(family: str) -> dict:
    """The plain fused variant with `family` back to eager."""
    from fusedtrain.model import KERNEL_FAMILIES

    return dict(kernels={**dict.fromkeys(KERNEL_FAMILIES, True), family: False},
                eager_attention="sdpa", compile=False)


def training_batches(source: str, n: int, batch: int, seq: int, vocab: int,
                     device: str, seed: int = 0) -> torch.Tensor:
    """(n, batch, seq + 1) token windows: uniform random tokens, or windows of the
    stdlib corpus (the same for every variant), drawn from `seed`."""
    if source == "synthetic":
        gen = torch.Generator(device=device).manual_seed(seed)
        return torch.randint(0, vocab, (n, batch, seq + 1), device=device, generator=gen)
    from fusedtrain.data import DataConfig, RandomWindows, load_tokens

    tokens = load_tokens(DataConfig(source=source, max_files=200), vocab, seed=0)
    windows = RandomWindows(tokens, seq, seed=seed, length=n * batch)
    x = torch.stack([torch.cat([w[0], w[1][-1:]]) for w in (windows[i] for i in range(n * batch))])
    return x.view(n, batch, seq + 1).to(device)


def train_setup(model_name: str, batch: int, seq: int, n_batches: int, variant: dict,
                device: str, data_source: str = "synthetic", seed: int = 0):
    """(model, step, data): step(i) runs forward, backward and AdamW on data[i] under bf16
    autocast and returns the loss tensor (no host sync). torch.compile, where asked,
    wraps the whole loss function (forward, head and cross-entropy). `seed` draws the
    initial weights and the batches."""
    from omegaconf import OmegaConf

    from fusedtrain.model import GPT, GPTConfig
    from fusedtrain.optim import AdamW

    base = OmegaConf.to_container(OmegaConf.load(MODEL_CONFIGS / f"{model_name}.yaml"))
    cfg = GPTConfig(**{**base, "block_size": max(seq, base["block_size"]),
                       "kernels": variant["kernels"],
                       "eager_attention": variant["eager_attention"]})
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    mode = variant["compile"]
    if mode:
        ops.register_inductor_fallbacks()
    loss_fn = torch.compile(model.loss, mode=None if mode == "default" else mode) if mode \
        else model.loss
    graphs = mode == "reduce-overhead"
    whole_step_graph = variant.get("graph", False) and device == "cuda"
    if any(variant["kernels"].values()) and device == "cuda":
        # fusedtrain.optim's AdamW, also writing the bf16 weights that the fused ops read
        # next (compiled too; not in Inductor's CUDA graphs, which cast in the graph).
        opt = AdamW(model.parameters(), lr=1e-4,
                    copy_dtype=None if graphs else torch.bfloat16)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda",
                                capturable=whole_step_graph)
    data = training_batches(data_source, n_batches, batch, seq, cfg.vocab_size, device, seed)
    # Autocast's weight-cast cache would hold tensors made during capture; graphs need it off.
    amp = torch.autocast(device, dtype=torch.bfloat16,
                         enabled=device == "cuda" and variant.get("autocast", True),
                         cache_enabled=not whole_step_graph)

    def train_on(batch: torch.Tensor) -> torch.Tensor:
        """batch: (B, T + 1) tokens -> the loss, after backward and the optimizer step."""
        if graphs:  # CUDA-graph replays reuse their output memory: one step per replay
            torch.compiler.cudagraph_mark_step_begin()
        with amp:
            loss = loss_fn(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        # Also in the captured step: backward then makes each .grad afresh (at the same
        # address in the graph's memory pool every replay) instead of adding into zeroed
        # ones, one add kernel per parameter and a zeroing pass a step (0.7 ms at gpt2).
        opt.zero_grad(set_to_none=True)
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
                        variant: dict, device: str, data_source: str = "synthetic",
                        seed: int = 0) -> dict:
    """Warm-up steps (compilation, autotuning), then `steps` timed steps issued back to
    back as a training loop would: tokens/s from the wall time of the timed steps (one
    sync at each end), per-step ms from CUDA events read afterwards, the GPU's SM
    clock and power over those steps where nvidia-smi can tell (gpu_clocks), how busy
    the host's CPUs were meanwhile and how fast the host ran Python just before
    (host_load)."""
    from fusedtrain.module import peak_flops, python_heap_frozen

    cuda = device == "cuda"
    if cuda:  # from before setup: a graphed variant allocates its step's memory at capture
        torch.cuda.reset_peak_memory_stats()
    model, step, _ = train_setup(model_name, batch, seq, warmup + steps, variant, device,
                                 data_source, seed)
    losses, first_step_s = [], None
    for i in range(warmup):
        t_step = time.perf_counter()
        losses.append(step(i))
        if i == 0:  # compilation and autotuning happen here
            if cuda:
                torch.cuda.synchronize()
            first_step_s = time.perf_counter() - t_step
    python_ns = python_speed_ns()  # how fast this host runs Python, just before the steps
    # The heap frozen as a long training run's would be after its warm-up.
    with python_heap_frozen(), ClockSampler() as clocks, HostLoad() as host:
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
           "step_ms_p90": times_t.quantile(0.9).item(), "step_ms": times,
           "first_step_s": first_step_s, "final_loss": losses[-1], "losses": losses,
           "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
           **(clocks.summary or {}), **(host.summary or {}), "host_python_ns": python_ns}
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
    gpu_events = [e for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in gpu_events) / args.steps
    # Kernels, copies and memsets: each costs a gap on the GPU even inside a CUDA graph.
    gpu_ops = sum(e.count for e in gpu_events) / args.steps
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
             f"ms/step: the GPU is busy {gpu_us / 1e3 / wall_ms:.0%} of the step; "
             f"{gpu_ops:.0f} GPU operations (kernels, copies, memsets) a step",
             prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.top,
                                       max_name_column_width=60)]
    if args.host:
        lines += ["host (cProfile, the same steps again, top functions by own time):",
                  text.getvalue()]
    return "\n".join(lines)


class _TimeLimit:
    """Raise TimeoutError in this (main) thread after `seconds` (0: no limit), so a variant
    whose compilation runs away is recorded as failed and the others still run.
    `expired` says whether the alarm fired, whatever the interrupted code then raised:
    torch.compile may wrap the TimeoutError in an error of its own, or fail differently
    for having been stopped halfway."""

    def __init__(self, seconds: int):
        self.seconds, self.expired = seconds, False

    def _expire(self, signum, frame):
        self.expired = True
        raise TimeoutError(f"variant took longer than {self.seconds} s")

    def __enter__(self):
        if self.seconds:
            self._previous = signal.signal(signal.SIGALRM, self._expire)
            signal.alarm(self.seconds)
        return self

    def __exit__(self, *exc):
        if self.seconds:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, self._previous)
        return False


def _import_before_time_limits(compiled: bool) -> None:
    """Import what a variant's run imports lazily (Lightning, through fusedtrain.module
    and fusedtrain.data; Inductor when a variant compiles) before any variant's time limit
    is armed: an alarm that stops a first import halfway leaves a partly initialised
    module behind, and every later variant then fails on it ("partially initialized module
    'lightning.fabric'", seen once in tests/test_bench.py)."""
    import fusedtrain.data  # noqa: F401
    import fusedtrain.module  # noqa: F401

    if compiled:
        import torch._inductor.compile_fx  # noqa: F401


def run_train(args, save=lambda results: None) -> dict:
    """Every variant in turn; `save(results)` after each, so an interrupted run keeps
    what it measured."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    variants = train_variants(args.ablation, args.compile_mode)
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants}
    _import_before_time_limits(compiled=any(v["compile"] for v in variants.values()))
    results = {}
    for name, v in variants.items():
        t0 = time.time()
        limit = _TimeLimit(args.variant_timeout)
        try:
            with limit:
                results[name] = bench_train_variant(args.model, args.batch, args.seq,
                                                    args.steps, args.warmup, v, device,
                                                    args.data)
        except torch.OutOfMemoryError as e:
            results[name] = {"error": f"out of memory: {str(e)[:100]}"}
        except Exception as e:  # one failing variant must not lose the others' figures
            results[name] = {"error": f"variant took longer than {limit.seconds} s "
                                      f"(stopped in {type(e).__name__})" if limit.expired
                             else f"{type(e).__name__}: {str(e)[:300]}"}
        if limit.expired and "error" not in results[name]:
            # What the alarm interrupted swallowed its TimeoutError (torch.compile catches
            # some errors and carries on; seen once in tests/test_bench.py) and the variant
            # ran on: over its limit all the same, so not a figure to compare.
            results[name] = {"error": f"variant took longer than {limit.seconds} s "
                                      "(finished after its time limit)"}
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
    base_ms = {k: results[k]["step_ms_median"] for k in base}
    for r in results.values():
        if "tokens_per_s" in r:
            r["speedup_vs"] = {k: r["tokens_per_s"] / v for k, v in base.items()}
            # Robust to a few slow steps, which the wall-time rate is not.
            r["speedup_vs_by_median_step"] = {k: v / r["step_ms_median"]
                                              for k, v in base_ms.items()}
    return results


def train_table(results: dict) -> str:
    """The summary table of a `bench.py train` run: one row per variant, speedups by
    tokens/s (and by median step) against the eager and compiled baselines that ran."""
    bases = [k for k in ("eager-math", "eager-sdpa", "compile-sdpa")
             if "tokens_per_s" in results.get(k, {})]
    head = (f"{'variant':22s}{'tokens/s':>10s}{'step ms (p10-p90)':>26s}{'MFU':>7s}"
            f"{'peak GiB':>10s}{'MHz':>6s}{'CPUs':>10s}{'py ns':>7s}"
            f"  speedup vs {' / '.join(bases) or '-'} (by median step)")
    lines = [head]
    for name, r in results.items():
        if "tokens_per_s" not in r:
            lines.append(f"{name:22s}  {r.get('error', 'no result')}")
            continue
        ms = f"{r['step_ms_median']:.2f} ({r['step_ms_p10']:.2f}-{r['step_ms_p90']:.2f})"
        mfu, mem, mhz = r.get("mfu"), r["peak_mem_GiB"], r.get("sm_clock_mhz_median")
        # Cores busy in this process / on the whole machine; ns of the Python probe
        # (host_load).
        cpus = (f"{r['host_cpu_self']:.1f}/{r['host_cpu_all']:.1f}" if "host_cpu_all" in r
                else "-")
        py = f"{r['host_python_ns']:.0f}" if "host_python_ns" in r else "-"
        by_rate = " / ".join(f"{r['speedup_vs'][b]:.3f}" for b in bases)
        by_median = " / ".join(f"{r['speedup_vs_by_median_step'][b]:.3f}" for b in bases)
        lines.append(f"{name:22s}{r['tokens_per_s'] / 1e3:9.1f}k{ms:>26s}"
                     f"{'-' if mfu is None else f'{mfu:.3f}':>7s}"
                     f"{'-' if mem is None else f'{mem:.2f}':>10s}"
                     f"{'-' if mhz is None else f'{mhz:.0f}':>6s}{cpus:>10s}{py:>7s}"
                     f"  {by_rate} ({by_median})")
    return "\n".join(lines)


# The fp32 model first: the trajectory every bf16 run strays from, and what each is
# measured against. Eager bf16 (SDPA and math attention) is the yardstick: how far low
# precision alone takes an unfused model from it.
PARITY_DEFAULT = ("eager-fp32", "eager-sdpa", "fused", "eager-math")
# Loss differences below this count as agreement whatever the yardstick (a run without
# autocast, e.g. on the CPU, has no bf16 noise to measure).
PARITY_ATOL = 1e-3


def parity_variants() -> dict[str, dict]:
    """What `bench.py parity` can train: the plain (not graphed) variants of
    train_variants, fused minus one family (`fused-no-X`), and eager without autocast
    (`eager-fp32`), the full-precision trajectory both bf16 runs stray from."""
    from fusedtrain.model import KERNEL_FAMILIES

    v = {k: d for k, d in train_variants(ablation=False).items() if not d.get("graph")}
    v.update({f"fused-no-{fam}": fused_but(fam) for fam in KERNEL_FAMILIES})
    v["eager-fp32"] = {**v["eager-sdpa"], "autocast": False}
    return v


@contextmanager
def _tf32_off() -> Iterator[None]:
    """Full fp32 inside: the fp32 model is the reference only if none of its GEMMs or
    cuDNN kernels round their inputs to TF32 (cuDNN may by default). bf16 work is
    unaffected."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def parity_verdict(curves: dict[str, list[float]], variants: dict[str, dict]) -> dict:
    """With the fp32 model as the reference (the first curve), whether each variant with
    fused kernels stays as close to it as bf16 keeps the unfused model: max |fused - fp32|
    <= 2 max |eager bf16 - fp32| + PARITY_ATOL, DESIGN.md's rule for one op applied to a
    training run. Empty without an fp32 reference or an unfused bf16 run to measure by."""
    names = list(curves)
    ref = names[0]
    if variants[ref].get("autocast", True) or any(variants[ref]["kernels"].values()):
        return {}
    yardsticks = [n for n in names[1:] if variants[n].get("autocast", True)
                  and not any(variants[n]["kernels"].values())]
    if not yardsticks:
        return {}
    noise = max(_max_abs_diff(curves[n], curves[ref]) for n in yardsticks)
    bound = 2 * noise + PARITY_ATOL
    fused = {n: _max_abs_diff(curves[n], curves[ref]) for n in names[1:]
             if any(variants[n]["kernels"].values())}
    return {"bf16_noise": noise, "yardsticks": yardsticks, "bound": bound,
            "within_bf16_noise": {n: d <= bound for n, d in fused.items()}}


def run_parity(args) -> dict:
    """The variants `args.variants` (default PARITY_DEFAULT) trained from the same seed on
    the same batches: loss curves, each one's largest distance to the first's, the direct
    distance between fused and eager (SDPA) where both ran, and parity_verdict."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = list(args.variants or PARITY_DEFAULT)
    known = parity_variants()
    if any(n not in known for n in names) or len(set(names)) != len(names) or len(names) < 2:
        raise ValueError(f"parity needs two or more different ones of {sorted(known)}, "
                         f"got {names}")
    curves = {}
    for name in names:
        with _tf32_off():
            r = bench_train_variant(args.model, args.batch, args.seq, args.steps, 0,
                                    known[name], device, args.data, args.seed)
        curves[name] = r["losses"]
    ref = names[0]
    diffs = {n: _max_abs_diff(curves[ref], curves[n]) for n in names[1:]}
    print(f"loss parity over {args.steps} steps, max |variant - {ref}|: "
          + ", ".join(f"{n} {d:.3g}" for n, d in diffs.items())
          + "; final losses: " + ", ".join(f"{n} {c[-1]:.4f}" for n, c in curves.items()))
    out = {"reference": ref, "seed": args.seed, "curves": curves,
           "max_abs_diff_vs_reference": diffs}
    if "fused" in curves and "eager-sdpa" in curves:
        out["fused_vs_eager"] = _max_abs_diff(curves["fused"], curves["eager-sdpa"])
        print(f"max |fused - eager-sdpa|: {out['fused_vs_eager']:.3g}")
    verdict = parity_verdict(curves, {n: known[n] for n in names})
    if verdict:
        print(f"bf16 noise (max |{' or '.join(verdict['yardsticks'])} - {ref}|): "
              f"{verdict['bf16_noise']:.3g}; within 2x it + {PARITY_ATOL:g}: "
              + ", ".join(f"{n} {'yes' if ok else 'NO'}"
                          for n, ok in verdict["within_bf16_noise"].items()))
        out.update(verdict)
    return out


GRADIENTS_DEFAULT = ("eager-sdpa", "eager-math", "fused")


def _parameter_group(name: str) -> str:
    """A parameter's name with its layer index pooled: transformer.h.*.mlp.c_fc.weight."""
    return re.sub(r"\.\d+\.", ".*.", name)


def _squares_by_group(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum of squares of the named tensors, per parameter group (_parameter_group)."""
    sums: dict[str, float] = {}
    for name, t in tensors.items():
        group = _parameter_group(name)
        sums[group] = sums.get(group, 0.0) + t.pow(2).sum().item()
    return sums


def run_gradients(args) -> dict:
    """One step's gradients at a point of the parity run: the eager bf16 model trained
    `args.at` steps (parity's seed and batches), then on each of the next `args.batches`
    batches every variant's gradients against the fp32 model's, as the relative L2 error
    per parameter group (layers pooled) and over all parameters, and its loss's distance
    to fp32's. Says whether a fused model's gradients are as good as eager bf16's where
    the training run is, not only at initialisation."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The model's own loss runs here, so a compiled variant would not be compiled.
    known = {n: v for n, v in parity_variants().items() if not v["compile"]}
    names = list(args.variants or GRADIENTS_DEFAULT)
    if any(n not in known or n == "eager-fp32" for n in names) or len(set(names)) != len(names):
        raise ValueError("gradients compares different ones of "
                         f"{sorted(set(known) - {'eager-fp32'})} with eager-fp32, got {names}")
    if args.at < 0 or args.batches < 1:
        raise ValueError(f"gradients needs --at >= 0 and --batches >= 1, got {args.at} and "
                         f"{args.batches}")
    shape = (args.model, args.batch, args.seq, args.at + args.batches)
    model, step, data = train_setup(*shape, known["eager-sdpa"], device, args.data, args.seed)
    for i in range(args.at):
        step(i)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model, step

    models = {}  # one per variant, built on first use, all holding `state`

    def gradients(name: str, batch: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        if name not in models:
            models[name] = train_setup(*shape[:3], 1, known[name], device, "synthetic",
                                       args.seed)[0]
            models[name].load_state_dict(state)
        m = models[name]
        m.zero_grad(set_to_none=True)
        autocast = device == "cuda" and known[name].get("autocast", True)
        with _tf32_off():
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = m.loss(batch[:, :-1], batch[:, 1:])
            loss.backward()
        return loss.item(), {n: p.grad.double() for n, p in m.named_parameters()
                             if p.grad is not None}

    losses = {n: [] for n in ("eager-fp32", *names)}
    rel_err = {n: {} for n in names}
    rel_err_all = {n: [] for n in names}
    for b in range(args.at, args.at + args.batches):
        ref_loss, ref = gradients("eager-fp32", data[b])
        losses["eager-fp32"].append(ref_loss)
        ref_sq = _squares_by_group(ref)
        for name in names:
            loss, grads = gradients(name, data[b])
            losses[name].append(loss)
            err_sq = _squares_by_group({n: g - ref[n] for n, g in grads.items()})
            for group, e in err_sq.items():
                rel_err[name].setdefault(group, []).append((e / max(ref_sq[group], 1e-300))
                                                           ** 0.5)
            rel_err_all[name].append((sum(err_sq.values()) / sum(ref_sq.values())) ** 0.5)
    return {"reference": "eager-fp32", "at": args.at, "seed": args.seed,
            "batches": list(range(args.at, args.at + args.batches)), "loss": losses,
            "rel_err": rel_err, "rel_err_all": rel_err_all}


def gradients_table(result: dict) -> str:
    """Relative L2 error against the fp32 model's gradients, per group and variant,
    averaged over the batches."""
    names = list(result["rel_err"])
    lines = [f"gradients against eager-fp32 after {result['at']} steps, batches "
             f"{result['batches']}: relative L2 error (mean over the batches)",
             f"{'parameter group':40s}" + "".join(f"{n:>14s}" for n in names)]
    for group in result["rel_err"][names[0]]:
        lines.append(f"{group:40s}" + "".join(f"{fmean(result['rel_err'][n][group]):14.3e}"
                                              for n in names))
    lines.append(f"{'all parameters':40s}" + "".join(f"{fmean(result['rel_err_all'][n]):14.3e}"
                                                     for n in names))
    ref = result["loss"]["eager-fp32"]
    lines.append(f"{'|loss - fp32 loss|':40s}" + "".join(
        f"{fmean([abs(a - b) for a, b in zip(result['loss'][n], ref)]):14.3e}" for n in names))
    return "\n".join(lines)


def plot_parity(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The curves overlap at this scale: the lower panel shows their differences per step.
    fig, (ax, diff_ax) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    curves, ref = result["curves"], result["reference"]
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, lw=1.2)
    ax.set_ylabel("training loss")
    diffs = [f"max |{n} - {ref}| = {d:.3g}"
             for n, d in result["max_abs_diff_vs_reference"].items()]
    ax.set_title("\n".join([title] + ["; ".join(diffs[i:i + 2])
                                       for i in range(0, len(diffs), 2)]), fontsize=9)
    ax.legend()
    for i, name in enumerate(n for n in curves if n != ref):
        diff = [a - b for a, b in zip(curves[name], curves[ref])]
        diff_ax.plot(range(1, len(diff) + 1), diff, color=f"C{i + 1}", lw=1.0,
                     label=f"{name} - {ref}")
    diff_ax.axhline(0.0, color="grey", lw=0.6)
    if "bound" in result:  # what parity_verdict allows a fused run
        for y, label in ((result["bound"], "parity bound (2x bf16 noise + atol)"),
                         (-result["bound"], None)):
            diff_ax.axhline(y, color="grey", lw=0.8, ls="--", label=label)
    diff_ax.set_xlabel("step")
    diff_ax.set_ylabel("loss difference")
    diff_ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def train_chart_title(info: dict) -> str:
    """The chart's title from bench.py train's run description (its JSON's "env")."""
    if "gpu" not in info:
        return f"{info.get('model')}, B={info.get('batch')}, T={info.get('seq')}, CPU"
    return (f"{info['model']}, B={info['batch']}, T={info['seq']}, {info['dtype']}, "
            f"{info['steps']} timed steps; {info['gpu']}, torch {info['torch']}, "
            f"triton {info['triton']}, {info['date']}")


def plot_train(results: dict, path: Path, title: str, reference: str = "compile-sdpa") -> None:
    """Bars of tokens/s (each labelled with its ratio to `reference` where that ran, and
    the median SM clock where sampled) and peak memory per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, r in results.items() if "tokens_per_s" in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.4 * len(names) + 2), sharey=True)
    rates = [results[k]["tokens_per_s"] / 1e3 for k in names]
    axes[0].barh(names, rates, color="C0")
    ref = results.get(reference, {}).get("tokens_per_s")
    for i, (name, rate) in enumerate(zip(names, rates)):
        label = f"{rate:.1f}k" + (f"  {rate * 1e3 / ref:.3f}x" if ref else "")
        mhz = results[name].get("sm_clock_mhz_median")
        label += f"  @ {mhz:.0f} MHz" if mhz else ""
        axes[0].text(rate, i, " " + label, va="center", fontsize=8)
    axes[0].set_xlim(0, max(rates) * 1.5)
    axes[0].set_xlabel("tokens/s (thousands)" + (f"; x: against {reference}" if ref else ""))
    axes[1].barh(names, [results[k]["peak_mem_GiB"] or 0 for k in names], color="C1")
    axes[1].set_xlabel("peak memory (GiB)")
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
