"""ops.embedding (weight[idx]) and ops.gpt_embedding (token plus position rows, with the tied
head's gradient added into in its backward): backward an atomic scatter-add into fp32."""

import functools

import pytest
import torch

from fusedtrain import eager, ops
from fusedtrain.gradcheck import gradcheck

F64 = torch.float64


def test_gradcheck_with_repeated_ids():
    w = torch.randn(7, 5, dtype=F64, requires_grad=True)
    idx = torch.tensor([[0, 3, 3], [6, 3, 0]])  # ids repeated within and across rows
    assert gradcheck(lambda t: ops.embedding(idx, t), (w,))


@pytest.fixture(params=["sweep", "beyond the sweep"])
def embedding_path(request, monkeypatch):
    """The backward's paths at small sizes: the table sweep, and what runs past it."""
    from fusedtrain.kernels import embedding as K
    if request.param != "sweep":
        monkeypatch.setattr(K, "SWEEP_TOKENS", 0)
    return request.param


@pytest.mark.parametrize("deterministic", [False, True])
def test_matches_the_twin_at_odd_shapes(deterministic, embedding_path):
    """Column tails (C = 300 across two 256-wide blocks), token tails, hot rows."""
    w = torch.randn(97, 300)
    idx = torch.randint(0, 97, (3, 45))
    idx[0, :20] = 5
    leaf, ref_leaf = w.clone().requires_grad_(), w.clone().requires_grad_()
    mode = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        y = ops.embedding(idx, leaf)
        g = torch.randn_like(y)
        y.backward(g)
    finally:
        torch.use_deterministic_algorithms(mode)
    y_ref = eager.embedding(idx, ref_leaf)
    y_ref.backward(g)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-5)


def test_strided_ids_and_gradient():
    w = torch.randn(9, 4, requires_grad=True)
    idx = torch.tensor([1, 0, 7, 0, 7, 3])[::2]  # a 1-D view with stride 2
    g = torch.randn(4, 3).t()  # (3, 4), columns strided
    ops.embedding(idx, w).backward(g)
    ref = torch.zeros(9, 4).index_add_(0, idx, g)
    torch.testing.assert_close(w.grad, ref)


def test_bf16_weight_gets_a_bf16_gradient():
    w = torch.randn(11, 8, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.tensor([1, 1, 4])
    ops.embedding(idx, w).float().sum().backward()
    assert w.grad.dtype == torch.bfloat16
    assert w.grad[1].eq(2).all() and w.grad[4].eq(1).all() and w.grad[0].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [45, 150])  # fewer tokens than the 97 rows, and more
def test_16bit_gradient_within_twice_the_eager_error(dtype, tokens, embedding_path):
    """Hot rows (one id 20 times) and column tails, fp64 sums as the oracle: each id's
    fp32 sum rounded once, as PyTorch's sorted backward rounds it."""
    torch.manual_seed(0)
    w = torch.randn(97, 300)
    idx = torch.randint(0, 97, (tokens,))
    idx[:20] = 5
    g = torch.randn(tokens, 300)
    oracle = torch.zeros(97, 300, dtype=F64).index_add_(0, idx, g.double())
    errors = []
    for fn in (ops.embedding, eager.embedding):
        leaf = w.to(dtype).requires_grad_()
        fn(idx, leaf).backward(g.to(dtype))
        assert leaf.grad.dtype == dtype
        errors.append((leaf.grad.double() - oracle).abs().max().item())
    assert errors[0] <= 2 * errors[1] + 1e-6, errors


@pytest.mark.parametrize("kernel", ["embedding_bwd_sweep", "embedding_bwd_rows"])
def test_the_16bit_kernels_skip_ids_outside_the_table(kernel):
    from fusedtrain.kernels import embedding as K
    idx = torch.tensor([2, -1, 2, 9, 0, 5])
    dy = torch.arange(6 * 3, dtype=torch.float32).view(6, 3).to(torch.bfloat16)
    dw = getattr(K, kernel)(idx, dy, 7)
    keep = (idx >= 0) & (idx < 7)
    ref = torch.zeros(7, 3).index_add_(0, idx[keep], dy[keep].float())
    assert torch.equal(dw, ref.to(torch.bfloat16))


