"""fusedtrain.casts: the fused ops cast their weights themselves under autocast, a block's
together, with the same values and gradients as casting each in its op."""

import contextlib

import pytest
import torch
from conftest import bf16_adamw_step

import fusedtrain.model as model_module
from fusedtrain.casts import cast_params, grouped_casts
from fusedtrain.model import GPT, GPTConfig
from fusedtrain.weight_copies import WEIGHT_COPIES

FUSED_LINEARS = dict(mlp=True, qkv=True, attention=False, layernorm=True, cross_entropy=False)


def _tiny(kernels: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32,
                         kernels=kernels))


def _cast_leaves(root) -> set[int]:
    """ids of the leaf tensors whose gradient comes back through an autograd cast node."""
    seen, stack, leaves = set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for next_fn, _ in node.next_functions:
            if type(node).__name__ == "ToCopyBackward0" and hasattr(next_fn, "variable"):
                leaves.add(id(next_fn.variable))
            stack.append(next_fn)
    return leaves


def _loss_and_grads(model: GPT, idx: torch.Tensor):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(idx, idx)
    cast = _cast_leaves(loss.grad_fn)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, cast


def test_grouped_casts_give_the_same_bits_and_no_cast_nodes(monkeypatch):
    """The fused ops cast their parameters inside and return fp32 gradients, with or
    without the grouped copies: the same bits, and no autograd cast node for any of them."""
    model = _tiny(FUSED_LINEARS)
    idx = torch.randint(0, 64, (2, 16))
    loss, grads, cast = _loss_and_grads(model, idx)
    monkeypatch.setattr(model_module, "grouped_casts", lambda *m: contextlib.nullcontext())
    loss_ref, grads_ref, cast_ref = _loss_and_grads(model, idx)

    assert torch.equal(loss, loss_ref)
    for name, g in grads_ref.items():
        assert grads[name].dtype == torch.float32
        assert torch.equal(grads[name], g), name
    fused = [p for b in model.transformer.h for m in (b.attn.c_attn, b.attn.c_proj,
                                                      b.mlp.c_fc, b.mlp.c_proj)
             for p in (m.weight, m.bias)]
    assert len(fused) == 8 * model.config.n_layer
    assert not {id(p) for p in fused} & (cast | cast_ref)
    # The unfused model's linears are cast by autocast, each weight through a cast node.
    eager_model = _tiny(dict.fromkeys(FUSED_LINEARS, False))
    assert id(eager_model.transformer.h[0].mlp.c_fc.weight) in _loss_and_grads(eager_model, idx)[2]


@pytest.mark.parametrize("grad", [True, False])
def test_one_grouped_cast_for_all_blocks_when_training(grad, monkeypatch):
    """Training: one multi-tensor copy before the first block for every block's weights;
    without gradients one a block."""
    import fusedtrain.casts as casts

    calls = []
    copy = torch._foreach_copy_
    monkeypatch.setattr(casts.torch, "_foreach_copy_", lambda *a: calls.append(1) or copy(*a))
    model = _tiny(FUSED_LINEARS)
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        model.loss(idx, idx)
    assert len(calls) == (1 if grad else model.config.n_layer)


def test_grouped_casts_only_where_they_apply():
    lin = torch.nn.Linear(4, 3)
    bf16 = torch.bfloat16
    with grouped_casts(lin.weight, lin.bias):  # no autocast: nothing prepared
        assert cast_params(bf16, lin.weight)[0] is not cast_params(bf16, lin.weight)[0]
    with torch.autocast("cpu", dtype=bf16), grouped_casts(lin.weight, None, lin.bias):
        w, b = cast_params(bf16, lin.weight, lin.bias)
        assert w.dtype == b.dtype == bf16 and w is cast_params(bf16, lin.weight)[0]
        assert not w.requires_grad and torch.equal(w, lin.weight.to(bf16))
        assert cast_params(torch.float16, lin.weight)[0].dtype == torch.float16  # other dtype
        assert cast_params(None, lin.weight, None) == (lin.weight, None)
    # Left the block: the copies are gone.
    assert cast_params(bf16, lin.weight)[0] is not w
    # Parameters already in the autocast dtype (FSDP's mixed precision) are not copied.
    lin_bf16 = torch.nn.Linear(4, 3).to(bf16)
    with torch.autocast("cpu", dtype=bf16), grouped_casts(lin_bf16.weight, lin_bf16.bias):
        assert cast_params(bf16, lin_bf16.weight)[0] is lin_bf16.weight


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


