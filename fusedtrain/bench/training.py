"""Training-throughput benchmark: the model's forward, backward and AdamW step for each
variant (eager, SDPA, torch.compile, fused, fused as one CUDA graph, fused minus one
family), timed in one process, its summary table and chart. `python scripts/bench.py
train` runs it; parity.py and profile.py build their runs on train_setup."""

from __future__ import annotations

import contextlib
import math
import re
import signal
import time
from pathlib import Path

import torch

from fusedtrain import ops
from fusedtrain.bench.gpu_clocks import ClockSampler
from fusedtrain.bench.host_load import HostLoad, python_speed_ns
from fusedtrain.training.heap import python_heap_frozen
from fusedtrain.training.mfu import peak_flops

MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "conf" / "model"  # Hydra's model group


def train_variants(ablation: bool, compile_mode: str = "default",
                   documents: bool = False) -> dict[str, dict]:
    """name -> {kernels, eager_attention, compile, ...}; compile is False or a torch.compile
    mode, the same for every compiled variant. documents: the data has them (stdlib), and
    the packed variants are included."""
    from fusedtrain.model import KERNEL_FAMILIES

    none = dict.fromkeys(KERNEL_FAMILIES, False)
    every = dict.fromkeys(KERNEL_FAMILIES, True)
    v = {
        "eager-math": dict(kernels=none, eager_attention="math", compile=False),
        "eager-sdpa": dict(kernels=none, eager_attention="sdpa", compile=False),
        "compile-sdpa": dict(kernels=none, eager_attention="sdpa", compile=compile_mode),
        "fused": dict(kernels=every, eager_attention="sdpa", compile=False),
        "compile-fused": dict(kernels=every, eager_attention="sdpa", compile=compile_mode),
        # the traceable launchers traced into their Triton launches (ops.trace_kernels)
        "compile-fused-traced": dict(kernels=every, eager_attention="sdpa",
                                     compile=compile_mode, trace_kernels=True),
        # The fused model as a user's own loop runs it: backward on autograd's default
        # (worker) thread, no heap freezing, torch's AdamW(fused=True) or fusedtrain's.
        "fused-user-loop": dict(kernels=every, eager_attention="sdpa", compile=False,
                                user_loop=True, optimizer="torch"),
        "fused-user-loop-ours": dict(kernels=every, eager_attention="sdpa", compile=False,
                                     user_loop=True),
        # the same with every op on its Python autograd.Function (no C++ replay)
        "fused-user-loop-python": dict(kernels=every, eager_attention="sdpa", compile=False,
                                       user_loop=True, optimizer="torch", replay=False),
    }
    # The whole step (forward, backward, AdamW) captured once as one CUDA graph and
    # replayed: the GPU work of `fused` without the host's per-launch cost. Last: in one
    # H200 run, two plain variants timed after these captures in the same process ran 2.2x
    # and 2.4x slower than in a fresh one (docs/journal.md).
    if documents:  # data.pack=true on the same windows: its ratio to `fused` is its cost
        v["fused-packed"] = dict(kernels=every, eager_attention="sdpa", compile=False,
                                 pack=True)
        v["eager-sdpa-packed"] = dict(kernels=none, eager_attention="sdpa", compile=False,
                                      pack=True)
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
    from fusedtrain.training.graph_capture import capture_step
    from fusedtrain.training.optimizer import adamw_plan, build_optimizer

    base = OmegaConf.to_container(OmegaConf.load(MODEL_CONFIGS / f"{model_name}.yaml"))
    cfg = GPTConfig(**{**base, "block_size": max(seq, base["block_size"]),
                       "kernels": variant["kernels"],
                       "eager_attention": variant["eager_attention"]})
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    mode = variant["compile"]
    if mode:
        # Dynamo's cache keys on GPT.loss's code and guards that a new model of the same
        # shapes passes: without the reset a variant reuses the previous one's compilation
        # (seen on the H100: the traced variant's first step took 0.08 s, no compile).
        torch._dynamo.reset()
        ops.register_inductor_fallbacks()
        ops.trace_kernels(variant.get("trace_kernels", False))
    loss_fn = torch.compile(model.loss, mode=None if mode == "default" else mode) if mode \
        else model.loss
    graphs = mode == "reduce-overhead"
    whole_step_graph = variant.get("graph", False) and device == "cuda"
    autocast = device == "cuda" and variant.get("autocast", True)
    capture = "inductor" if graphs else "step" if whole_step_graph else "none"
    plan = adamw_plan(fused_ops=any(variant["kernels"].values()), on_cuda=device == "cuda",
                      precision="bf16-mixed" if autocast else "32-true", capture=capture,
                      optimizer=variant.get("optimizer", "auto"))
    opt = build_optimizer(model.parameters(), plan, lr=1e-4)
    data = training_batches(data_source, n_batches, batch, seq, cfg.vocab_size, device, seed)
    packed = variant.get("pack", False)
    if packed and (data_source == "synthetic" or whole_step_graph):
        raise ValueError("a packed variant needs documents (--data stdlib) and no CUDA graph")
    docs = [_documents(b) for b in data] if packed else None
    # Autocast's weight-cast cache would hold tensors made during capture; graphs need it off.
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=autocast,
                         cache_enabled=not whole_step_graph)

    def train_on(batch: torch.Tensor, *documents: torch.Tensor) -> torch.Tensor:
        """batch: (B, T + 1) tokens, documents: () or packed rows' (targets, cu_seqlens)
        -> the loss, after backward and the optimizer step."""
        if graphs:  # CUDA-graph replays reuse their output memory: one step per replay
            torch.compiler.cudagraph_mark_step_begin()
        targets, *cu_seqlens = documents or (batch[:, 1:],)
        with amp:
            loss = loss_fn(batch[:, :-1], targets, *cu_seqlens)
        loss.backward()
        opt.step()
        # Also in the captured step: backward then makes each .grad afresh (at the same
        # address in the graph's memory pool every replay) instead of adding into zeroed
        # ones, one add kernel per parameter and a zeroing pass a step (0.7 ms at gpt2).
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if whole_step_graph:
        return model, capture_step(train_on, data), data
    if packed:
        return model, lambda i: train_on(data[i], *docs[i]).clone(), data
    return model, lambda i: train_on(data[i]).clone(), data


