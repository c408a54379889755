"""The C++ replay of recorded op calls (fusedtrain/ops/_replay.py, fusedtrain/csrc/replay.cpp):
a replayed call computes what the op's Python Function computes, bit for bit, forward and
backward; what cannot be recorded runs the Python Function; autograd's checks hold."""

import contextlib
import logging

import pytest
import torch

from fusedtrain import native, ops
from fusedtrain.ops import _replay

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C++ compiler here")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32 = torch.float32


def _leaves(*shapes, dtype=F32):
    return [torch.randn(*s, dtype=dtype, device=DEVICE).requires_grad_() for s in shapes]


def _run(fn, inputs, seed=0):
    """Outputs and the gradients of a random projection of them, detached."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, device=DEVICE, dtype=o.dtype, generator=g)).sum()
               for o in outs if o.is_floating_point())
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return [o.detach().clone() for o in outs] + list(torch.autograd.grad(loss, wanted)), out


CASES = {
    "layer_norm": (ops.layer_norm, lambda: _leaves((5, 7, 40), (40,), (40,))),
    "layer_norm_stream": (ops.layer_norm_stream, lambda: _leaves((6, 40), (40,), (40,))),
    "add_layer_norm": (ops.add_layer_norm, lambda: _leaves((6, 40), (6, 40), (40,), (40,))),
    "layer_norm_gelu": (ops.layer_norm_gelu, lambda: _leaves((6, 40), (40,), (40,))),
    "rms_norm": (ops.rms_norm, lambda: _leaves((6, 40), (40,))),
    "add_rms_norm": (ops.add_rms_norm, lambda: _leaves((6, 40), (6, 40), (40,))),
    "embedding": (ops.embedding, lambda: [torch.randint(0, 30, (3, 9), device=DEVICE),
                                          *_leaves((30, 16))]),
    "embedding_bf16": (ops.embedding, lambda: [torch.randint(0, 30, (3, 9), device=DEVICE),
                                               *_leaves((30, 16), dtype=torch.bfloat16)]),
    "cross_entropy": (ops.cross_entropy, lambda: [*_leaves((12, 50)),
                                                  torch.randint(0, 50, (12,), device=DEVICE)]),
    "flash_attention": (ops.flash_attention, lambda: _leaves(*[(1, 2, 24, 16)] * 3)),
    "linear": (ops.linear, lambda: _leaves((6, 32), (24, 32), (24,))),
    "linear_gelu": (ops.linear_gelu, lambda: _leaves((6, 32), (48, 32), (48,))),
    "fused_mlp": (ops.fused_mlp, lambda: _leaves((6, 32), (64, 32), (64,), (32, 64), (32,))),
    "swiglu_mlp": (ops.swiglu_mlp, lambda: _leaves((6, 32), (40, 32), (40, 32), (32, 40))),
    "qkv_projection": (lambda x, w, b: ops.qkv_projection(x, w, b, 2),
                       lambda: _leaves((2, 5, 32), (96, 32), (96,))),
    "rotary": (lambda x: ops.rotary(x, 10000.0), lambda: _leaves((1, 2, 8, 16))),
    "rope_qkv_projection": (
        lambda x, w: ops.qkv_projection(x, w, None, 4, 2, rope_base=10000.0),
        lambda: _leaves((1, 8, 32), (64, 32))),
    "linear_cross_entropy": (ops.linear_cross_entropy, lambda: [
        *_leaves((10, 32), (50, 32)), torch.randint(0, 50, (10,), device=DEVICE)]),
}


# Every op here: at these shapes their forwards are Triton launches, allocations, views
# and ATen ops of known output shapes (and RoPE's cached frequency table, held).
REPLAYED = set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_replayed_calls_equal_the_python_function_bit_for_bit(name):
    fn, make = CASES[name]
    inputs = make()
    with _replay.disabled():
        ref, _ = _run(fn, inputs)
    for call in range(3):  # records on the first, replays from the second
        got, out = _run(fn, inputs)
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), f"{name}, call {call}"
    first = out[0] if isinstance(out, tuple) else out
    assert _replayed_node(first) == (name in REPLAYED)


def _replayed_node(out) -> bool:
    """Whether out came from a replayed node (through the views an op may take after it)."""
    node = out.grad_fn
    while node is not None and type(node).__name__ in ("ViewBackward0", "UnsafeViewBackward0",
                                                        "ReshapeAliasBackward0"):
        node = node.next_functions[0][0]
    return type(node).__name__ == "CppFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_a_recorded_backward_runs_no_python(name):
    """After its first calls (which record; on a GPU the calls triton compiles a kernel in
    are retried), a replayed op's backward is its recorded program: no call goes to the
    Function's Python backward again (`_replay.python_backwards` counts those that do)."""
    fn, make = CASES[name]
    inputs = make()
    for _ in range(3):
        _run(fn, inputs)
    before = sum(_replay.python_backwards.values())
    for _ in range(2):
        _run(fn, inputs)
    calls = sum(_replay.python_backwards.values()) - before
    assert calls == 0, f"{name}: {calls} Python backward calls"


