"""`bench.py profile`: torch.profiler over a few steps of one training variant (GPU-busy
share, top kernels), optionally cProfile's host hot spots."""

from __future__ import annotations

import time

import torch

from fusedtrain.bench.training import train_setup, train_variants


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
