import pytest
import torch
from conftest import check_against_oracle, grads_of

from fusedtrain import eager, ops
from fusedtrain.gradcheck import gradcheck

F64 = torch.float64


def _targets(shape, V, ignored=1):
    t = torch.randint(0, V, shape)
    t.view(-1)[:ignored] = -100
    return t


@pytest.mark.parametrize("lead", [(13,), (2, 5)])
def test_gradcheck(lead):
    logits = torch.randn(*lead, 29, dtype=F64, requires_grad=True)
    t = _targets(lead, 29)
    assert gradcheck(lambda x: ops.cross_entropy(x, t), (logits,), fast_mode=True)


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


# The LM head and its loss in one op: ops.linear_cross_entropy.

def _head(M, C, V, dtype=F64):
    x = torch.randn(M, C, dtype=dtype) / C ** 0.5
    w = torch.randn(V, C, dtype=dtype)
    return x, w


@pytest.mark.parametrize("lead", [(13,), (2, 5)])
def test_linear_cross_entropy_gradcheck(lead):
    x, w = _head(13, 7, 29)
    x = x[: torch.Size(lead).numel()].reshape(*lead, 7)
    t = _targets(lead, 29, ignored=2)
    assert gradcheck(lambda a, b: ops.linear_cross_entropy(a, b, t),
                     (x.requires_grad_(), w.requires_grad_()), fast_mode=True)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.float16, 1e-4)])
@pytest.mark.parametrize("M,C,V", [(113, 40, 1037), (7, 24, 5000)])
def test_linear_cross_entropy_accuracy_against_fp64(dtype, atol, M, C, V):
    x, w = _head(M, C, V, dtype)
    t = _targets((M,), V, ignored=3)
    check_against_oracle(lambda a, b: ops.linear_cross_entropy(a, b, t),
                         lambda a, b: eager.linear_cross_entropy(a, b, t),
                         [x.requires_grad_(), (w * 3).requires_grad_()], atol, atol,
                         "linear_cross_entropy")


def test_fwd_grad_losses_and_gradient_in_place():
    """cross_entropy_fwd_grad: -inf logits, a row whose first chunk is all -inf, ignored
    rows; in place the gradient lands in the logits' memory and the losses are those of
    the logits before."""
    from fusedtrain.kernels import cross_entropy as K

    logits = torch.randn(11, 2500, dtype=F64) * 4
    logits[0, :1500] = float("-inf")
    logits[3, ::3] = float("-inf")
    t = torch.tensor([2000, 1, -100, 7, 0, 5, -100, 2499, 3, 4, 6])
    ref_leaf = logits.clone().requires_grad_()
    ref_losses = torch.nn.functional.cross_entropy(ref_leaf, t, reduction="none")
    (ref_g,) = torch.autograd.grad(ref_losses.sum() / 9, ref_leaf)
    losses, count, g = K.cross_entropy_fwd_grad(logits.clone(), t, -100)
    torch.testing.assert_close(losses, ref_losses.detach())
    assert count.item() == 9
    torch.testing.assert_close(g, ref_g)
    buf = logits.clone()
    losses_in_place, _, g_in_place = K.cross_entropy_fwd_grad(buf, t, -100, inplace=True)
    assert g_in_place.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(losses_in_place, losses, rtol=0, atol=0)
    torch.testing.assert_close(g_in_place, g, rtol=0, atol=0)


def test_linear_cross_entropy_all_ignored_and_no_grad():
    x, w = _head(6, 8, 40)
    t = torch.full((6,), -100)
    xg = x.clone().requires_grad_()
    loss = ops.linear_cross_entropy(xg, w, t)
    assert torch.isnan(loss) and torch.isnan(eager.linear_cross_entropy(x, w, t))
    loss.backward()
    assert torch.equal(xg.grad, torch.zeros_like(x))  # NaN loss, but no row contributes
    t = _targets((6,), 40)
    with torch.no_grad():
        torch.testing.assert_close(ops.linear_cross_entropy(xg, w, t),
                                   eager.linear_cross_entropy(x, w, t))


