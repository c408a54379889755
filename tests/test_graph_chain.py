"""GraphChain: pieces replayed as CUDA graphs that read each other's buffers in place."""

import contextlib

import pytest
import torch

from fusedtrain.model import GPT, KERNEL_FAMILIES, GPTConfig
from fusedtrain.training.graph_capture import GraphedLoss
from fusedtrain.training.graph_chain import GraphChain


def test_bad_pieces_are_refused_before_any_capture():
    piece = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="one tuple of extras per piece"):
        GraphChain([piece], [(), ()])
    with pytest.raises(ValueError, match="one tuple of extras per piece"):
        GraphChain([], [])
    with pytest.raises(ValueError, match="must not require grad"):
        GraphChain([piece], [(torch.ones(2, requires_grad=True),)])


class _Graph:
    """A stand-in for torch.cuda.CUDAGraph: capture runs the work eagerly, and a replay
    runs `on_replay` (set by a test) in place of the captured kernels."""

    def __init__(self):
        self.on_replay = lambda: None

    def replay(self):
        self.on_replay()


def _without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


def test_gradients_accumulated_over_passes_keep_what_a_replay_overwrites(monkeypatch):
    """Autograd keeps a piece's weight gradient as .grad without a copy (.grad is then the
    backward graph's own buffer, which the next forward may reuse: one pool). A second
    pass before zero_grad must add to the first pass's gradient, not to what the replays
    wrote over it."""
    _without_cuda(monkeypatch)
    layer = torch.nn.Linear(3, 2)
    chain = GraphChain([layer], [(torch.ones(4, 3),)])
    (piece,) = chain.pieces
    weight_grad = piece.grads[1]  # inputs: x, weight, bias
    piece.fwd.on_replay = lambda: weight_grad.fill_(-100.0)  # the forward's scratch there
    x = torch.ones(4, 3)
    for value in (1.0, 2.0):  # what each backward replay writes
        piece.bwd.on_replay = lambda v=value: weight_grad.fill_(v)
        (out,) = chain((x,))
        out.backward(torch.ones_like(out))
    torch.testing.assert_close(layer.weight.grad, torch.full((2, 3), 3.0))


def _fused_gpt(n_batches: int):
    """(a small GPT with every fused kernel on the GPU, its parameters, n batches of
    (2, 65) tokens)."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=2, n_embd=64,
                    kernels=dict.fromkeys(KERNEL_FAMILIES, True))
    model = GPT(cfg).cuda()
    batches = [torch.randint(0, 128, (2, 65), device="cuda") for _ in range(n_batches)]
    return model, list(model.parameters()), batches


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("split", [True, False])
def test_replays_compute_the_loss_and_gradients_with_nothing_copied_between_pieces(
        monkeypatch, split):
    """The graphed loss of a fused GPT, in pieces and whole, replayed on two new batches:
    the loss and every parameter's gradient (accumulated into .grad, as training does) as
    the eager model computes them. Between pieces nothing is copied: the only copies are
    the caller's tokens and targets into the first and last pieces, and the loss's
    upstream gradient."""
    model, params, batches = _fused_gpt(3)
    graphed = GraphedLoss(model, batches[0][:, :-1], batches[0][:, 1:], split)
    pieces = graphed.chain.pieces
    assert len(pieces) == (4 if split else 1)
    for prev, piece in zip(pieces, pieces[1:]):
        assert [t.data_ptr() for t in piece.chained] == [o.data_ptr() for o in prev.outs]
        start = len(piece.extras)
        for buffer, grad in zip(prev.grad_outs, piece.grads[start:start + len(piece.chained)]):
            assert buffer is not None and grad is not None
            assert buffer.data_ptr() == grad.data_ptr()

    copies = []
    copy_ = torch.Tensor.copy_

    def counted_copy(self, src, *args, **kwargs):
        copies.append(src.shape)
        return copy_(self, src, *args, **kwargs)

    for batch in batches[1:]:
        x, y = batch[:, :-1].clone(), batch[:, 1:].clone()  # new tensors: copied in
        model.zero_grad(set_to_none=True)
        copies.clear()
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "copy_", counted_copy)
            loss = graphed(x, y)
            loss.backward()
        assert copies == [x.shape, y.shape, loss.shape]  # tokens, targets, d loss
        expected = model.loss(x, y)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        for p, e in zip(params, torch.autograd.grad(expected, params)):
            torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_backward_passes_accumulate_as_the_eager_model():
    """Gradient accumulation (two micro-batches before zero_grad) through real replays,
    the tied embedding's gradient summed from two pieces."""
    model, params, batches = _fused_gpt(2)
    graphed = GraphedLoss(model, batches[0][:, :-1], batches[0][:, 1:], split=True)
    model.zero_grad(set_to_none=True)
    expected = [torch.zeros_like(p) for p in params]
    for batch in batches:
        graphed(batch[:, :-1], batch[:, 1:]).backward()
        eager = torch.autograd.grad(model.loss(batch[:, :-1], batch[:, 1:]), params)
        expected = [e + g for e, g in zip(expected, eager)]
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-5)