def test_the_tied_head_reads_the_optimizers_copy_of_the_token_table():
    """ops.gpt_embedding returns the token table as a view of it (an autograd.Function's
    input returned): the head's cast finds the copy that fusedtrain's AdamW published for
    the table, while the table is unchanged, and not for a part of it."""
    from fusedtrain import casts, ops
    from fusedtrain.optim import AdamW
    from fusedtrain.weight_copies import WEIGHT_COPIES

    torch.manual_seed(0)
    wte = torch.nn.Parameter(torch.randn(64, 32))
    wpe = torch.nn.Parameter(torch.randn(16, 32))
    opt = AdamW([wte, wpe], lr=1e-2)
    wte.grad, wpe.grad = torch.randn_like(wte), torch.randn_like(wpe)
    opt.step()
    idx = torch.randint(0, 64, (2, 16))
    bf16 = torch.bfloat16
    _, head_weight = ops.gpt_embedding(idx, wte, wpe, inplace_backward=True)
    assert head_weight is not wte and head_weight._base is wte
    copy = cast_params(bf16, wte)[0]  # the optimizer's (the table's own lookup)
    assert copy is WEIGHT_COPIES.fresh(wte, bf16) is not None
    assert cast_params(bf16, head_weight)[0] is copy
    assert casts._prepared_copy(head_weight[:8], bf16) is None  # a part of the table
    with torch.no_grad():
        wte.add_(1.0)  # the copy is stale for the table and for a view of it
    _, head_weight = ops.gpt_embedding(idx, wte, wpe, inplace_backward=True)
    fresh = cast_params(bf16, head_weight)[0]
    assert fresh is not copy and torch.equal(fresh, wte.detach().to(bf16))


class _CountedLookups:
    """WEIGHT_COPIES as the compiled op sees it, recording whether each lookup found a copy."""

    def __init__(self, found: list[bool]):
        self.found = found

    def fresh(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        copy = WEIGHT_COPIES.fresh(w, dtype)
        self.found.append(copy is not None)
        return copy


@pytest.mark.slow
def test_compiled_fused_ops_read_the_optimizers_copies_while_fresh(monkeypatch):
    """Under torch.compile the weights' casts go through fusedtrain::published_cast, which
    looks the optimizer's copy up at each call: every weight of the compiled model comes
    from its copy while the copies are fresh, and is cast anew (same loss as uncompiled)
    once a weight changed after the optimizer's step."""
    import fusedtrain.ops.published_cast as op_module
    from fusedtrain.optim import AdamW

    model = _tiny(dict(FUSED_LINEARS, cross_entropy=True))
    opt = AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (2, 16))
    _loss_and_grads(model, idx)
    opt.step()  # publishes the copies
    found = []
    monkeypatch.setattr(op_module, "WEIGHT_COPIES", _CountedLookups(found))
    compiled = torch.compile(model.loss, fullgraph=True, backend="aot_eager")

    def losses():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model.loss(idx, idx), compiled(idx, idx)

    eager, got = losses()
    casts_a_call = len(found)
    # Two blocks' MLP (two weights, two biases) and QKV (weight, bias); the tied head's table.
    assert casts_a_call == 2 * (4 + 2) + 1 and all(found)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.add_(0.5)  # stale from here on
    eager, got = losses()
    assert found[casts_a_call:].count(False) == 1
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_compiled_training_reads_the_copies_and_matches_uncompiled(monkeypatch, mode):
    """Five AdamW steps of the fused model on CUDA, compiled (Inductor) against uncompiled
    from the same weights: the same losses, and the compiled forwards read the optimizer's
    copies (default mode) or cast in their CUDA graphs (reduce-overhead)."""
    import fusedtrain.ops.published_cast as op_module
    from fusedtrain import ops
    from fusedtrain.optim import AdamW

    every = dict(mlp=True, qkv=True, attention=True, layernorm=True, cross_entropy=True)
    models = [_tiny(every).cuda() for _ in range(2)]
    found = []
    monkeypatch.setattr(op_module, "WEIGHT_COPIES", _CountedLookups(found))
    ops.register_inductor_fallbacks()
    fns = [models[0].loss, torch.compile(models[1].loss, mode=None if mode == "default" else mode)]
    opts = [AdamW(m.parameters(), lr=1e-2) for m in models]
    idx = torch.randint(0, 64, (4, 17), device="cuda")
    losses = [[], []]
    for _ in range(5):
        for fn, opt, out in zip(fns, opts, losses):
            out.append(bf16_adamw_step(fn, opt, idx, graphs=mode == "reduce-overhead"))
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=2e-3)
    assert losses[1][-1] < losses[1][0]
    if mode == "default":  # from the second step on every lookup finds its copy
        assert found and found.count(False) <= len(found) // 5