@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_differentiating_a_gradient_again_raises_naming_the_op(name, replay):
    """With create_graph=True the ops' gradients are the usual ones, but they carry no
    graph through the kernels: a further backward through them (a gradient penalty)
    raises, naming the Function, instead of silently leaving its terms out; replayed or
    on the Python Function alike."""
    fn, make = CASES[name]
    inputs = make()
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def loss_of(out):
        outs = out if isinstance(out, tuple) else (out,)
        return sum((o.float() ** 2).sum() for o in outs if o.is_floating_point())

    with contextlib.nullcontext() if replay else _replay.disabled():
        for _ in range(2):  # with the replay: the first call records, the second replays
            plain = torch.autograd.grad(loss_of(fn(*inputs)), wanted)
            grads = torch.autograd.grad(loss_of(fn(*inputs)), wanted, create_graph=True)
            for g, p in zip(grads, plain):
                assert torch.equal(g.detach(), p)
            with pytest.raises(RuntimeError, match="Function's backward is not differentiable"):
                sum((g.float() ** 2).sum() for g in grads).backward()


def test_layer_norm_replays_from_a_cpp_node_once_recorded():
    """The first call records (on a GPU, the call triton compiles a kernel in is retried),
    the later ones replay; with replay off, the Python Function."""
    x, w, b = _leaves((4, 24), (24,), (24,))
    nodes = [_replayed_node(ops.layer_norm(x, w, b)) for _ in range(4)]
    assert not nodes[0] and nodes[-1]
    assert nodes == sorted(nodes)  # once replayed, always
    with _replay.disabled():
        assert not _replayed_node(ops.layer_norm(x, w, b))


def test_the_output_dtype_and_saved_statistics_follow_the_modes_a_replay_keys_on():
    """The LayerNorm family leaves its output dtype and whether it saves statistics out of
    its replay key (they follow from autocast, grad mode and requires_grad, which the key
    holds): each mode, recorded and then replayed, gives its own dtype and its gradient."""
    x, w, b = _leaves((4, 24), (24,), (24,))
    r = torch.randn(4, 24, device=DEVICE)
    dev = x.device.type
    modes = {"plain": (None, True), "bf16": (torch.bfloat16, True),  # "plain": autocast off
             "fp16": (torch.float16, True), "no_grad": (None, False)}
    for _ in range(3):
        for name, (cast, grad) in modes.items():
            with torch.autocast(dev, dtype=cast or torch.float16, enabled=cast is not None), \
                    torch.set_grad_enabled(grad):
                y = ops.layer_norm(x, w, b)
                z, _ = ops.add_layer_norm(x, r, w, b)
            want = cast or F32
            assert y.dtype == z.dtype == want, name
            assert y.requires_grad == z.requires_grad == grad, name
            ref = torch.nn.functional.layer_norm(x.detach(), (24,), w.detach(), b.detach())
            torch.testing.assert_close(y.float(), ref, atol=1e-2, rtol=1e-2)
            if grad:
                (gx,) = torch.autograd.grad(y.float().sum() + z.float().sum(), x)
                assert gx.shape == x.shape and torch.isfinite(gx).all()
    assert _replayed_node(ops.layer_norm(x, w, b))  # outside autocast: the "plain" key


def test_a_replayed_signature_skips_the_checks_and_bad_neighbours_still_raise(monkeypatch):
    """The LayerNorm family replays a recorded signature before validating (the record's
    call passed the checks); any other argument misses the record and is checked."""
    from fusedtrain.ops import layernorm
    x, r, w, b = _leaves((4, 24), (4, 24), (24,), (24,))
    for _ in range(4):
        ops.layer_norm(x, w, b)
        ops.add_layer_norm(x, r, w, b)

    def refuse(*args, **kwargs):
        raise AssertionError("checked")

    with monkeypatch.context() as m:
        m.setattr(layernorm, "_check", refuse)
        assert _replayed_node(ops.layer_norm(x, w, b))
        assert _replayed_node(ops.add_layer_norm(x, r, w, b)[0])
        with pytest.raises(AssertionError, match="checked"):
            ops.layer_norm(x, w, b, eps=1e-3)  # another signature: checked first
    with pytest.raises(ValueError, match="eps"):
        ops.layer_norm(x, w, b, eps=-1.0)
    with pytest.raises(ValueError, match="weight"):
        ops.layer_norm(x, w[:23], b)
    with pytest.raises(TypeError, match="weight"):
        ops.layer_norm(x, [1.0] * 24, b)  # unhashable: never a key
    with pytest.raises(TypeError, match="x_bias"):
        ops.add_layer_norm(x, r, w, b, x_bias=x.to(torch.float64)[0])
    with pytest.raises(ValueError, match="residual"):
        ops.add_layer_norm(x, None, w, b)