def test_the_sweep_is_an_fp32_sum_and_repeats_bit_for_bit():
    """Rows hit by ~60 tokens across three 128-id blocks: within fp32 summation's bound,
    (n - 1) 2^-24 sum |g|, of the fp64 sums, and the same bits on a second run."""
    from fusedtrain.kernels import embedding as K
    torch.manual_seed(0)
    idx = torch.randint(0, 5, (300,))
    dy = torch.randn(300, 40)
    dw = K.embedding_bwd_sweep(idx, dy, 5)
    ref = torch.zeros(5, 40, dtype=F64).index_add_(0, idx, dy.double())
    abs_sums = torch.zeros(5, 40, dtype=F64).index_add_(0, idx, dy.double().abs())
    count = torch.bincount(idx, minlength=5).double()[:, None]
    assert ((dw.double() - ref).abs() <= (count - 1) * 2.0 ** -24 * abs_sums).all()
    assert torch.equal(dw, K.embedding_bwd_sweep(idx, dy, 5))


def test_compile_fullgraph_matches_eager():
    w = torch.randn(10, 4, requires_grad=True)
    idx = torch.tensor([[1, 2, 1]])
    compiled = torch.compile(lambda t: ops.embedding(idx, t) * 2, fullgraph=True,
                             backend="aot_eager")
    (g,) = torch.autograd.grad(compiled(w).square().sum(), w)
    (ref,) = torch.autograd.grad((eager.embedding(idx, w) * 2).square().sum(), w)
    torch.testing.assert_close(g, ref)


def test_bad_inputs():
    w = torch.randn(5, 3, requires_grad=True)
    for _ in range(4):  # a recorded signature (replayed, unchecked) beside the bad ones
        ops.embedding(torch.tensor([1, 2]), w).sum().backward()
    with pytest.raises(IndexError, match="out of range"):
        ops.embedding(torch.tensor([1, 9]), w)
    with pytest.raises(TypeError, match="idx"):
        ops.embedding([1, 2], w)
    with pytest.raises(TypeError, match="idx"):
        ops.embedding(torch.zeros(2), w)
    with pytest.raises(ValueError, match="weight"):
        ops.embedding(torch.zeros(2, dtype=torch.long), torch.randn(5))
    with pytest.raises(TypeError, match="weight"):
        ops.embedding(torch.zeros(2, dtype=torch.long), w.long())


def _gpt_inputs(V=13, P=9, C=6, dtype=F64):
    torch.manual_seed(0)
    return (torch.randn(V, C, dtype=dtype, requires_grad=True),
            torch.randn(P, C, dtype=dtype, requires_grad=True))


def _embed_and_head(fn, idx, tw, pw):
    """The model's use: the stream and logits from the head tied to the token table."""
    x, head_weight = fn(idx, tw, pw)
    return x, x @ head_weight.t()


def test_gpt_embedding_gradcheck_with_and_without_the_head():
    tw, pw = _gpt_inputs()
    idx = torch.tensor([[0, 3, 3, 12], [6, 3, 0, 0]])  # repeats; 4 of 9 positions
    assert gradcheck(lambda a, b: _embed_and_head(ops.gpt_embedding, idx, a, b), (tw, pw))
    assert gradcheck(lambda a, b: ops.gpt_embedding(idx, a, b)[0], (tw, pw))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head,inplace", [(True, True), (True, False), (False, True)])
