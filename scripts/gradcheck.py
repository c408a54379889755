"""Gradient checks as a run.

  python scripts/gradcheck.py [model=tiny] [gradcheck.parts=[ops,model,report]]

  ops     torch.autograd.gradcheck (fp64) of every fused op of the enabled families
  model   the GPT with fused components vs all-eager, same weights and batch: loss and
          every parameter's gradient, judged against an fp64 eager model (fp32 on CPU;
          bf16 and fp32 on a GPU)
  report  accuracy distribution of every op over fresh random draws -> JSON + PNG

Per-component toggles apply (model.kernels.attention=false checks the rest). Exits
non-zero when any check fails; the last line is `gradcheck: N passed, M failed`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fusedtrain.config import ConfigError, build_run_config


def plot_report(report: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report)
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, impl in enumerate(("fused", "eager")):
        ax.bar([j + 0.4 * i for j in range(len(names))], [report[n][impl]["max"] for n in names],
               width=0.4, label=f"{impl} max", color=f"C{i}")
        ax.scatter([j + 0.4 * i for j in range(len(names))],
                   [report[n][impl]["p99"] for n in names], color="k", marker="_", zorder=3)
    ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=20, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("|out - fp64 reference| (bar: max, tick: p99)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(cfg: DictConfig) -> int:
    from fusedtrain import gradcheck as G

    run_cfg = build_run_config(cfg)
    opts = cfg.get("gradcheck", {})
    parts = list(opts.get("parts", ["ops", "model"]))
    unknown = set(parts) - {"ops", "model", "report"}
    if unknown:
        raise ConfigError(f"gradcheck.parts: unknown part(s) {sorted(unknown)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = run_cfg.model.kernels
    if not any(kernels.values()):
        raise ConfigError("gradcheck needs at least one fused component (fused=true)")
    print(f"gradcheck on {device}; fused components: "
          f"{', '.join(k for k, v in kernels.items() if v)}", flush=True)
    results = []
    if "ops" in parts:
        results += G.check_ops(kernels, device)
    if "model" in parts:
        dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
        for dt in dtypes:
            results += G.check_model(run_cfg.model, dt, device, batch=int(opts.get("batch", 2)),
                                     seed=run_cfg.seed)
    for r in results:
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.name:<48} {r.detail}")
    if "report" in parts:
        out = Path(HydraConfig.get().runtime.output_dir)
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        started = time.perf_counter()

        def show(name: str, v: dict) -> None:
            print(f"report {name:<20} fused max {v['fused']['max']:.2e} p99 "
                  f"{v['fused']['p99']:.2e} | eager max {v['eager']['max']:.2e} p99 "
                  f"{v['eager']['p99']:.2e}  [{time.perf_counter() - started:.0f}s]", flush=True)

        report = G.accuracy_report(int(opts.get("draws", 5)), device, dt, device == "cuda", show)
        (out / "accuracy.json").write_text(json.dumps(report, indent=1))
        title = (f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, {dt}, "
                 f"torch {torch.__version__}")
        plot_report(report, out / "accuracy.png", title)
        print(f"accuracy report: {out / 'accuracy.json'}, {out / 'accuracy.png'}")
    failed = [r for r in results if not r.passed]
    for r in failed:
        print(f"failed: {r.name}", file=sys.stderr)
    print(f"gradcheck: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        code = run(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