def test_a_replayed_linear_skips_the_checks_and_autocasts_cast(monkeypatch):
    """linear replays a recorded signature before validating; under autocast an fp32 x
    misses the bf16 x's record and is cast, and a bad neighbour still raises."""
    import importlib

    linear_module = importlib.import_module("fusedtrain.ops.linear")  # (ops.linear: the op)
    x, w, b = _leaves((4, 24), (8, 24), (8,))
    dev = x.device.type
    for _ in range(4):
        ops.linear(x, w, b)
        with torch.autocast(dev, dtype=torch.bfloat16):
            ops.linear(x, w, b)

    def refuse(*args, **kwargs):
        raise AssertionError("checked")

    with monkeypatch.context() as m:
        m.setattr(linear_module, "check_linear", refuse)
        assert _replayed_node(ops.linear(x, w, b))
        with torch.autocast(dev, dtype=torch.bfloat16):
            with pytest.raises(AssertionError, match="checked"):
                ops.linear(x, w, b)  # fp32 x: its cast's record is keyed on the bf16 x
            y = ops.linear(x.detach().bfloat16().requires_grad_(), w, b)
        assert y.dtype == torch.bfloat16 and _replayed_node(y)
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, w[:, :23], b)
    with pytest.raises(TypeError, match="weight"):
        ops.linear(x, [[1.0] * 24] * 8, b)


def test_a_new_layout_is_recorded_of_its_own():
    """Strides and 16-byte alignment are part of the signature: an offset view of the same
    shape gets its own record, and computes what the Python Function does."""
    base, w, b = _leaves((5, 33), (32,), (32,))
    for x in (base[:, :32], base[:, 1:], base.detach()[:, 1:].clone().requires_grad_()):
        with _replay.disabled():
            ref, _ = _run(ops.layer_norm, [x, w, b])
        for _ in range(3):
            got, _ = _run(ops.layer_norm, [x, w, b])
            assert all(torch.equal(g, r) for g, r in zip(got, ref))


def test_no_grad_calls_replay_without_a_node():
    x, w, b = _leaves((4, 24), (24,), (24,))
    with torch.no_grad():
        outs = [ops.layer_norm(x, w, b) for _ in range(3)]
    assert all(o.grad_fn is None and not o.requires_grad for o in outs)
    assert torch.equal(outs[2], outs[0])


def test_a_saved_input_modified_in_place_fails_autograds_check():
    x, w, b = _leaves((4, 24), (24,), (24,))
    for _ in range(2):
        ops.layer_norm(x, w, b)
    y = ops.layer_norm(x, w, b)
    assert _replayed_node(y)
    with torch.no_grad():
        x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_bad_input_still_raises_the_named_error():
    x, w, _ = _leaves((4, 24), (24,), (24,))
    for _ in range(2):
        ops.rms_norm(x, w)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, w[:5])


class _Doubling(torch.autograd.Function):
    """y = 2x through an ATen multiply by a Python number: recordable."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, dy):
        return dy * 2


class _ValueDependent(torch.autograd.Function):
    """y = 2x or 3x by the sign of x's sum: Python control flow on a value, not recordable."""

    @staticmethod
    def forward(ctx, x):
        return x * 2 if x.sum() > 0 else x * 3

    @staticmethod
    def backward(ctx, dy):
        return dy


class _KeepsTensor(torch.autograd.Function):
    """Allocates only (recordable), but keeps a tensor on its ctx."""

    @staticmethod
    def forward(ctx, x):
        ctx.kept = x
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return torch.zeros_like(ctx.kept)


def _replayed(fn):
    return _replay.Replayed(fn, torch._C._FunctionBase.__dict__["apply"].__get__(None, fn))


