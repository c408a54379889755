from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


def bf16_adamw_step(loss_fn, opt, idx: torch.Tensor, graphs: bool = False) -> float:
    """One training step on CUDA under bf16 autocast: loss_fn(idx[:, :-1], idx[:, 1:]),
    backward, opt's step; the loss's value. graphs: announce the step to Inductor's CUDA
    graphs (reduce-overhead) first."""
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_fn(idx[:, :-1], idx[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def train_losses(run_dir: Path, tmp_path: Path, *overrides: str
                 ) -> tuple[subprocess.CompletedProcess, list[float]]:
    """scripts/train.py with hydra.run.dir=run_dir, its corpus cached under tmp_path,
    asserted to exit 0 -> (the process, the train/loss values of run_dir's metrics.csv)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), f"hydra.run.dir={run_dir}",
           f"data.cache_dir={tmp_path / 'cache'}", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    with open(run_dir / "metrics.csv") as f:
        return r, [float(row["train/loss"]) for row in csv.DictReader(f) if row["train/loss"]]


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item()


def assert_within_eager_error(fused, eager_same_dtype, ref64, atol: float, what: str = ""):
    """docs/design.md's rule: max |fused - ref64| <= 2 * max |eager - ref64| + atol."""
    f, e = max_err(fused, ref64), max_err(eager_same_dtype, ref64)
    assert torch.isfinite(fused).all(), f"{what}: non-finite values"
    assert f <= 2 * e + atol, f"{what}: fused error {f:.3g} > 2 x eager error {e:.3g} + {atol:g}"


def grads_of(fn, inputs, grad_out=None):
    """Run fn(*inputs) and backward; return (output(s), grads of the inputs)."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None
              for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    if grad_out is None:
        gen = torch.Generator(device="cpu").manual_seed(1)
        grad_out = tuple(torch.randn(o.shape, generator=gen, dtype=torch.float64)
                         for o in outs)
    torch.autograd.backward(outs, [g.to(o.dtype).to(o.device) for g, o in zip(grad_out, outs)])
    return outs, [t.grad if t is not None and t.requires_grad else None for t in leaves], grad_out


def check_against_oracle(fused_fn, eager_fn, inputs, atol: float, grad_atol: float | None = None,
                         what: str = ""):
    """Outputs and input gradients of fused_fn within docs/design.md's rule, with eager_fn on the
    same inputs as the peer and eager_fn in fp64 as the oracle (same upstream gradient)."""
    ref_in = [t.detach().double().requires_grad_() if isinstance(t, torch.Tensor) else t
              for t in inputs]
    refs, ref_g, g = grads_of(eager_fn, ref_in)
    fused, fz_g, _ = grads_of(fused_fn, inputs, g)
    eag, ez_g, _ = grads_of(eager_fn, inputs, g)
    for i, (f, e, r) in enumerate(zip(fused, eag, refs)):
        assert_within_eager_error(f, e, r, atol, f"{what} output {i}")
    for i, (f, e, r) in enumerate(zip(fz_g, ez_g, ref_g)):
        if r is not None:
            assert_within_eager_error(f, e, r, grad_atol or atol, f"{what} grad of input {i}")