def _documents(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, T + 1) batch of the byte-tokenized stdlib corpus -> (targets with those across
    a document boundary ignored, cu_seqlens): what data.pack=true's loader gives."""
    from fusedtrain.data import ByteTokenizer, cu_seqlens_of, mark_documents

    targets, starts = mark_documents(batch[:, :-1], batch[:, 1:], ByteTokenizer.eot)
    return targets, cu_seqlens_of(starts)


def bench_train_variant(model_name: str, batch: int, seq: int, steps: int, warmup: int,
                        variant: dict, device: str, data_source: str = "synthetic",
                        seed: int = 0) -> dict:
    """Warm-up steps (compilation, autotuning), then `steps` timed steps issued back to
    back as a training loop would: tokens/s from the wall time of the timed steps (one
    sync at each end), per-step ms from CUDA events read afterwards, the GPU's SM
    clock and power over those steps where nvidia-smi can tell (gpu_clocks), how busy
    the host's CPUs were meanwhile and how fast the host ran Python just before
    (host_load)."""
    if variant.get("replay") is False:
        from fusedtrain.ops import _replay

        with _replay.disabled():
            return bench_train_variant(model_name, batch, seq, steps, warmup,
                                       {**variant, "replay": None}, device, data_source, seed)
    if variant.get("user_loop"):
        with torch.autograd.set_multithreading_enabled(True):
            return _bench_steps(model_name, batch, seq, steps, warmup, variant, device,
                                data_source, seed, contextlib.nullcontext())
    # The heap frozen as a long training run's would be after its warm-up.
    return _bench_steps(model_name, batch, seq, steps, warmup, variant, device, data_source,
                        seed, python_heap_frozen())