@pytest.mark.parametrize("fn", [_ValueDependent, _KeepsTensor])
def test_what_cannot_be_recorded_runs_the_python_function(fn, caplog):
    op = _replayed(fn)
    x = torch.randn(3, 5, device=DEVICE, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="fusedtrain"):
        outs = [op((x,)) for _ in range(3)]
        if fn is _ValueDependent:  # the other branch, as the Python code takes it
            assert torch.equal(op((-x.abs(),)), -x.abs() * 3)
    assert "left to Python" in caplog.text
    assert all(not _replayed_node(o) and o.grad_fn is not None for o in outs)


def test_an_aten_op_with_a_python_number_replays():
    op = _replayed(_Doubling)
    x = torch.randn(3, 5, device=DEVICE, requires_grad=True)
    outs = [op((x,)) for _ in range(3)]
    assert _replayed_node(outs[2])
    assert torch.equal(outs[2], x * 2) and outs[2].dtype == x.dtype
    (g,) = torch.autograd.grad(outs[2].sum(), x)
    assert torch.equal(g, torch.full_like(x, 2.0))


class _Halves(torch.autograd.Function):
    """Returns x's two halves as views of one new buffer; saves the buffer (recordable)."""

    @staticmethod
    def forward(ctx, x, scale: float):
        out = torch.empty(2, *x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)
        ctx.save_for_backward(out)
        ctx.scale = scale
        return out[0], out[1]

    @staticmethod
    def backward(ctx, d0, d1):
        (out,) = ctx.saved_tensors
        dx = torch.empty(*out.shape[1:-1], 2 * out.shape[-1], dtype=out.dtype,
                         device=out.device)
        return dx, None


def test_views_of_a_recorded_buffer_come_back_as_views():
    """Allocations and views alone are recordable; the replayed outputs are views of one
    new buffer, as the Function's are, and the backward's record runs from the saved one."""
    op = _replayed(_Halves)
    x = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    for _ in range(3):
        a, b = op((x, 0.5))
        assert a.shape == b.shape == (3, 4)
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert b.data_ptr() - a.data_ptr() == 12 * a.element_size()
        (g,) = torch.autograd.grad((a.sum(), b.sum()), x)
        assert g.shape == x.shape
    assert _replayed_node(a)


def test_the_tiny_fused_gpt_trains_bit_for_bit_as_with_python_functions():
    from fusedtrain.model import GPT, KERNEL_FAMILIES, GPTConfig

    model = GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32,
                          kernels=dict.fromkeys(KERNEL_FAMILIES, True))).to(DEVICE)
    idx = torch.randint(0, 256, (2, 17), device=DEVICE)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model.loss(idx, idx)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    mode = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # the embedding's atomic adds
    try:
        with _replay.disabled():
            ref = step()
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(step(), ref))
    finally:
        torch.use_deterministic_algorithms(mode)


def test_a_replayed_node_keeps_autograds_contract():
    """retain_graph, saved-tensor hooks (each saved tensor packed), non-reentrant
    checkpointing and tensor hooks work through a replayed node as through the Function."""
    import torch.utils.checkpoint as checkpoint

    x, w, b = _leaves((4, 24), (24,), (24,))
    for _ in range(3):
        y = ops.layer_norm(x, w, b)
    assert _replayed_node(y)
    first = torch.autograd.grad(y.sum(), (x, w, b), retain_graph=True)
    assert all(torch.equal(a, c) for a, c in zip(first, torch.autograd.grad(y.sum(), (x, w, b))))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = ops.layer_norm(x, w, b)
    assert _replayed_node(y) and len(packed) == 4  # x, weight, bias, the statistics
    assert all(torch.equal(a, c) for a, c in zip(first, torch.autograd.grad(y.sum(), (x, w, b))))
    y = checkpoint.checkpoint(lambda t: ops.layer_norm(t, w, b), x, use_reentrant=False)
    assert all(torch.allclose(a, c) for a, c in zip(first, torch.autograd.grad(y.sum(), (x, w, b))))
    seen = []
    y = ops.layer_norm(x, w, b)
    y.register_hook(lambda g: seen.append(g.shape))
    y.sum().backward()
    assert seen == [y.shape]


class _Tagged(torch.Tensor):
    """A Tensor subclass: its calls go to the Python Function, never to a record."""


def test_a_tensor_subclass_runs_the_python_function():
    x, w, b = _leaves((4, 24), (24,), (24,))
    for _ in range(3):
        ops.layer_norm(x, w, b)
    tagged = x.detach().as_subclass(_Tagged).requires_grad_()
    for _ in range(3):
        y = ops.layer_norm(tagged, w, b)
        assert not _replayed_node(y)
    assert torch.equal(y.as_subclass(torch.Tensor), ops.layer_norm(x, w, b))