def test_gpt_embedding_matches_the_twin_at_odd_shapes(deterministic, head, inplace):
    """Column tails (C = 300), token tails, hot rows; the head's gradient added into in
    place, or into a copy (or no head)."""
    V, P, C = 97, 50, 300
    idx = torch.randint(0, V, (3, 45))
    idx[0, :20] = 5
    results = []
    fused = functools.partial(ops.gpt_embedding, inplace_backward=inplace)
    for fn in (fused, eager.gpt_embedding):
        torch.manual_seed(1)
        tw = torch.randn(V, C, requires_grad=True)
        pw = torch.randn(P, C, requires_grad=True)
        mode = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic)
        try:
            x, logits = _embed_and_head(fn, idx, tw, pw)
            loss = x.square().sum() + (logits.square().sum() / 100 if head else 0)
            loss.backward()
        finally:
            torch.use_deterministic_algorithms(mode)
        results.append((x, tw.grad, pw.grad))
    (x, gt, gp), (x_ref, gt_ref, gp_ref) = results
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)
    torch.testing.assert_close(gt, gt_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gp, gp_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("deterministic", [False, True])
def test_gpt_embedding_at_given_positions(deterministic):
    """Positions given (packed documents restarting at 0): the twin's values and gradients,
    in place into the head's gradient too, gradcheck, and NaN rows with no position
    gradient for a position outside the table."""
    tw, pw = _gpt_inputs()
    idx = torch.tensor([[0, 3, 3, 12, 5, 7], [6, 3, 0, 0, 1, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 6, 0, 1]])
    assert gradcheck(lambda a, b: ops.gpt_embedding(idx, a, b, positions=positions)[0],
                     (tw, pw))
    torch.use_deterministic_algorithms(deterministic)
    try:
        results = []
        for fn in (lambda *a: ops.gpt_embedding(*a, inplace_backward=True, positions=positions),
                   lambda *a: eager.gpt_embedding(*a, positions=positions)):
            tw.grad = pw.grad = None
            x, logits = _embed_and_head(fn, idx, tw, pw)
            (x.square().sum() + logits.sin().sum()).backward()
            results.append((x, tw.grad, pw.grad))
    finally:
        torch.use_deterministic_algorithms(False)
    for a, r in zip(*results):
        torch.testing.assert_close(a, r)
    outside = torch.tensor([[0, 9, -1, 8, 1, 1], [0, 1, 2, 3, 4, 5]])  # 9 and -1 of 9 rows
    x, _ = ops.gpt_embedding(idx, tw, pw, positions=outside)
    assert x[0, 1].isnan().all() and x[0, 2].isnan().all() and not x[0, 3].isnan().any()
    pw.grad = None
    x.nan_to_num(0.0).sum().backward()
    torch.testing.assert_close(pw.grad[:, 0], torch.tensor([2, 3, 1, 1, 1, 1, 0, 0, 1.0],
                                                           dtype=F64))
    with pytest.raises(ValueError, match="positions"):
        ops.gpt_embedding(idx, tw, pw, positions=positions[:, :3])
    with pytest.raises(TypeError, match="positions"):
        ops.gpt_embedding(idx, tw, pw, positions=positions.double())


def test_gpt_embedding_compile_fullgraph_matches_eager():
    idx = torch.tensor([[1, 2, 1], [0, 12, 5]])
    tw, pw = _gpt_inputs(dtype=torch.float32)

    def loss(fn):
        x, logits = _embed_and_head(fn, idx, tw, pw)
        return x.square().sum() + logits.square().sum()

    compiled = torch.compile(lambda: loss(ops.gpt_embedding), fullgraph=True,
                             backend="aot_eager")
    got = torch.autograd.grad(compiled(), (tw, pw))
    ref = torch.autograd.grad(loss(eager.gpt_embedding), (tw, pw))
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r)


def test_gpt_embedding_out_of_range_ids_give_nan_rows_and_no_gradient():
    tw, pw = _gpt_inputs(V=5, P=4, C=3)
    idx = torch.tensor([[0, 5, -1, 4]])  # 5 and -1 are outside [0, 5)
    x, head_weight = ops.gpt_embedding(idx, tw, pw)
    assert x[0, 1].isnan().all() and x[0, 2].isnan().all()
    torch.testing.assert_close(x[0, [0, 3]], tw[[0, 4]] + pw[[0, 3]])
    x.nan_to_num(0.0).sum().backward()
    used = torch.zeros_like(tw).index_fill_(0, torch.tensor([0, 4]), 1.0)
    torch.testing.assert_close(tw.grad, used)
    torch.testing.assert_close(pw.grad[:, 0], torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64))


def test_gpt_embedding_bad_inputs():
    tw, pw = _gpt_inputs()
    idx = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(TypeError, match="idx"):
        ops.gpt_embedding(idx.double(), tw, pw)
    with pytest.raises(ValueError, match="idx"):
        ops.gpt_embedding(idx[0], tw, pw)
    with pytest.raises(ValueError, match="sequence length 12"):
        ops.gpt_embedding(torch.zeros(2, 12, dtype=torch.long), tw, pw)
    with pytest.raises(ValueError, match="position_weight"):
        ops.gpt_embedding(idx, tw, pw[:, :4])
    with pytest.raises(TypeError, match="position_weight"):
        ops.gpt_embedding(idx, tw, pw.float())
    with pytest.raises(ValueError, match="token_weight"):
        ops.gpt_embedding(idx, tw[0], pw)