def _bench_steps(model_name: str, batch: int, seq: int, steps: int, warmup: int,
                 variant: dict, device: str, data_source: str, seed: int, heap) -> dict:
    """bench_train_variant's measurement, with `heap` entered over the timed steps."""
    cuda = device == "cuda"
    if cuda:  # from before setup: a graphed variant allocates its step's memory at capture
        torch.cuda.reset_peak_memory_stats()
    model, step, _ = train_setup(model_name, batch, seq, warmup + steps, variant, device,
                                 data_source, seed)
    losses, first_step_s, attention = [], None, None
    # SDPA's kernels named from the last warm-up step (a profiled step, not an extra one).
    sdpa = cuda and variant["eager_attention"] == "sdpa" and not variant["kernels"]["attention"]
    for i in range(warmup):
        t_step = time.perf_counter()
        if sdpa and i == warmup - 1:
            attention = sdpa_kernels(lambda: losses.append(step(i)))
        else:
            losses.append(step(i))
        if i == 0:  # compilation and autotuning happen here
            if cuda:
                torch.cuda.synchronize()
            first_step_s = time.perf_counter() - t_step
    python_ns = python_speed_ns()  # how fast this host runs Python, just before the steps
    with heap, ClockSampler() as clocks, HostLoad() as host:
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
           **(clocks.summary or {}), **(host.summary or {}), "host_python_ns": python_ns,
           **({"attention_kernels": attention} if attention else {})}
    known = peak_flops() if cuda else None
    if known is not None:
        out["mfu"] = model.flops_per_token(seq) * tokens_per_s / known[1]
        out["peak_flops"] = known[1]
    return out


def sdpa_kernels(run) -> list[str]:
    """The attention kernels run() launches, by the profiler's names: what SDPA really ran
    (its default on the H200 with torch 2.11 is cuDNN's, also under torch.compile), for
    the benchmark's peer to be named by it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return sorted(n[:90] for n in names
                  if re.search(r"sdpa|flash|fmha|attention|cudnn", n, re.IGNORECASE))


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
    """Import what a variant's run imports lazily (Lightning, through fusedtrain.training
    and fusedtrain.data; Inductor when a variant compiles) before any variant's time limit
    is armed: an alarm that stops a first import halfway leaves a partly initialised
    module behind, and every later variant then fails on it ("partially initialized module
    'lightning.fabric'", seen once in tests/test_bench.py)."""
    import fusedtrain.data  # noqa: F401
    import fusedtrain.training.graph_capture  # noqa: F401
    import fusedtrain.training.lightning_module  # noqa: F401

    if compiled:
        import torch._inductor.compile_fx  # noqa: F401


def run_train(args, save=lambda results: None) -> dict:
    """Every variant in turn; `save(results)` after each, so an interrupted run keeps
    what it measured."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    variants = train_variants(args.ablation, args.compile_mode, args.data != "synthetic")
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants}
    _import_before_time_limits(compiled=any(v["compile"] for v in variants.values()))
    results = {}
    stopped = None  # the first variant its time limit stopped
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
        r = results[name]
        if "final_loss" in r and not math.isfinite(r["final_loss"]):
            # Tokens/s of a diverged run times other arithmetic (NaNs, infinities).
            results[name] = {"error": f"final loss {r['final_loss']}: not a figure",
                             "discarded": r}
        if stopped is not None:
            # An alarm can stop a variant anywhere, a kernel's tuning or first call
            # included: on an H100 a packed variant run after a stopped one ended at a
            # NaN loss that a fresh process did not give (docs/journal.md).
            results[name]["after_stopped_variant"] = stopped
        if limit.expired and stopped is None:
            stopped = name
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
    lines += [f"{name}: SDPA ran {', '.join(r['attention_kernels'])}"
              for name, r in results.items() if r.get("attention_kernels")]
    lines += [f"{name}: ran after {r['after_stopped_variant']} was stopped in this process; "
              "rerun it alone to trust it" for name, r in results.items()
              if r.get("after_stopped_variant")]
    return "\n".join(lines)


# The fp32 model first: the trajectory every bf16 run strays from, and what each is
# measured against. Eager bf16 (SDPA and math attention) is the yardstick: how far low
# precision alone takes an unfused model from it.
def train_chart_title(info: dict) -> str:
    """The chart's title from bench.py train's run description (its JSON's "env")."""
    if "gpu" not in info:
        return f"{info.get('model')}, B={info.get('batch')}, T={info.get('seq')}, CPU"
    return (f"{info['model']}, B={info['batch']}, T={info['seq']}, {info['dtype']}, "
            f"{info['steps']} timed steps; {info['gpu']}, torch {info['torch']}, "
            f"triton {info['triton']}, {info['date']}")


def plot_train(results: dict, path: Path, title: str, reference: str = "compile-sdpa") -> bool:
    """Bars of tokens/s (each labelled with its ratio to `reference` where that ran, and
    the median SM clock where sampled) and peak memory per variant; False, and no chart,
    where no variant gave a figure."""
    names = [k for k, r in results.items() if "tokens_per_s" in r]
    if not names:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    plt.close(fig)
    return True
