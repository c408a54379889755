"""GPU checks at scale: tensors past 2**31 elements (int64 offsets), long sequences, and
bit-identical training reruns with deterministic=true. Each skips without CUDA."""

import csv

import pytest
import torch
import torch.nn.functional as F
from test_cli import _train

from fusedtrain import ops

BF16 = torch.bfloat16


def _randn(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=BF16) * scale).requires_grad_()


@pytest.mark.gpu
def test_attention_past_2_31_elements_matches_a_slice():
    B, H, T, D = 1040, 16, 1024, 128  # 2.18e9 elements per tensor
    assert B * H * T * D > 2 ** 31
    torch.manual_seed(0)
    q, k, v = (_randn(B, H, T, D) for _ in range(3))
    o = ops.flash_attention(q, k, v)
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    tail = [t[-2:].detach().clone().requires_grad_() for t in (q, k, v)]
    o_tail = ops.flash_attention(*tail)
    grads_tail = torch.autograd.grad(o_tail, tail, do[-2:])
    # the same kernels and configs on the last two batch elements: bit-identical
    assert torch.equal(o[-2:], o_tail)
    for full, part in zip((dq, dk, dv), grads_tail):
        assert torch.equal(full[-2:], part)


@pytest.mark.gpu
def test_linear_gelu_past_2_31_elements_matches_a_slice():
    M, K, N = 540_000, 256, 4096  # y and h: 2.2e9 elements each
    assert M * N > 2 ** 31
    torch.manual_seed(0)
    x, w, b = _randn(M, K), _randn(N, K, scale=K ** -0.5), _randn(N)
    y = ops.linear_gelu(x, w, b, "tanh")
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    rows = slice(M - 1000, M)  # past the 2**31-th element of y
    x_tail = x[rows].detach().clone().requires_grad_()
    y_tail = ops.linear_gelu(x_tail, w, b, "tanh")
    (dx_tail,) = torch.autograd.grad(y_tail, (x_tail,), dy[rows])
    # block sizes may differ between the two shapes: equal up to bf16 rounding
    torch.testing.assert_close(y[rows], y_tail, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx[rows], dx_tail, rtol=2e-2, atol=2e-2)
    assert y[rows].float().abs().mean() > 0.1  # not zeros written past an overflow


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_layer_norm_past_2_31_elements_matches_a_slice(op):
    """Past 2**31 elements the forward switches to int64 row offsets (OFF64): the last
    rows equal the same rows normalised on their own (int32 offsets), forward and
    backward, and are not zeros written past an overflow."""
    M, C = 2_100_000, 1024  # 2.15e9 elements
    assert M * C > 2 ** 31
    torch.manual_seed(0)
    x, r, w, b = _randn(M, C), _randn(M, C), _randn(C, scale=0.1), _randn(C, scale=0.1)
    args = (x, r, w, b) if op == "add_layer_norm" else (x, w, b)
    y = getattr(ops, op)(*args)
    y = y[0] if isinstance(y, tuple) else y
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    rows = slice(M - 1000, M)
    tail = [t[rows].detach().clone().requires_grad_() if t.dim() == 2 else t for t in args]
    y_tail = getattr(ops, op)(*tail)
    y_tail = y_tail[0] if isinstance(y_tail, tuple) else y_tail
    (dx_tail,) = torch.autograd.grad(y_tail, (tail[0],), dy[rows])
    torch.testing.assert_close(y[rows], y_tail, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx[rows], dx_tail, rtol=2e-2, atol=2e-2)
    assert y[rows].float().abs().mean() > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("T", [16384, 32768])
def test_attention_long_sequences_agree_with_sdpa(T):
    B, H, D = 1, 4, 64
    torch.manual_seed(0)
    q, k, v = (_randn(B, H, T, D) for _ in range(3))
    do = torch.randn(B, H, T, D, device="cuda", dtype=BF16)
    outs = {}
    for name, fn in (("fused", ops.flash_attention),
                     ("sdpa", lambda *a: F.scaled_dot_product_attention(*a, is_causal=True))):
        o = fn(q, k, v)
        outs[name] = (o, *torch.autograd.grad(o, (q, k, v), do))
    for a, b in zip(outs["fused"], outs["sdpa"]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=3e-2)


@pytest.mark.gpu
def test_deterministic_training_is_bit_identical(tmp_path):
    losses = []
    for run in ("a", "b"):
        d = tmp_path / run
        d.mkdir()
        r = _train(d, "trainer=gpu", "fused=true", "deterministic=true", "model=gpt2",
                   "model.n_layer=4", "data.batch_size=8", "model.block_size=256",
                   "trainer.max_steps=50", "trainer.val_check_interval=50",
                   "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1")
        assert r.returncode == 0, r.stderr[-3000:]
        with open(d / "metrics.csv") as f:
            losses.append([r["train/loss"] for r in csv.DictReader(f) if r.get("train/loss")])
    assert len(losses[0]) == 50
    assert losses[0] == losses[1]
