"""fusedtrain.casts: a block's fused-op weights cast together under autocast, with the
same values and gradients as casting each in its op."""

import contextlib

import pytest
import torch

import fusedtrain.model as model_module
from fusedtrain.casts import grouped_casts, prepared_cast
from fusedtrain.model import GPT, GPTConfig

FUSED_LINEARS = dict(mlp=True, qkv=True, attention=False, layernorm=True, cross_entropy=False)


def _tiny(kernels: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32,
                         kernels=kernels))


def _graph_nodes(root) -> list[str]:
    seen, stack, names = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def _loss_and_grads(model: GPT, idx: torch.Tensor):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(idx, idx)
    nodes = _graph_nodes(loss.grad_fn)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, nodes


def test_grouped_casts_give_the_same_bits_with_one_cast_node_per_block(monkeypatch):
    model = _tiny(FUSED_LINEARS)
    idx = torch.randint(0, 64, (2, 16))
    loss, grads, nodes = _loss_and_grads(model, idx)
    monkeypatch.setattr(model_module, "grouped_casts", lambda *m: contextlib.nullcontext())
    loss_ref, grads_ref, nodes_ref = _loss_and_grads(model, idx)

    assert torch.equal(loss, loss_ref)
    for name, g in grads_ref.items():
        assert grads[name].dtype == torch.float32
        assert torch.equal(grads[name], g), name
    # Per block: the QKV projection's weight and bias and the MLP's weights and first bias,
    # no longer one cast each. (Without the group, ops.linear casts the attention output
    # projection's weight inside the op; both output biases are added in fp32 by the
    # fused LayerNorms: no cast node for them either way.)
    n_layer = model.config.n_layer
    assert nodes.count("_CastAllBackward") == n_layer
    assert nodes_ref.count("_CastAllBackward") == 0
    assert nodes_ref.count("ToCopyBackward0") - nodes.count("ToCopyBackward0") == 5 * n_layer


def test_grouped_casts_only_where_they_apply():
    lin = torch.nn.Linear(4, 3)
    with grouped_casts(lin.weight, lin.bias):  # no autocast: nothing prepared
        assert prepared_cast(lin.weight, torch.bfloat16) is not prepared_cast(
            lin.weight, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), grouped_casts(lin.weight, lin.bias):
        w = prepared_cast(lin.weight, torch.bfloat16)
        assert w.dtype == torch.bfloat16 and w is prepared_cast(lin.weight, torch.bfloat16)
        assert prepared_cast(lin.weight, torch.float16).dtype == torch.float16  # other dtype
    # Left the block: the copies are gone.
    assert prepared_cast(lin.weight, torch.bfloat16) is not w
    # A frozen parameter keeps its own cast, which needs no gradient.
    frozen = torch.nn.Linear(4, 3)
    frozen.weight.requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16), grouped_casts(frozen.weight, frozen.bias):
        assert not prepared_cast(frozen.weight, torch.bfloat16).requires_grad
        assert prepared_cast(frozen.bias, torch.bfloat16).requires_grad
        # No gradients: all may be grouped.
        with torch.no_grad(), grouped_casts(frozen.weight, frozen.bias):
            w = prepared_cast(frozen.weight, torch.bfloat16)
            assert w is prepared_cast(frozen.weight, torch.bfloat16)
    # Parameters already in the autocast dtype (FSDP's mixed precision) are not copied.
    lin_bf16 = torch.nn.Linear(4, 3).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), grouped_casts(lin_bf16.weight, lin_bf16.bias):
        assert prepared_cast(lin_bf16.weight, torch.bfloat16) is lin_bf16.weight


@pytest.mark.slow
def test_the_fused_model_compiles_whole_under_autocast():
    """torch.compile(fullgraph=True) of the fused model's loss: the grouped casts step aside
    (Inductor fuses casts itself) and leave no graph break."""
    model = _tiny(FUSED_LINEARS)
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model.loss(idx, idx)
        got = torch.compile(model.loss, fullgraph=True, backend="aot_eager")(idx, idx)
    torch.testing.assert_close(got, ref)
