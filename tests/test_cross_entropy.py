import pytest
import torch
from conftest import check_against_oracle, grads_of
from torch.autograd import gradcheck

from fusedtrain import eager, ops

F64 = torch.float64


def _targets(shape, V, ignored=1):
    t = torch.randint(0, V, shape)
    t.view(-1)[:ignored] = -100
    return t


@pytest.mark.parametrize("lead", [(13,), (2, 5)])
def test_gradcheck(lead):
    logits = torch.randn(*lead, 29, dtype=F64, requires_grad=True)
    t = _targets(lead, 29)
    assert gradcheck(lambda x: ops.cross_entropy(x, t), (logits,))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.float16, 1e-4)])
@pytest.mark.parametrize("M,V", [(113, 1037), (7, 5000)])  # V past one vocabulary block
def test_accuracy_against_fp64(dtype, atol, M, V):
    logits = (torch.randn(M, V) * 3).to(dtype).requires_grad_()
    t = _targets((M,), V, ignored=3)
    check_against_oracle(lambda x: ops.cross_entropy(x, t), lambda x: eager.cross_entropy(x, t),
                         [logits], atol, atol, "cross_entropy")


def test_large_logits_stay_finite():
    logits = torch.randn(9, 300, dtype=torch.float32) * 1e3
    t = _targets((9,), 300, ignored=0)
    torch.testing.assert_close(ops.cross_entropy(logits, t), eager.cross_entropy(logits, t))


def test_ignored_rows_and_bad_targets():
    logits = torch.randn(4, 10, dtype=F64, requires_grad=True)
    t = torch.tensor([1, -100, 3, -100])
    loss = ops.cross_entropy(logits, t)
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.equal(g[1], torch.zeros(10, dtype=F64))
    torch.testing.assert_close(loss, eager.cross_entropy(logits, t))
    assert torch.isnan(ops.cross_entropy(logits, torch.tensor([1, 2, 10, 0])))  # not a stray read


def test_masked_vocabulary_entries():
    """-inf logits (a masked vocabulary), among them a whole first chunk of a row (the
    online logsumexp's running maximum still -inf after it)."""
    logits = torch.randn(3, 2500, dtype=F64)
    logits[0, :1500] = float("-inf")
    logits[1, ::3] = float("-inf")
    t = torch.tensor([2000, 1, 7])
    leaf = logits.clone().requires_grad_()
    ref_leaf = logits.clone().requires_grad_()
    loss, ref = ops.cross_entropy(leaf, t), eager.cross_entropy(ref_leaf, t)
    torch.testing.assert_close(loss, ref)
    loss.backward(), ref.backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad)


def test_inplace_backward_writes_the_gradient_over_the_logits():
    logits = torch.randn(2, 9, 1500, dtype=F64)
    t = _targets((2, 9), 1500, ignored=2)
    ref_leaf = logits.clone().requires_grad_()
    (ref,) = torch.autograd.grad(ops.cross_entropy(ref_leaf, t), ref_leaf)
    leaf = logits.clone().requires_grad_()
    scaled = leaf * 1.0  # logits no one reads after the loss
    (g,) = torch.autograd.grad(ops.cross_entropy(scaled, t, inplace_backward=True), scaled)
    assert g.data_ptr() == scaled.data_ptr()  # no second logits-sized buffer
    torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_compile_fullgraph_matches_eager():
    logits = torch.randn(2, 6, 50, requires_grad=True)
    t = _targets((2, 6), 50)
    compiled = torch.compile(lambda x: ops.cross_entropy(x * 2, t), fullgraph=True,
                             backend="aot_eager")
    (o,), (g,), _ = grads_of(compiled, (logits,))
    (ref,), (ref_g,), _ = grads_of(lambda x: eager.cross_entropy(x * 2, t), (logits,))
    torch.testing.assert_close(o, ref)
    torch.testing.assert_close(g, ref_g)


def test_bad_inputs():
    logits = torch.randn(4, 10)
    with pytest.raises(TypeError, match="targets"):
        ops.cross_entropy(logits, torch.zeros(4))
    with pytest.raises(ValueError, match="targets"):
        ops.cross_entropy(logits, torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="logits"):
        ops.cross_entropy(logits.long(), torch.zeros(4, dtype=torch.long))


@pytest.mark.gpu
def test_gpu_bf16_accuracy_at_gpt2_vocabulary():
    logits = (torch.randn(4096, 50304, device="cuda") * 3).bfloat16().requires_grad_()
    t = torch.randint(0, 50304, (4096,), device="cuda")
    check_against_oracle(lambda x: ops.cross_entropy(x, t), lambda x: eager.cross_entropy(x, t),
                         [logits], 1e-5, 1e-7, "cross_entropy")