def test_linear_cross_entropy_compile_fullgraph_matches_eager():
    x, w = _head(12, 16, 50, torch.float32)
    t = _targets((12,), 50)
    compiled = torch.compile(lambda a, b: ops.linear_cross_entropy(a * 2, b, t), fullgraph=True,
                             backend="aot_eager")
    (o,), (gx, gw), _ = grads_of(compiled, (x.requires_grad_(), w.requires_grad_()))
    (ref,), (rx, rw), _ = grads_of(lambda a, b: eager.linear_cross_entropy(a * 2, b, t), (x, w))
    torch.testing.assert_close(o, ref)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def test_linear_cross_entropy_bad_inputs():
    x, w = _head(4, 8, 10, torch.float32)
    t = torch.zeros(4, dtype=torch.long)
    with pytest.raises(TypeError, match="targets"):
        ops.linear_cross_entropy(x, w, t.float())
    with pytest.raises(ValueError, match="targets"):
        ops.linear_cross_entropy(x, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        ops.linear_cross_entropy(x, w[:, :7], t)
    with pytest.raises(TypeError, match="weight"):
        ops.linear_cross_entropy(x, w.double(), t)
    with pytest.raises(ValueError, match="vocabulary"):
        ops.linear_cross_entropy(x, w[:0], t)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,V", [(333, 50304), (7, 8384), (264, 64), (300, 100032)])
def test_gpu_shared_memory_kernel_matches_the_triton_kernels(M, V, dtype):
    """The one-pass Gluon kernel (sm_90) against the forward and backward Triton kernels:
    box tails (8384 logits: 131 sub-rows of 64, two boxes of 64 sub-rows and three more),
    more rows than CTAs, -inf logits, ignored rows, a target outside [0, V), a row too wide
    for two CTAs per SM (100032: one CTA's launch shape); in place and not."""
    from fusedtrain.kernels import cross_entropy as K
    from fusedtrain.kernels import cross_entropy_smem
    from fusedtrain.kernels._tma import gluon_ok

    logits = (torch.randn(M, V, device="cuda") * 4).to(dtype)
    if not gluon_ok(logits):
        pytest.skip("the Gluon kernels need an sm_90 GPU and their triton release")
    assert cross_entropy_smem.fits(logits)
    logits[0, : V // 2] = float("-inf")
    logits[-1, ::3] = float("-inf")
    t = torch.randint(0, V, (M,), device="cuda")
    t[1] = -100
    t[2] = V + 5
    count = (t != -100).sum()
    ref_loss, lse = K.cross_entropy_fwd(logits, t, -100)
    ref = K.cross_entropy_bwd(logits, t, lse, (1.0 / count.float()).reshape(1), -100)
    for inplace in (False, True):
        buf = logits.clone()
        loss, n, g = K.cross_entropy_fwd_grad(buf, t, -100, inplace=inplace)
        assert n.item() == count.item() and (g.data_ptr() == buf.data_ptr()) == inplace
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(g, ref, rtol=1e-2, atol=1e-4 / count.item())


@pytest.mark.gpu
def test_gpu_linear_cross_entropy_bf16_at_gpt2_vocabulary():
    x = (torch.randn(4096, 768, device="cuda")).bfloat16().requires_grad_()
    w = (torch.randn(50304, 768, device="cuda") * 0.1).bfloat16().requires_grad_()
    t = torch.randint(0, 50304, (4096,), device="cuda")
    check_against_oracle(lambda a, b: ops.linear_cross_entropy(a, b, t),
                         lambda a, b: eager.linear_cross_entropy(a, b, t), [x, w], 1e-5, 1e-7,
                         "linear_cross_entropy")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_mean_over_rows_past_one_block(dtype):
    """The forward's mean loss and the backward's 1 / count come from one launch: rows past
    the kernel's first block, ignored rows anywhere (their losses are 0); every row ignored
    gives NaN and inf, as loss.sum() / count did."""
    from fusedtrain.kernels import cross_entropy as K

    M = 2500
    loss = torch.rand(M, dtype=dtype)
    t = torch.randint(0, 50, (M,))
    t[torch.randperm(M)[:700]] = -100
    loss[t == -100] = 0
    mean, inv = K.kept_mean(loss, t, -100)
    kept = (t != -100).sum()
    torch.testing.assert_close(mean, loss.sum() / kept)
    torch.testing.assert_close(inv, (1 / kept).to(dtype))
    assert mean.dtype == inv.dtype == dtype and mean.shape == inv.shape == ()
    mean, inv = K.kept_mean(torch.zeros(5, dtype=dtype), torch.full((5,), 7), 7)
    assert torch.isnan(mean) and torch.isinf(inv)
