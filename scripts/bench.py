"""Benchmarks, every competitor in this one process, on fresh random data.

  python scripts/bench.py kernels [--family linear_gelu qkv attention attention_features
                                   attention_varlen layernorm cross_entropy swiglu rope]
      [--out DIR]
      kernel microbenchmarks (triton.testing.do_bench medians): fused vs eager vs
      torch.compile vs the library ceiling -> DIR/kernels.json, DIR/kernels.png;
      --graph times CUDA-graph replays instead (GPU time only) -> DIR/kernels-graph.*
  python scripts/bench.py train [--model gpt2] [--batch 16] [--seq 1024] [--steps 20] [--out DIR]
      training steps (forward, backward, AdamW; bf16 autocast) for the variants eager-math,
      eager-sdpa, compile-sdpa, fused, compile-fused, compile-fused-traced (under
      ops.trace_kernels), fused-graph and eager-sdpa-graph
      (the whole step as one CUDA graph) and, with --ablation, fused-graph-no-X (the
      graphed step with family X back to eager):
      tokens/s, step ms, MFU, peak memory -> DIR/train.json, DIR/train.png
  python scripts/bench.py parity [--model tiny] [--steps 100] [--seed 0] [--variants ...]
      [--out DIR]
      trained from one seed on the same stdlib batches: the fp32 model (no autocast), eager
      bf16 (SDPA, and math attention), fused bf16 (or --variants, the first the reference:
      fused-no-X, compile-fused, ...). Overlaid loss curves, the max |difference| of each
      to the reference and of fused to eager; bf16 noise is how far eager bf16 strays
      from fp32, and the run exits 1 if a fused variant strays more than twice as far
      (+ 1e-3) -> DIR/parity.json, DIR/parity.png
  python scripts/bench.py gradients [--model tiny] [--at 62] [--batches 2] [--variants ...]
      [--out DIR]
      the eager bf16 model trained --at steps of the parity run, then each variant's
      gradients on the next batches against the fp32 model's: relative L2 error per
      parameter group -> DIR/gradients.json
  python scripts/bench.py host [--shapes tiny gpt2] [--ops NAME ...] [--calls 200] [--out DIR]
      per public op, one forward+backward in a plain loop (host and GPU; at the tiny
      shape the GPU idles, so it is the host's cost) and as a CUDA-graph replay (GPU
      time), fused beside its eager twin, with kernels per call -> DIR/host.json,
      DIR/host.png; --cprofile OP prints cProfile's top functions of OP's fused calls
  python scripts/bench.py profile [--variant fused] [--model gpt2] [--out DIR]
      torch.profiler over a few training steps: GPU-busy share of the step and the top
      kernels by GPU time -> DIR/profile-VARIANT.txt

A table goes to stdout. Needs a CUDA GPU (the train part also runs on CPU for a smoke test).
`train` and `profile` run backward on the calling thread, as scripts/train.py does;
--autograd-threads gives PyTorch's worker thread instead. The benchmarks themselves are
fusedtrain/bench/ (kernels.py, training.py, parity.py, profile.py, host.py); this is
their command line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from fusedtrain.bench import host, kernels, parity, profile, training


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


def run_info(args: argparse.Namespace, *options: str) -> dict:
    """What a run's JSON says it measured on: the GPU and versions (kernels.env), or the
    CPU, and the command's `options` as given."""
    info = kernels.env() if torch.cuda.is_available() else {"device": "cpu"}
    info.update({k: getattr(args, k) for k in options})
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels", help="kernel microbenchmarks")
    k.add_argument("--family", nargs="+", choices=list(kernels.FAMILIES),
                   default=list(kernels.FAMILIES))
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
    h = sub.add_parser("host", help="host cost per op, fused vs eager twin")
    h.add_argument("--shapes", nargs="+", choices=list(host.SHAPES), default=list(host.SHAPES))
    h.add_argument("--ops", nargs="+", metavar="NAME", help="only these ops (default: all)")
    h.add_argument("--calls", type=int, default=200, help="timed calls at the tiny shape")
    h.add_argument("--cprofile", metavar="OP", help="cProfile OP's fused calls at the tiny shape")
    h.add_argument("--out", default="results")
    q = sub.add_parser("parity", help="fused vs eager loss curves, same seed and data")
    q.add_argument("--model", default="tiny")
    q.add_argument("--batch", type=int, default=8)
    q.add_argument("--seq", type=int, default=64)
    q.add_argument("--steps", type=int, default=100)
    q.add_argument("--data", default="stdlib", choices=["synthetic", "stdlib"])
    q.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    q.add_argument("--variants", nargs="+", metavar="NAME",
                   help="what to train, the first the reference (default: "
                        f"{' '.join(parity.PARITY_DEFAULT)}); also fused-no-FAMILY, "
                        "eager-fp32 (no autocast), compile-sdpa, compile-fused")
    q.add_argument("--out", default="results")
    g = sub.add_parser("gradients", help="one step's gradients against the fp32 model's")
    for name, default in (("--model", "tiny"), ("--batch", 8), ("--seq", 64), ("--at", 62),
                          ("--batches", 2), ("--seed", 0)):
        g.add_argument(name, type=type(default), default=default)
    g.add_argument("--data", default="stdlib", choices=["synthetic", "stdlib"])
    g.add_argument("--variants", nargs="+", metavar="NAME",
                   help="compared with eager-fp32 (default: "
                        f"{' '.join(parity.GRADIENTS_DEFAULT)})")
    g.add_argument("--out", default="results")
    args = p.parse_args(argv)
    # `train` and `profile` run backward on this thread unless --autograd-threads, as
    # train.py does (autograd_threads=false): the fused ops' Python backward nodes then
    # skip a hand-over to autograd's worker thread. The other commands keep PyTorch's
    # default. (Called, not entered: the setting holds for the whole process.)
    torch.autograd.set_multithreading_enabled(getattr(args, "autograd_threads", True))
    if args.cmd == "parity":
        try:
            result = parity.run_parity(args)
        except ValueError as e:  # variants it does not know, or fewer than two
            print(f"bench.py parity: {e}", file=sys.stderr)
            return 2
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result["env"] = run_info(args, "model", "batch", "seq", "steps", "data", "seed")
        (out / "parity.json").write_text(json.dumps(result, indent=1))
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, fp32"
        parity.plot_parity(result, out / "parity.png",
                             f"{args.model}, B={args.batch}, T={args.seq}, {args.data} data, "
                             f"seed {args.seed}, {dev}")
        return 0 if all(result.get("within_bf16_noise", {}).values()) else 1
    if args.cmd == "gradients":
        try:
            result = parity.run_gradients(args)
        except ValueError as e:
            print(f"bench.py gradients: {e}", file=sys.stderr)
            return 2
        print(parity.gradients_table(result))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result["env"] = run_info(args, "model", "batch", "seq", "at", "batches", "data", "seed")
        (out / "gradients.json").write_text(json.dumps(result, indent=1))
        return 0
    if args.cmd == "host":
        if not torch.cuda.is_available():
            print("bench.py host needs a CUDA GPU", file=sys.stderr)
            return 2
        if args.calls < 1:
            print("bench.py host: --calls must be >= 1", file=sys.stderr)
            return 2
        asked = set(args.ops or ()) | ({args.cprofile} - {None})
        unknown = asked - set(host.op_cases(1, 2))
        if unknown:
            print(f"bench.py host: unknown ops {sorted(unknown)}; known: "
                  f"{' '.join(host.op_cases(1, 2))}", file=sys.stderr)
            return 2
        if args.cprofile:
            print(host.cprofile_op(args.cprofile, args.calls))
            return 0
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        info = run_info(args, "shapes", "calls")
        info["autograd_threads"] = torch.autograd.is_multithreading_enabled()
        print(json.dumps(info), flush=True)
        rows = host.run_host(args.shapes, args.ops, args.calls, save=lambda rows: (
            out / "host.json").write_text(json.dumps({"env": info, "rows": rows}, indent=1)))
        print(host.host_table(rows))
        host.plot_host(rows, out / "host.png",
                       f"host cost per forward+backward, {info['gpu']}, torch {info['torch']}, "
                       f"triton {info['triton']}, bf16, {info['date']}")
        return 0
    if args.cmd == "profile":
        if not torch.cuda.is_available():
            print("bench.py profile needs a CUDA GPU", file=sys.stderr)
            return 2
        report = profile.run_profile(args)
        print(report)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile-{args.variant}.txt").write_text(report + "\n")
        return 0
    if args.cmd == "train":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        info = run_info(args, "model", "batch", "seq", "steps", "compile_mode",
                        "autograd_threads")
        print(json.dumps(info), flush=True)
        def save(results):
            (out / "train.json").write_text(json.dumps({"env": info, "results": results},
                                                       indent=1))

        results = training.run_train(args, save)
        save(results)
        print(training.train_table(results))
        if not training.plot_train(results, out / "train.png",
                                   training.train_chart_title(info)):
            print("no variant gave a figure: no chart", flush=True)
        return 0
    if not torch.cuda.is_available():
        print("bench.py kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    kernels.configure(graph=args.graph, approximate=args.approximate)
    name = "kernels-graph" if args.graph else "kernels"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    info = kernels.env()
    info["timing"] = "CUDA-graph replay" if args.graph else "Python launches"
    info["gelu"] = args.approximate
    print(json.dumps(info))
    rows = _RowsWritten(out / f"{name}.json", info)
    for fam in args.family:
        t0 = time.time()
        kernels.FAMILIES[fam](rows)
        print(f"[{fam}: {time.time() - t0:.0f}s]", file=sys.stderr)
    kernels.print_table(rows)
    kernels.plot_kernels(rows, out / f"{name}.png",
                         f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, "
                         f"{info['dtype']}, {info['date']}, {info['timing']}")
    return 0


class _RowsWritten(list):
    """The kernels' rows, the JSON rewritten at each one: a run stopped midway keeps every
    row it measured."""

    def __init__(self, path: Path, info: dict):
        super().__init__()
        self.path, self.info = path, info

    def append(self, row: dict) -> None:
        super().append(row)
        self.path.write_text(json.dumps({"env": self.info, "rows": list(self)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