@pytest.mark.gpu
def test_gpu_backward_at_gpt2_shape_and_deterministic_mode():
    """16384 tokens with GPT-2-like repeats (the commonest id ~1500 times) into a 50304 x
    768 fp32 table: every entry of the atomic backward within the error bound of fp32
    summation in any order, (n - 1) 2^-24 sum |g| over its n rows (the fp64 sums as the
    reference; PyTorch's sorted backward meets the same bound), and deterministic mode's
    fallback gives the same bits twice."""
    torch.manual_seed(0)
    ranks = torch.arange(1, 50305, dtype=F64)
    idx = torch.multinomial(1.0 / ranks, 16384, replacement=True).view(16, 1024).cuda()
    w = (torch.randn(50304, 768, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(16, 1024, 768, device="cuda")

    def grad():
        w.grad = None
        ops.embedding(idx, w).backward(g)
        return w.grad.clone()

    flat = idx.view(-1)
    ref = torch.ops.aten.embedding_dense_backward(g.view(-1, 768).double(), flat, 50304, -1,
                                                  False)
    abs_sums = torch.ops.aten.embedding_dense_backward(g.view(-1, 768).double().abs(), flat,
                                                       50304, -1, False)
    count = torch.bincount(flat, minlength=50304).double()[:, None]
    bound = (count - 1).clamp(min=0) * 2.0 ** -24 * abs_sums + 1e-12
    for got in (grad(), torch.ops.aten.embedding_dense_backward(g.view(-1, 768), flat, 50304,
                                                                -1, False)):
        assert ((got.double() - ref).abs() <= bound).all()
    mode = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.equal(grad(), grad())
    finally:
        torch.use_deterministic_algorithms(mode)


@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "dtype"), [(2, torch.bfloat16), (2, torch.float32),
                                              (16, torch.bfloat16)])
def test_gpu_backward_at_gpt2_shape_within_twice_the_eager_error(batch, dtype):
    """The sweep (2048 tokens) and the 16-bit per-id rows (16384 tokens, fewer than the
    50304 rows) against PyTorch's backward, both measured from the fp64 sums. (The fp32
    atomic table past the sweep is held to fp32 summation's bound instead, above: on an
    H100 its error was 3.6x the sorted backward's at the commonest id's ~1500 rows.)"""
    torch.manual_seed(0)
    ranks = torch.arange(1, 50305, dtype=F64)
    idx = torch.multinomial(1.0 / ranks, batch * 1024, replacement=True).view(batch, 1024)
    idx = idx.cuda()
    g = torch.randn(batch, 1024, 768, device="cuda").to(dtype)
    ref = torch.ops.aten.embedding_dense_backward(g.view(-1, 768).double(), idx.view(-1),
                                                  50304, -1, False)
    errors = []
    for fn in (ops.embedding, eager.embedding):
        w = torch.zeros(50304, 768, device="cuda", dtype=dtype, requires_grad=True)
        fn(idx, w).backward(g)
        errors.append((w.grad.double() - ref).abs().max().item())
    assert errors[0] <= 2 * errors[1] + 1e-6, errors


@pytest.mark.gpu
def test_gpu_gpt_embedding_at_gpt2_shape():
    """The fused model's use at GPT-2's shape: the head's fp32 gradient and the token rows
    added in place, against fp64 sums: within fp32 summation's bound in any order (as
    above, one more term for the head's gradient), and the positions' gradient too."""
    torch.manual_seed(0)
    ranks = torch.arange(1, 50305, dtype=F64)
    idx = torch.multinomial(1.0 / ranks, 16384, replacement=True).view(16, 1024).cuda()
    tw = (torch.randn(50304, 768, device="cuda") * 0.02).requires_grad_()
    pw = (torch.randn(1024, 768, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(16, 1024, 768, device="cuda")
    head_grad = torch.randn(50304, 768, device="cuda")
    flat, g2 = idx.view(-1), g.view(-1, 768).double()
    ref = torch.ops.aten.embedding_dense_backward(g2, flat, 50304, -1, False) + head_grad.double()
    abs_sums = torch.ops.aten.embedding_dense_backward(g2.abs(), flat, 50304, -1, False)
    count = torch.bincount(flat, minlength=50304).double()[:, None]
    bound = count * 2.0 ** -24 * (abs_sums + head_grad.double().abs()) + 1e-12
    for inplace in (True, False):
        tw.grad = pw.grad = None
        given = head_grad.clone()
        x, head_weight = ops.gpt_embedding(idx, tw, pw, inplace_backward=inplace)
        torch.autograd.backward((x, head_weight), (g, given))
        torch.testing.assert_close(x, tw[idx] + pw[None], rtol=0, atol=0)
        assert ((tw.grad.double() - ref).abs() <= bound).all()
        assert torch.equal(given, head_grad) != inplace  # added into, or left alone
    pos_ref = g.double().sum(0)
    pos_bound = 16 * 2.0 ** -24 * g.double().abs().sum(0) + 1e-12
    assert ((pw.grad.double() - pos_ref).abs() <= pos_bound).all()
