"""A chain of training pieces replayed as CUDA graphs that share their buffers.

torch.cuda.make_graphed_callables gives each piece its own input and gradient buffers. A
chain of pieces (embedding, blocks, head) then copies each activation into the next
piece's inputs on the way forward and each gradient into the previous piece's on the
way back. At GPT-2's size that is ~80 device copies, ~1 ms a step on an H200
(docs/journal.md). Here piece i + 1 is captured reading piece
i's output buffers, and piece i's backward graph reads the gradient buffers that piece
i + 1's backward graph writes. Only the caller's own inputs are copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensors = tuple[torch.Tensor, ...]


def _as_tuple(out) -> Tensors:
    return out if isinstance(out, tuple) else (out,)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """t's storage as a new autograd leaf (requiring grad where t does)."""
    return t.detach().requires_grad_(t.requires_grad)


class _Piece:
    """One captured piece: its graphs and the buffers they read and write."""

    def __init__(self, module: torch.nn.Module, extras: Tensors, chained: Tensors):
        self.module = module
        self.extras = extras  # buffers of the caller's inputs (copied in at each call)
        self.chained = chained  # leaves over the previous piece's output buffers
        self.params = tuple(module.parameters())
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self.outs: Tensors = ()
        self.grad_outs: tuple[torch.Tensor | None, ...] = ()  # per output; None: no grad
        self.grads: tuple[torch.Tensor | None, ...] = ()  # per input of _Replay.apply

    def wrt(self) -> Tensors:
        return tuple(t for t in self.chained + self.params if t.requires_grad)

    def param_grads(self) -> tuple[torch.Tensor | None, ...]:
        return self.grads[len(self.extras) + len(self.chained):]


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece: _Piece, *inputs: torch.Tensor) -> Tensors:
        """inputs: the piece's extras, its chained inputs, its parameters."""
        ctx.piece = piece
        for buffer, t in zip(piece.extras, inputs):
            if buffer.data_ptr() != t.data_ptr():
                buffer.copy_(t)
        piece.fwd.replay()
        return tuple(o.detach() for o in piece.outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        piece = ctx.piece
        for buffer, g in zip(piece.grad_outs, grads):
            # A gradient made by the next piece's graph is already in place.
            if buffer is not None and buffer.data_ptr() != g.data_ptr():
                buffer.copy_(g)
        piece.bwd.replay()
        return (None, *(None if g is None else g.detach() for g in piece.grads))


class GraphChain:
    """pieces[i] called as pieces[i](*extras[i], *outputs of piece i - 1), captured as a
    forward and a backward CUDA graph each, after `warmup` eager runs on a side stream
    (where Triton compiles and autotunes). extras[i]: sample tensors of the inputs that
    the caller passes to piece i, none requiring grad. A piece's parameters
    (module.parameters()) are inputs of its graphs: their gradients go to autograd
    (into .grad, through DDP's hooks) as soon as that piece's backward graph has replayed.
    The caller keeps autocast's weight-cast cache off while capturing."""

    def __init__(self, pieces: Sequence[torch.nn.Module], extras: Sequence[Tensors],
                 warmup: int = 3):
        if len(pieces) != len(extras) or not pieces:
            raise ValueError("one tuple of extras per piece, and at least one piece")
        if any(t.requires_grad for e in extras for t in e):
            raise ValueError("the pieces' extra inputs must not require grad")
        extras = [tuple(t.detach().clone() for t in e) for e in extras]
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(warmup):
                self._warm_up(pieces, extras)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        # Forward graphs in order, each reading the previous one's outputs in place, then
        # backward graphs in reverse (the order they replay in: one pool serves them all).
        self.pieces: list[_Piece] = []
        outs: Tensors = ()
        for module, piece_extras in zip(pieces, extras):
            piece = _Piece(module, piece_extras, tuple(_leaf(o) for o in outs))
            with torch.cuda.graph(piece.fwd, pool=pool):
                outs = piece.outs = _as_tuple(module(*piece.extras, *piece.chained))
            self.pieces.append(piece)
        grad_outs: Tensors | None = None  # the next piece's gradients of its chained inputs
        for piece in reversed(self.pieces):
            if grad_outs is None:  # the last piece: the caller's upstream gradients
                grad_outs = tuple(torch.empty_like(o) for o in piece.outs if o.requires_grad)
            it = iter(grad_outs)
            piece.grad_outs = tuple(next(it) if o.requires_grad else None for o in piece.outs)
            wrt = piece.wrt()
            with torch.cuda.graph(piece.bwd, pool=pool):
                found = torch.autograd.grad([o for o in piece.outs if o.requires_grad], wrt,
                                            list(grad_outs), allow_unused=True)
            by_input = dict(zip(map(id, wrt), found))
            piece.grads = tuple(None for _ in piece.extras) + tuple(
                by_input.get(id(t)) for t in piece.chained + piece.params)
            # The previous piece reads these in place; an input left without a gradient
            # reads zeros (a buffer no graph writes).
            grad_outs = tuple(g if g is not None else torch.zeros_like(t)
                              for t, g in zip(piece.chained, piece.grads[len(piece.extras):])
                              if t.requires_grad)
        self._weight_grads = [(p, g) for piece in self.pieces
                              for p, g in zip(piece.params, piece.param_grads())
                              if g is not None]

    @staticmethod
    def _warm_up(pieces: Sequence[torch.nn.Module], extras: Sequence[Tensors]) -> None:
        """One eager forward and backward, a piece at a time through autograd.grad (so
        that no .grad is touched)."""
        outs: Tensors = ()
        for module, piece_extras in zip(pieces, extras):
            chained = tuple(_leaf(o) for o in outs)
            outs = _as_tuple(module(*piece_extras, *chained))
            wrt = [t for t in chained + tuple(module.parameters()) if t.requires_grad]
            needed = [o for o in outs if o.requires_grad]
            if needed and wrt:
                torch.autograd.grad(needed, wrt, [torch.empty_like(o) for o in needed],
                                    allow_unused=True)

    def __call__(self, *extras: Tensors) -> Tensors:
        """extras: a tuple of tensors per piece, shaped as at capture. Returns the last
        piece's outputs."""
        # Autograd keeps a gradient that a piece returns as .grad, without a copy, when
        # .grad is unset: .grad is then the graph's buffer, valid until the next replay
        # (one pool serves every graph, so a forward may reuse it). Gradients accumulated
        # over several passes (no zero_grad between) move out first.
        for p, buffer in self._weight_grads:
            if p.grad is not None and p.grad.data_ptr() == buffer.data_ptr():
                p.grad = p.grad.clone()
        outs: Tensors = ()
        for piece, piece_extras in zip(self.pieces, extras, strict=True):
            outs = _Replay.apply(piece, *piece_extras, *outs, *piece.params)
        return outs
