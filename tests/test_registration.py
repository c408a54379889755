"""Every `fusedtrain::` custom op passes torch.library.opcheck (schema, fake tensor,
autograd registration, AOT dispatch with dynamic shapes) with the arguments the public
ops really give it in a forward and backward pass: what torch.compile relies on."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusedtrain import ops

F64 = torch.float64
OPS = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fusedtrain::"))


class _FirstCalls(TorchDispatchMode):
    """Records the first call of each fusedtrain op (a dispatch mode also makes the
    launchers go through the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusedtrain":
            self.calls.setdefault(func.name(), (func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def first_calls():
    def leaf(*shape):
        return torch.randn(*shape, dtype=F64, requires_grad=True)

    B, T, C, H = 2, 5, 12, 3
    x = leaf(B, T, C)
    with _FirstCalls() as mode:
        losses = [ops.linear_gelu(x, leaf(7, C), leaf(7)).sum(),
                  ops.fused_mlp(x, leaf(16, C), leaf(16), leaf(C, 16), leaf(C)).sum()]
        with torch.no_grad():
            ops.linear_gelu(x, leaf(7, C), leaf(7))
        q, k, v = ops.qkv_projection(x, leaf(3 * C, C), leaf(3 * C), H)
        losses.append(ops.flash_attention(q, k, v, causal=True).sum())
        losses.append(ops.layer_norm(x, leaf(C), leaf(C)).sum())
        y, s = ops.add_layer_norm(x, leaf(B, T, C), leaf(C), leaf(C))
        losses += [y.sum(), s.sum(), ops.layer_norm_gelu(x, leaf(C), leaf(C)).sum()]
        losses.append(ops.cross_entropy(leaf(B * T, 11), torch.randint(0, 11, (B * T,))))
        sum(losses).backward()
    return mode.calls


def test_every_op_is_reached(first_calls):
    assert OPS and sorted(first_calls) == OPS


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, first_calls):
    func, args, kwargs = first_calls[name]
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(func, args, kwargs)
