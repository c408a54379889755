import pytest
import torch
from conftest import check_against_oracle, grads_of, max_err

from fusedtrain import eager, ops
from fusedtrain.gradcheck import gradcheck

F64 = torch.float64


def _inputs(B, T, C, dtype=F64, bias=True):
    x = torch.randn(B, T, C, dtype=dtype, requires_grad=True)
    w = (torch.randn(3 * C, C, dtype=dtype) / C ** 0.5).requires_grad_()
    b = torch.randn(3 * C, dtype=dtype, requires_grad=True) if bias else None
    return x, w, b


def test_layout_matches_eager():
    x, w, b = _inputs(2, 7, 12)
    for fused, ref in zip(ops.qkv_projection(x, w, b, 3), eager.qkv_projection(x, w, b, 3)):
        assert fused.shape == (2, 3, 7, 4)
        torch.testing.assert_close(fused, ref)


def test_packed_eager_form_matches_three_projections():
    x, w, b = _inputs(2, 7, 12)
    for a, r in zip(eager.qkv_projection_packed(x, w, b, 3), eager.qkv_projection(x, w, b, 3)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck(bias):
    inputs = _inputs(2, 5, 12, bias=bias)
    assert gradcheck(lambda *a: ops.qkv_projection(*a, 3), inputs, fast_mode=True)


def test_strided_x():
    base = torch.randn(2, 9, 12, dtype=F64)
    x = base[:, 1:8]  # (B, T, C) with a batch stride that is not T*C
    w, b = torch.randn(36, 12, dtype=F64), torch.randn(36, dtype=F64)
    for a, r in zip(ops.qkv_projection(x, w, b, 4), eager.qkv_projection(x, w, b, 4)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("B,T,C,H,block_n", [(2, 32, 48, 3, 32), (3, 48, 64, 4, 32),
                                             (3, 48, 128, 8, 64), (2, 20, 48, 3, 32)])
def test_tma_kernels_match_eager(B, T, C, H, block_n, monkeypatch):
    """The TMA forward and dx kernels, with tiles small enough that programs walk several
    tiles and every row tile of dx reads several heads of dq, dk and dv. The forward
    stores through pointers where a W tile runs past its q/k/v segment (C % block_n != 0,
    the first case) or a row tile past a sequence (T % 16 != 0, the last), else each
    head's block through TMA: one head per half tile (D = block_n / 2) or two (the third).
    Five persistent programs (the interpreter's default is one), a count that divides no
    segment's tiles, so the per-segment loops start each program at a different tile."""
    from fusedtrain.kernels import qkv as K
    from fusedtrain.kernels._tma import TmaConfig

    monkeypatch.setattr(TmaConfig, "programs", lambda self, work, device: min(work, 5))

    small = TmaConfig(block_m=16, block_n=block_n, block_k=16, num_warps=4, num_stages=1)
    x, w, b = (t.detach() for t in _inputs(B, T, C))
    for got, want in zip(K.qkv_fwd(x, w, b, H, config=small), eager.qkv_projection(x, w, b, H)):
        torch.testing.assert_close(got, want)
    grads = [torch.randn(B, H, T, C // H, dtype=F64) for _ in range(3)]
    packed = torch.cat([g.transpose(1, 2).reshape(B, T, C) for g in grads], -1)
    torch.testing.assert_close(K.qkv_dx(*grads, w, config=small), packed @ w)



@pytest.mark.parametrize("B,T,C,H", [(2, 32, 48, 3), (1, 48, 64, 4), (3, 32, 128, 8)])
def test_tma_weight_gradient_matches_eager(B, T, C, H, monkeypatch):
    """qkv_dw through TMA, reading dq, dk, dv in place, a head's rows per tile (D = 16 =
    block_m), sequences of two or three K steps; five persistent programs over the three
    segments' tiles."""
    from fusedtrain.kernels import qkv as K
    from fusedtrain.kernels._tma import TmaConfig

    monkeypatch.setattr(TmaConfig, "programs", lambda self, work, device: min(work, 5))
    monkeypatch.setattr(K, "_qkv_dw_kernel", None)  # the pointer kernel must not be taken
    small = TmaConfig(block_m=C // H, block_n=32, block_k=16, num_warps=4, num_stages=1)
    x = torch.randn(B, T, C, dtype=F64)
    grads = [torch.randn(B, H, T, C // H, dtype=F64) for _ in range(3)]
    packed = torch.cat([g.transpose(1, 2).reshape(B * T, C) for g in grads], -1)
    torch.testing.assert_close(K.qkv_dw(*grads, x, config=small),
                               packed.T @ x.reshape(B * T, C))

def _grouped_inputs(B, T, H, HK, D, bias=True):
    C = H * D
    rows = (H + 2 * HK) * D
    x = torch.randn(B, T, C, dtype=F64)
    w = torch.randn(rows, C, dtype=F64) / C ** 0.5
    return x, w, torch.randn(rows, dtype=F64) if bias else None


def _positions(B, T):
    """Positions restarting mid-row (packed documents), one far past T."""
    p = torch.arange(T).repeat(B, 1)
    p[:, T // 2:] -= T // 2
    p[-1, -1] = 5000
    return p


@pytest.mark.parametrize("B,T,H,HK,D,head_store", [
    (2, 32, 4, 2, 16, True), (1, 48, 8, 4, 8, True), (2, 32, 4, 1, 16, False),
    (2, 20, 6, 2, 8, False)])
@pytest.mark.parametrize("rope", [None, "t", "positions"])
def test_tma_forward_grouped_and_rotated_matches_eager(B, T, H, HK, D, head_store, rope,
                                                       monkeypatch):
    """The TMA forward with fewer key/value heads (32-wide tiles): segments of different
    widths, dealt to five persistent programs; q and k rotated in the epilogue where a
    half tile is one head (D = 16) or two (D = 8). Where k's 16 features are half a tile
    (the third case) or a row tile crosses sequences (the last) it stores through
    pointers, and with rotation the pointer kernel runs instead."""
    from fusedtrain.kernels import qkv as K
    from fusedtrain.kernels._tma import TmaConfig

    monkeypatch.setattr(TmaConfig, "programs", lambda self, work, device: min(work, 5))
    if head_store or rope is None:
        monkeypatch.setattr(K, "_qkv_fwd_kernel", None)  # the pointer kernel must not run
    small = TmaConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=1)
    x, w, b = _grouped_inputs(B, T, H, HK, D)
    base = None if rope is None else 500.0
    pos = _positions(B, T) if rope == "positions" else None
    got = K.qkv_fwd(x, w, b, H, HK, base, pos, config=small)
    for g, r in zip(got, eager.qkv_projection(x, w, b, H, HK, base, pos)):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("rope", [None, "t", "positions"])
@pytest.mark.parametrize("bias", [True, False])
def test_pointer_forward_grouped_and_rotated_matches_eager(rope, bias, monkeypatch):
    """The pointer forward (the interpreter's one 128-wide tile): q's 96 rotation pairs
    over two column tiles, each holding whole and cut heads' pairs, k's and v's tiles
    half masked, two row tiles over three sequences."""
    from fusedtrain.kernels import qkv as K

    monkeypatch.setattr(K, "tma_ok", lambda *a: False)
    B, T, H, HK, D = 3, 47, 12, 4, 16
    x, w, b = _grouped_inputs(B, T, H, HK, D, bias)
    base = None if rope is None else 10000.0
    pos = _positions(B, T) if rope == "positions" else None
    got = K.qkv_fwd(x, w, b, H, HK, base, pos)
    for g, r in zip(got, eager.qkv_projection(x, w, b, H, HK, base, pos)):
        torch.testing.assert_close(g, r)


def test_backward_reads_grouped_gradients_packed_in_one_buffer():
    """dq, dk, dv slices of one (B, T, H + 2 HK, D) buffer are read as one matrix; as three
    tensors they are gathered; both give the eager gradients."""
    from fusedtrain.ops.qkv import _packed

    B, T, H, HK, D = 2, 5, 4, 2, 3
    buf = torch.randn(B, T, H + 2 * HK, D, dtype=F64)
    heads = buf.transpose(1, 2)
    dq, dk, dv = heads[:, :H], heads[:, H:H + HK], heads[:, H + HK:]
    g = _packed(dq, dk, dv)
    assert g is not None and g.data_ptr() == buf.data_ptr()
    assert _packed(dq, dv, dk) is None
    x, w, b = (t.requires_grad_() for t in _grouped_inputs(B, T, H, HK, D))
    for grads in ((dq, dk, dv), (dq.clone(), dk.clone(), dv)):
        fused = torch.autograd.grad(ops.qkv_projection(x, w, b, H, HK), (x, w, b), grads)
        ref = torch.autograd.grad(eager.qkv_projection(x, w, b, H, HK), (x, w, b), grads)
        for a, r in zip(fused, ref):
            torch.testing.assert_close(a, r)


# Both ops that take x through the QKV projection: the projection alone, and the
# projection with the attention (qkv_attention, whose tests follow further down).
PROJECTING = ["qkv_projection", "qkv_attention"]


@pytest.mark.parametrize("op", PROJECTING)
def test_fp32_accuracy(op):
    x, w, b = (t.detach().float().requires_grad_() for t in _inputs(2, 203, 96))
    check_against_oracle(lambda *a: getattr(ops, op)(*a, 4),
                         lambda *a: getattr(eager, op)(*a, 4), (x, w, b), 1e-5, 1e-4, op)


@pytest.mark.parametrize("op", PROJECTING)
def test_compile_fullgraph_matches_eager(op):
    x, w, b = (t.detach().float().requires_grad_() for t in _inputs(2, 9, 16))
    compiled = torch.compile(lambda *a: getattr(ops, op)(*a, 2), fullgraph=True,
                             backend="aot_eager")
    outs, grads, g = grads_of(compiled, (x, w, b))
    refs, ref_g, _ = grads_of(lambda *a: getattr(eager, op)(*a, 2), (x, w, b), g)
    for a, r in zip(outs + tuple(grads), refs + tuple(ref_g)):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", PROJECTING)
def test_bad_inputs(op):
    fn = getattr(ops, op)
    x, w, b = _inputs(2, 5, 12)
    with pytest.raises(ValueError, match="n_heads"):
        fn(x, w, b, 5)
    with pytest.raises(ValueError, match="weight"):
        fn(x, w[:30], b, 3)
    with pytest.raises(ValueError, match="bias"):
        fn(x, w, b[:30], 3)
    with pytest.raises(TypeError, match="weight"):
        fn(x, w.float(), b, 3)
    with pytest.raises(ValueError, match="x"):
        fn(x[0], w, b, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,H", [(16, 1024, 768, 12), (8, 2048, 2048, 16)])
def test_gpu_bf16_accuracy(B, T, C, H):
    x, w, b = (t.detach().cuda().bfloat16().requires_grad_()
               for t in _inputs(B, T, C, dtype=torch.float32))
    check_against_oracle(lambda *a: ops.qkv_projection(*a, H),
                         lambda *a: eager.qkv_projection(*a, H), (x, w, b), 1e-2, 1e-2, "qkv")


def _packed_grads(B, T, H, D):
    """dq, dk, dv as the fused attention's backward lays them out: slices of one
    (B, T, 3, H, D) buffer."""
    buf = torch.randn(B, T, 3, H, D, dtype=torch.float64)
    return buf, buf.permute(2, 0, 3, 1, 4).unbind(0)


def test_backward_reads_packed_gradients_as_one_matrix():
    from fusedtrain.ops.qkv import _packed

    B, T, C, H = 2, 5, 12, 3
    buf, (dq, dk, dv) = _packed_grads(B, T, H, C // H)
    g = _packed(dq, dk, dv)
    assert g is not None and g.data_ptr() == buf.data_ptr() and g.shape == (B * T, 3 * C)
    torch.testing.assert_close(g, buf.reshape(B * T, 3 * C), rtol=0, atol=0)
    assert _packed(dq, dk, dv.clone()) is None and _packed(dk, dq, dv) is None
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3 * C, C, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3 * C, dtype=torch.float64, requires_grad=True)
    for grads in ((dq, dk, dv), (dq, dk, dv.clone())):  # packed, then the strided kernels
        fused = torch.autograd.grad(ops.qkv_projection(x, w, b, H), (x, w, b), grads)
        ref = torch.autograd.grad(eager.qkv_projection(x, w, b, H), (x, w, b), grads)
        for a, r in zip(fused, ref):
            torch.testing.assert_close(a, r)


def test_adjacent_storages_are_not_one_buffer():
    """Views of three different storages can have the packed strides and addresses C
    elements apart; a matrix over them would reach past the first one's storage."""
    from fusedtrain.ops.qkv import _packed

    B, T, C, H = 2, 5, 12, 3
    n = B * T * 3 * C
    memory = bytearray(torch.randn(n, dtype=torch.float64).numpy().tobytes())
    dq, dk, dv = (torch.frombuffer(memory, dtype=torch.float64, count=n - C * i, offset=8 * C * i)
                  .as_strided((B, H, T, C // H), (T * 3 * C, C // H, 3 * C, 1))
                  for i in range(3))
    assert dk.data_ptr() - dq.data_ptr() == 8 * C
    assert _packed(dq, dk, dv) is None


def test_flop_counter_counts_forward_and_both_backward_gemms():
    """FlopCounterMode sees the projection's three GEMMs (forward, dx, dW) once each,
    whichever path the backward takes (packed cuBLAS or strided kernels)."""
    from torch.utils.flop_counter import FlopCounterMode

    B, T, C, H = 2, 5, 12, 3
    _, packed = _packed_grads(B, T, H, C // H)
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3 * C, C, dtype=torch.float64, requires_grad=True)
    for grads in (packed, tuple(g.contiguous() for g in packed)):
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad(ops.qkv_projection(x, w, None, H), (x, w), grads)
        assert counter.get_total_flops() == 3 * 2 * B * T * C * 3 * C


# ops.qkv_attention: the projection and flash attention as one op, whose attention backward
# sums the projection's bias gradient.


@pytest.mark.parametrize("B,T,C,H,causal", [(2, 70, 16, 2, True), (1, 130, 12, 3, False)])
def test_qkv_attention_matches_the_two_ops_composed(B, T, C, H, causal):
    """T past one and two 64-row grains of the bias partial sums, with a tail; the key
    bias's gradient is exactly zero (the softmax cancels it), the eager one only nearly."""
    inputs = _inputs(B, T, C)
    outs, grads, g = grads_of(lambda *a: ops.qkv_attention(*a, H, causal), inputs)
    refs, ref_grads, _ = grads_of(lambda *a: eager.qkv_attention(*a, H, causal), inputs, g)
    assert outs[0].shape == (B, H, T, C // H)
    for got, want in zip(outs + tuple(grads), refs + tuple(ref_grads)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert torch.equal(grads[2][C:2 * C], torch.zeros(C, dtype=F64))


@pytest.mark.parametrize("bias,causal", [(True, True), (False, False)])
def test_qkv_attention_gradcheck(bias, causal):
    inputs = _inputs(2, 5, 12, bias=bias)
    assert gradcheck(lambda *a: ops.qkv_attention(*a, 3, causal), inputs, fast_mode=True)


@pytest.mark.parametrize("kw", [dict(n_kv_heads=1), dict(rope_base=100.0),
                                dict(n_kv_heads=2, rope_base=100.0, positions="packed")])
def test_qkv_attention_grouped_and_rotated_matches_the_twin(kw):
    """Grouped heads and rotation through the one op (its backward: the attention's grouped
    gradients, then the projection's own bias sums, the bias having met the rotation), with
    a bias and a window: equal to the eager twin."""
    x, w, b, fn, twin = _grouped_attention(kw)
    (o,), grads, g = grads_of(fn, (x, w, b))
    (ref,), ref_grads, _ = grads_of(twin, (x, w, b), g)
    for a, r in zip((o, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a, r)


def test_qkv_attention_grouped_and_rotated_gradcheck():
    x, w, b, fn, _ = _grouped_attention(dict(n_kv_heads=2, rope_base=100.0, positions="packed"))
    assert gradcheck(fn, (x, w, b), fast_mode=True)


def _grouped_attention(kw):
    """(x, w, b, op, eager twin) at B=2, T=6, 4 query heads of D=2, window (3, 0)."""
    B, T, H, D = 2, 6, 4, 2
    HK = kw.get("n_kv_heads", H)
    if kw.get("positions") == "packed":
        kw = {**kw, "positions": torch.tensor([[0, 1, 2, 0, 1, 2], [5, 6, 0, 1, 2, 3]])}
    x, w, b = (t.requires_grad_() for t in _grouped_inputs(B, T, H, HK, D))
    return (x, w, b, lambda *a: ops.qkv_attention(*a, H, window=(3, 0), **kw),
            lambda *a: eager.qkv_attention(*a, H, window=(3, 0), **kw))


def test_qkv_attention_bad_softmax_scale_and_head_dim():
    x, w, b = _inputs(2, 5, 12)
    with pytest.raises(ValueError, match="softmax_scale"):
        ops.qkv_attention(x, w, b, 3, softmax_scale=0.0)
    wide = torch.randn(2, 3, 300, dtype=F64)
    with pytest.raises(ValueError, match="head dim"):
        ops.qkv_attention(wide, torch.randn(900, 300, dtype=F64), None, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,H", [(16, 1024, 768, 12), (8, 2048, 2048, 16)])
def test_qkv_attention_gpu_bf16_accuracy(B, T, C, H):
    """docs/design.md's rule (fused error against fp64 <= 2 x the eager twin's + atol) on each
    output and gradient's largest error over three draws. The weight gradient sums B*T
    tokens' products into values of up to ~190 at gpt2's shape, whose largest error is a
    few bf16 ulps (one ulp = 1 there) and moves between draws by as much as the rule
    allows: eager's went from 1.89 to 3.18 over ten draws, the fused ops' (this op's are
    theirs) from 2.4 to 3.8 (docs/journal.md). One draw's maximum
    failed the rule once (3.83 against 1.89); the maximum over three draws does not depend
    on one lucky draw of the eager op."""
    worst = {"fused": [0.0] * 4, "eager": [0.0] * 4}
    for _ in range(3):
        x, w, b = (t.detach().cuda() for t in _inputs(B, T, C, dtype=torch.float32))
        g = (torch.randn(B, H, T, C // H, dtype=torch.float64),)  # a fresh upstream gradient
        ref_in = [t.double().requires_grad_() for t in (x, w, b)]
        refs, ref_g, _ = grads_of(lambda *a: eager.qkv_attention(*a, H), ref_in, g)
        low = [t.bfloat16().requires_grad_() for t in (x, w, b)]
        for name, fn in (("fused", ops.qkv_attention), ("eager", eager.qkv_attention)):
            outs, grads, _ = grads_of(lambda *a, fn=fn: fn(*a, H), low, g)
            for i, (got, want) in enumerate(zip(outs + tuple(grads), refs + tuple(ref_g))):
                worst[name][i] = max(worst[name][i], max_err(got, want))
    for i, what in enumerate(["output", "grad of x", "grad of weight", "grad of bias"]):
        f, e = worst["fused"][i], worst["eager"][i]
        assert f <= 2 * e + 1e-2, f"{what}: fused error {f:.3g} > 2 x eager error {e:.3g} + 0.01"


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,H,HK,bias,rope,positions", [
    (2, 256, 768, 12, 12, True, False, False), (3, 128, 256, 2, 2, False, False, False),
    (1, 384, 384, 6, 6, True, False, False), (2, 256, 768, 12, 4, False, False, False),
    (2, 256, 768, 12, 12, True, True, False), (2, 256, 768, 12, 4, False, True, True),
    (1, 256, 1024, 8, 2, True, True, False), (2, 128, 512, 4, 1, False, True, True)])
def test_gpu_warp_specialised_forward_matches_the_triton_kernel(B, T, C, H, HK, bias, rope,
                                                                 positions):
    """The Gluon forward (sm_90) against the Triton TMA kernel (forced by a config) on the
    same bf16 data: two heads a tile (D = 64) and one (D = 128), several tiles per
    consumer, tiles of all three segments in one sequence, grouped and single key/value
    heads, q and k rotated at default and given positions; the same fp32 accumulation
    over the same K steps and the same rotation formula, so equal to a bf16 rounding."""
    from fusedtrain.kernels import qkv as Kn
    from fusedtrain.kernels import qkv_gluon
    from fusedtrain.kernels._tma import gluon_ok, tma_config

    D = C // H
    x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn((H + 2 * HK) * D, C, device="cuda") / C ** 0.5).bfloat16()
    b = torch.randn(w.shape[0], device="cuda", dtype=torch.bfloat16) if bias else None
    pos = torch.randint(0, 4 * T, (B, T), device="cuda") if positions else None
    if not gluon_ok(x, w):
        pytest.skip("the warp-specialised kernels need an sm_90 GPU and triton 3.6")
    assert qkv_gluon.fits(T, C, HK * D, D)
    base = 10000.0 if rope else None
    got = Kn.qkv_fwd(x, w, b, H, HK, base, pos)
    ref = Kn.qkv_fwd(x, w, b, H, HK, base, pos, config=tma_config(C))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,H", [(2, 512, 1024, 8), (8, 2048, 2048, 16)])
def test_gpu_tma_weight_gradient_matches_fp64(B, T, C, H, monkeypatch):
    """qkv_dw's TMA kernel on the GPU from bf16 head-split gradients (D = 128, a head a
    tile), against the fp64 product: the tensor cores' fp32 accumulation over 1024-16384
    tokens, far inside the bf16 rounding (2**-9 relative) of eager's gradient."""
    from fusedtrain.kernels import qkv as K

    monkeypatch.setattr(K, "_qkv_dw_kernel", None)  # the pointer kernel must not be taken
    x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
    grads = [torch.randn(B, H, T, C // H, device="cuda", dtype=torch.bfloat16)
             for _ in range(3)]
    packed = torch.cat([g.transpose(1, 2).reshape(B * T, C) for g in grads], -1)
    want = packed.double().T @ x.double().reshape(B * T, C)
    got = K.qkv_dw(*grads, x, torch.float32)
    assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()


# ops.qkv_attention_varlen: the projection and the packed-documents attention as one op,
# the attention's gradients written side by side into the projection's output gradient.

_CU = [0, 4, 4, 5, 11, 12]  # documents of 4, 0, 1, 6 and 1 tokens over 2 rows of 6


@pytest.mark.parametrize("kw", [{}, dict(n_kv_heads=1, rope_base=100.0),
                                dict(n_kv_heads=2, rope_base=100.0, positions="given",
                                     window=(2, 0))])
def test_qkv_attention_varlen_matches_the_twin(kw):
    """Empty and one-token documents, one crossing a row, grouped heads, rotation at each
    document's own positions (the default) and at given ones, a window: equal to the twin
    (a linear, views, the rotation and the per-document attention)."""
    x, w, b, fn, twin = _packed_attention(kw)
    (o,), grads, g = grads_of(fn, (x, w, b))
    (ref,), ref_grads, _ = grads_of(twin, (x, w, b), g)
    assert o.shape == (12, 4, 2)
    for a, r in zip((o, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)


def test_qkv_attention_varlen_gradcheck():
    x, w, b, fn, _ = _packed_attention(dict(n_kv_heads=2, rope_base=100.0, window=(2, 0)))
    assert gradcheck(fn, (x, w, b), fast_mode=True)


@pytest.mark.parametrize("kw", [dict(n_kv_heads=2), dict(rope_base=100.0)])
def test_qkv_attention_varlen_backward_concatenates_nothing(kw):
    """The three gradients are written into one buffer, dq and dk rotated back in place:
    no aten.cat in the backward (ops.linear, views and flash_attention_varlen composed
    make one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Cats(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Cats.count += func is torch.ops.aten.cat.default
            return func(*args, **(kwargs or {}))

    x, w, b, fn, _ = _packed_attention(kw)
    o = fn(x, w, b)
    with Cats():
        o.sum().backward()
    assert Cats.count == 0


def test_qkv_attention_varlen_bad_inputs():
    x, w, b, _, _ = _packed_attention({})
    cu = torch.tensor(_CU, dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must start"):  # ends short of 12
        ops.qkv_attention_varlen(x, w, b, 4, cu[:-1], 6)
    with pytest.raises(ValueError, match="cu_seqlens must start"):  # a document of 6 > 5
        ops.qkv_attention_varlen(x, w, b, 4, cu, 5)
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        ops.qkv_attention_varlen(x, w, b, 4, cu.long(), 6)
    with pytest.raises(ValueError, match="max_seqlen must"):
        ops.qkv_attention_varlen(x, w, b, 4, cu, -1)
    with pytest.raises(ValueError, match="positions"):
        ops.qkv_attention_varlen(x, w, b, 4, cu, 6, positions=torch.zeros(2, 6).long())
    with pytest.raises(ValueError, match="weight"):
        ops.qkv_attention_varlen(x, w, b, 4, cu, 6, n_kv_heads=2)
    with pytest.raises(ValueError, match="x"):
        ops.qkv_attention_varlen(x[0], w, b, 4, cu, 6)


def _packed_attention(kw):
    """(x, w, b, op, eager twin) at B=2, T=6, 4 query heads of D=2 over _CU's documents."""
    B, T, H, D = 2, 6, 4, 2
    HK = kw.get("n_kv_heads", H)
    if kw.get("positions") == "given":
        kw = {**kw, "positions": torch.tensor([[3, 1, 2, 0, 1, 2], [5, 6, 0, 1, 2, 3]])}
    cu = torch.tensor(_CU, dtype=torch.int32)
    x, w, b = (t.requires_grad_() for t in _grouped_inputs(B, T, H, HK, D))
    return (x, w, b, lambda *a: ops.qkv_attention_varlen(*a, H, cu, 6, **kw),
            lambda *a: eager.qkv_attention_varlen(*a, H, cu, 6, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,H,HK,rope", [(16, 1024, 768, 12, 12, False),
                                             (4, 2048, 2048, 16, 4, True)])
def test_gpu_qkv_attention_varlen_bf16_within_eager_error(B, T, C, H, HK, rope):
    """docs/design.md's rule against the fp64 twin at gpt2's packed training shape and a
    grouped, rotated Llama-like one: 8 B random document starts plus every row's start
    (documents.documents, as the model's batches)."""
    from fusedtrain.documents import documents

    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, B * T, (8 * B,), generator=gen).int().cuda()
    cu = documents(starts, B, T, eager=False).cu_seqlens
    D = C // H
    x = torch.randn(B, T, C, device="cuda")
    w = torch.randn((H + 2 * HK) * D, C, device="cuda") / C ** 0.5
    b = torch.randn(w.shape[0], device="cuda")
    kw = dict(n_kv_heads=HK, rope_base=10000.0 if rope else None)
    inputs = [t.bfloat16().requires_grad_() for t in (x, w, b)]
    check_against_oracle(lambda *a: ops.qkv_attention_varlen(*a, H, cu, T, **kw),
                         lambda *a: eager.qkv_attention_varlen(*a, H, cu, T, **kw), inputs,
                         1e-2)
