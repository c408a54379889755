from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


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
    """DESIGN.md's rule: max |fused - ref64| <= 2 * max |eager - ref64| + atol."""
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
