"""Under autocast the ops that own weights take them in fp32, cast them inside, and return
fp32 gradients (no autograd cast node, no bf16 gradient widened by a second pass), with
the values of their eager twins under autocast."""

import pytest
import torch

from fusedtrain import eager, ops

C, H = 24, 3


def _params(name: str) -> list[torch.Tensor]:
    shapes = {"linear": [(40, C), (40,)], "linear_gelu": [(40, C), (40,)],
              "fused_mlp": [(4 * C, C), (4 * C,), (C, 4 * C), (C,)],
              "qkv_projection": [(3 * C, C), (3 * C,)], "qkv_attention": [(3 * C, C), (3 * C,)]}
    return [(torch.randn(s) / 5).requires_grad_() for s in shapes[name]]


def _call(module, name: str, x, params):
    extra = (H,) if name.startswith("qkv") else ()
    out = getattr(module, name)(x, *params, *extra)
    return torch.cat([t.flatten() for t in out]) if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", ["linear", "linear_gelu", "fused_mlp", "qkv_projection",
                                  "qkv_attention"])
def test_fp32_parameters_get_fp32_gradients_under_autocast(name):
    x = torch.randn(2, 9, C, requires_grad=True)
    params = _params(name)
    dy = None
    results = []
    for module in (ops, eager):
        leaves = [x.detach().clone().requires_grad_()] + [p.detach().clone().requires_grad_()
                                                          for p in params]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = _call(module, name, leaves[0], leaves[1:])
        dy = torch.randn_like(y) if dy is None else dy
        grads = torch.autograd.grad(y, leaves, dy)
        results.append((y, grads))
    (y, grads), (y_ref, grads_ref) = results
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    for g, r, p in zip(grads, grads_ref, [x, *params]):
        assert g.dtype == p.dtype == torch.float32
        scale = r.abs().max().item()
        assert (g - r).abs().max().item() <= 2e-2 * scale, name
