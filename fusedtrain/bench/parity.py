"""`bench.py parity` and `bench.py gradients`: loss curves of bf16 variants against the fp32
model from one seed and data order, with the bf16-noise verdict; one step's gradients of
each variant against the fp32 model's, per parameter group."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import fmean

import torch

from fusedtrain.bench.training import bench_train_variant, fused_but, train_setup, train_variants

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
    <= 2 max |eager bf16 - fp32| + PARITY_ATOL, docs/design.md's rule for one op applied to a
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
