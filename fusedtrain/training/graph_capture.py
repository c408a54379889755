"""CUDA-graph capture of training work: the loss as GraphChain pieces (the Lightning loop),
or the whole step as one graph (the benchmark)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusedtrain.model import GPT
from fusedtrain.training.graph_chain import GraphChain


class _Stage(torch.nn.Module):
    """One piece of the loss for GraphChain: `fn`, with the modules whose parameters it
    uses registered here, so that the piece's graphs take those parameters as inputs and
    return their gradients."""

    def __init__(self, fn, *modules: torch.nn.Module):
        super().__init__()
        self.fn = fn
        self.parts = torch.nn.ModuleList(modules)

    def forward(self, *args: torch.Tensor):
        return self.fn(*args)


class GraphedLoss:
    """model.loss as CUDA graphs (GraphChain), a forward and a backward graph per piece.
    In pieces (`split`: the embedding, each block, the head and loss) the gradients of a
    block reach autograd (and DDP's all-reduce hooks) as soon as that block's backward
    has run, while earlier blocks' backward graphs still replay: communication overlaps
    compute. Unsplit (one process), the whole loss is one piece."""

    def __init__(self, model: GPT, idx: torch.Tensor, targets: torch.Tensor, split: bool):
        tr = model.transformer
        if split:
            tables = [tr.wte, *([tr.wpe] if "wpe" in tr else [])]
            self.pieces = [_Stage(model.embed, *tables),
                           *(_Stage(block, block) for block in tr.h),
                           _Stage(model.head_loss, tr.ln_f, model.lm_head or tr.wte)]
        else:
            self.pieces = [_Stage(model.loss, model)]
        self.chain = GraphChain(self.pieces, self._extras(idx, targets))

    def _extras(self, idx: torch.Tensor, targets: torch.Tensor) -> list[tuple]:
        """The caller's inputs of each piece: the tokens to the first, the targets to the
        last (first among its inputs), nothing to the others."""
        if len(self.pieces) == 1:
            return [(idx, targets)]
        return [(idx,), *([()] * (len(self.pieces) - 2)), (targets,)]

    def __call__(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        (loss,) = self.chain(*self._extras(idx, targets))
        return loss


def _distributed_world() -> int:
    """How many processes train together (1 outside torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def capture_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> GraphedLoss:
    """The loss's forward and backward captured as CUDA graphs (GraphedLoss: in pieces
    under DDP, whole in one process), after three warm-up runs on a side stream (where
    Triton compiles and autotunes): each step then replays them, instead of the host
    issuing every kernel. x, y: (B, T) tokens and targets. Autocast's weight-cast cache is
    off while capturing (cached casts made during capture would be freed while the graphs
    still read them); the graphs hold the autocast casts themselves."""
    amp = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                         enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
    with amp:
        return GraphedLoss(model, x.clone(), y.clone(), split=_distributed_world() > 1)


def capture_step(train_on: Callable[[torch.Tensor], torch.Tensor],
                 data: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """train_on (forward, backward and optimizer step on one (B, T + 1) batch, returning
    the loss) captured as one CUDA graph over a static batch buffer: three eager steps on
    a side stream first (Triton compiles and autotunes there, the optimizer makes its
    state), then each call step(i) copies data[i] into the buffer, replays the graph and
    returns a copy of the loss. Those three steps train the model on batches 0-2, which a
    timed loop then starts with again: a graphed run's first losses sit below an
    ungraphed one's, a curve shifted by 3 steps."""
    batch = data[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            train_on(data[i])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = train_on(batch)

    def step(i: int) -> torch.Tensor:
        batch.copy_(data[i])
        graph.replay()
        return loss.clone()

    return step
