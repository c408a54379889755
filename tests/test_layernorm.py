import pytest
import torch
from conftest import check_against_oracle, grads_of

from fusedtrain import eager, ops
from fusedtrain.gradcheck import gradcheck
from fusedtrain.ops import _replay

F64 = torch.float64


def _inputs(shape, dtype=F64, mean=0.0):
    C = shape[-1]
    x = (mean + torch.randn(*shape, dtype=dtype)).requires_grad_()
    w = (1 + 0.1 * torch.randn(C, dtype=dtype)).requires_grad_()
    b = (0.1 * torch.randn(C, dtype=dtype)).requires_grad_()
    return x, w, b


def test_gradcheck_layer_norm():
    assert gradcheck(ops.layer_norm, _inputs((3, 5, 13)), fast_mode=True)


def test_gradcheck_layer_norm_without_affine():
    x, _, _ = _inputs((7, 13))
    assert gradcheck(lambda x: ops.layer_norm(x, None, None), (x,), fast_mode=True)


def test_gradcheck_add_layer_norm():
    x, w, b = _inputs((3, 5, 13))
    r = torch.randn(3, 5, 13, dtype=F64, requires_grad=True)
    assert gradcheck(ops.add_layer_norm, (x, r, w, b), fast_mode=True)


def test_gradcheck_add_layer_norm_with_x_bias():
    """x_bias's gradient is the third row of the backward's partial sums."""
    x, w, b = _inputs((3, 5, 13))
    r, xb = (torch.randn(*s, dtype=F64, requires_grad=True) for s in ((3, 5, 13), (13,)))
    assert gradcheck(lambda x, r, w, b, xb: ops.add_layer_norm(x, r, w, b, 1e-5, xb),
                     (x, r, w, b, xb), fast_mode=True)


def test_gradcheck_layer_norm_stream():
    """x passes through as the second output; its gradient there is added by the
    LayerNorm's backward pass."""
    x, w, b = _inputs((3, 5, 13))
    y, s = ops.layer_norm_stream(x, w, b)
    assert torch.equal(s, x) and torch.equal(y, ops.layer_norm(x, w, b))
    assert gradcheck(ops.layer_norm_stream, (x, w, b), fast_mode=True)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gradcheck_layer_norm_gelu(approximate):
    assert gradcheck(lambda *a: ops.layer_norm_gelu(*a, approximate=approximate),
                     _inputs((3, 5, 13)), fast_mode=True)


@pytest.mark.parametrize("C", [1023, 1500, 4095, 768, 1280])  # the last two: chunked rows
@pytest.mark.parametrize("op", ["layer_norm", "layer_norm_stream", "add_layer_norm",
                                "layer_norm_gelu"])
def test_fp32_accuracy_large_mean(C, op):
    inputs = list(_inputs((37, C), dtype=torch.float32, mean=1e3))
    if op == "add_layer_norm":
        inputs.insert(1, torch.randn(37, C).requires_grad_())
    check_against_oracle(getattr(ops, op), getattr(eager, op), inputs, 1e-5, 1e-3, op)


def test_rows_are_read_in_place_where_their_strides_allow():
    """A (..., C) tensor is read as (M, C) rows of one stride where its leading dimensions
    collapse into one; otherwise its rows are copied first."""
    from fusedtrain.kernels.layernorm import _row_stride

    def stride_of(t):
        return _row_stride(tuple(t.shape), t.stride())

    x = torch.empty(4, 6, 10)
    assert stride_of(x) == 10
    assert stride_of(x[:, :, :8]) == 10  # a slice of wider rows
    assert stride_of(x[:, ::2]) == 20  # every other row: still one stride
    assert stride_of(x[:1, :1]) == 10  # one row
    assert stride_of(x.transpose(0, 1)) is None  # (6, 4) rows of two strides
    assert stride_of(x[..., ::2]) is None  # a column stride of 2
    assert stride_of(torch.empty(10).expand(4, 6, 10)) == 0  # one row broadcast
    assert stride_of(torch.empty(6, 1, 10).expand(6, 4, 10)) is None  # strides 0 and 10


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_outputs_take_an_in_place_add(op):
    """The normalised (B, T, C) output is a tensor of its own, not a view made inside the
    Function: it takes an in-place add as the twin's does, with the same gradients. (The
    residual stream output s is saved for backward, in both.)"""
    x, w, b = _inputs((2, 3, 8))
    args = [x, w, b] if op == "layer_norm" else [x, torch.randn_like(x), w, b]
    grads = []
    for fn in (getattr(ops, op), getattr(eager, op)):
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        outs[0].add_(1.0)
        loss = sum((o * o).sum() for o in outs)
        grads.append(torch.autograd.grad(loss, [x, w, b]))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_strided_inputs_and_gradients_match_eager(op):
    """Inputs and output gradients of several layouts (a slice of wider rows, every other
    row, a transpose, a broadcast residual) give the eager twin's values and gradients."""
    C = 24
    wide = torch.randn(3, 8, C + 8, dtype=F64)
    layouts = [wide[..., :C], wide[:, ::2, :C], wide[..., :C].transpose(0, 1)]
    w = (1 + 0.1 * torch.randn(C, dtype=F64)).requires_grad_()
    b = (0.1 * torch.randn(C, dtype=F64)).requires_grad_()
    for x in layouts:
        x = x.detach().requires_grad_()
        args = [x, w, b]
        if op == "add_layer_norm":
            args.insert(1, torch.randn(C, dtype=F64).expand(x.shape).requires_grad_())
        outs = [getattr(ops, op)(*args), getattr(eager, op)(*args)]
        outs = [o if isinstance(o, tuple) else (o,) for o in outs]
        dys = [torch.randn(o.shape[::-1], dtype=F64).permute(*reversed(range(o.dim())))
               for o in outs[0]]  # gradients with transposed strides
        for got, want in zip(*outs):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        leaves = [a for a in args if a.requires_grad]
        for got, want in zip(torch.autograd.grad(outs[0], leaves, dys),
                             torch.autograd.grad(outs[1], leaves, dys)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("C", [1023, 768])
def test_fp32_add_layer_norm_with_x_bias(C):
    x, w, b = _inputs((37, C), dtype=torch.float32, mean=10.0)
    r, xb = torch.randn(37, C).requires_grad_(), torch.randn(C).requires_grad_()
    check_against_oracle(lambda *a: ops.add_layer_norm(*a[:4], 1e-5, a[4]),
                         lambda *a: eager.add_layer_norm(*a[:4], 1e-5, a[4]),
                         [x, r, w, b, xb], 1e-5, 1e-3, "add_layer_norm x_bias")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("C", [768, 1023])
def test_fp16_layer_norm_gelu_within_eager_error(C, approximate):
    """16-bit data takes the cheaper GELU forms (for "none", FAST_ERF, which the interpreter
    runs too) and, at C = 768, the chunked forward: output and gradients still within
    twice eager fp16's error against fp64."""
    inputs = [t.detach().half().requires_grad_() for t in _inputs((53, C))]
    check_against_oracle(lambda *a: ops.layer_norm_gelu(*a, approximate=approximate),
                         lambda *a: eager.layer_norm_gelu(*a, approximate=approximate),
                         inputs, 2e-3, 2e-2, "layer_norm_gelu fp16")


@pytest.mark.parametrize("C,chunks", [(768, 3), (1280, 5), (1536, 3), (1024, 1), (1500, 1)])
def test_forward_chunks_rows_without_padding(C, chunks):
    """With a GELU, rows of 3, 5 or 7 x 2^k (k >= 8) go through the forward in unpadded
    chunks (three in registers, more re-read): mean, rstd and y equal the fp64 reference
    with a large mean, rows with a tail tile; without a GELU one padded tile."""
    from fusedtrain.kernels import layernorm as K

    assert K._row_chunks(C, gelu=True)["N_CHUNKS"] == chunks
    assert K._row_chunks(C, gelu=False)["N_CHUNKS"] == 1
    x = (1e3 + torch.randn(21, C, dtype=F64)) * (1 + torch.arange(C, dtype=F64) / C)
    w, b = torch.randn(C, dtype=F64), torch.randn(C, dtype=F64)
    var = x.var(-1, unbiased=False)
    ref_ln = torch.nn.functional.layer_norm(x, (C,), w, b, 1e-5)
    for approximate, ref_y in ((None, ref_ln), ("none", torch.nn.functional.gelu(ref_ln))):
        y, _, (mean, rstd) = K.layer_norm_fwd(x, None, w, b, 1e-5, approximate, F64, F64)
        torch.testing.assert_close(mean, x.mean(-1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(rstd, (var + 1e-5).rsqrt(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("C", [768, 1000])
def test_inference_writes_no_statistics(C, monkeypatch):
    """Without autograd (no_grad, or no input needing a gradient) the forward skips the
    statistics: same output, empty mean and rstd; with autograd they are written."""
    from fusedtrain.kernels import layernorm as K

    x, r, w, b = (torch.randn(*shape, dtype=torch.float32)
                  for shape in ((5, C), (5, C), (C,), (C,)))
    y, _, (mean, rstd) = K.layer_norm_fwd(x, r, w, b, 1e-5, "none", x.dtype, x.dtype)
    y0, _, (mean0, rstd0) = K.layer_norm_fwd(x, r, w, b, 1e-5, "none", x.dtype, x.dtype,
                                           save_stats=False)
    assert mean.shape == rstd.shape == (5,) and mean0.numel() == rstd0.numel() == 0
    torch.testing.assert_close(y0, y, rtol=0, atol=0)
    w.requires_grad_()
    asked = []
    launcher = K.layer_norm_fwd
    save_stats = 8  # the launcher's argument
    monkeypatch.setattr(K, "layer_norm_fwd",
                        lambda *a: asked.append(a[save_stats]) or launcher(*a))
    # The Python Functions, whose launcher calls this watches (a replay repeats the launches
    # its record holds: the statistics' writes are in the grad-mode call's record only).
    monkeypatch.setattr(_replay, "_ON", False)
    for fn, args in ((ops.layer_norm, (x, w, b)), (ops.add_layer_norm, (x, r, w, b)),
                     (ops.layer_norm_gelu, (x, w, b))):
        with_grad = fn(*args)
        with torch.no_grad():
            without = fn(*args)
        assert asked[-2:] == [True, False]
        for a, c in zip(with_grad if isinstance(with_grad, tuple) else (with_grad,),
                        without if isinstance(without, tuple) else (without,)):
            torch.testing.assert_close(c, a.detach(), rtol=0, atol=0)
    assert ops.layer_norm(x, w, b).requires_grad and asked[-1]
    assert not ops.layer_norm(x, w.detach(), b).requires_grad and not asked[-1]


def test_add_layer_norm_mixed_dtypes_under_autocast():
    """The model's case: a bf16 sublayer output added onto the fp32 residual stream. Each
    input gets the gradient in its own dtype, both written by the one backward pass."""
    x = torch.randn(2, 37, 96).bfloat16().requires_grad_()
    r = torch.randn(2, 37, 96, requires_grad=True)
    w, b = (t.detach().float().requires_grad_() for t in _inputs((96,))[1:])
    xb = torch.randn(96, requires_grad=True)  # the sublayer's fp32 bias, added here
    dy, ds = torch.randn(2, 37, 96), torch.randn(2, 37, 96)
    grads = {}
    for name, fn in (("fused", ops.add_layer_norm), ("eager", eager.add_layer_norm)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, s = fn(x, r, w, b, 1e-5, xb)
        assert s.dtype == torch.float32
        grads[name] = torch.autograd.grad((y.float() * dy).sum() + (s * ds).sum(), (x, r, xb))
    (dx, dr, dxb), (dx_ref, dr_ref, dxb_ref) = grads["fused"], grads["eager"]
    assert (dx.dtype, dr.dtype) == (dx_ref.dtype, dr_ref.dtype) == (torch.bfloat16,
                                                                    torch.float32)
    torch.testing.assert_close(dr, dr_ref, atol=1e-2, rtol=1e-2)
    assert dxb.dtype == torch.float32
    torch.testing.assert_close(dxb, dr.sum((0, 1)), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dxb, dxb_ref, atol=5e-2, rtol=1e-2)
    # One gradient in two dtypes: equal up to the last bf16 bit (Triton's interpreter
    # truncates where the GPU rounds to nearest).
    torch.testing.assert_close(dx.float(), dr, atol=0, rtol=2 ** -7)


def test_compile_fullgraph_matches_eager():
    x, w, b = (t.detach().float().requires_grad_() for t in _inputs((4, 9, 24)))
    r = torch.randn(4, 9, 24, requires_grad=True)

    def both(x, r, w, b):
        y, s = ops.add_layer_norm(x, r, w, b)
        return ops.layer_norm_gelu(y, w, b, approximate="tanh") + ops.layer_norm(s, w, b)

    def both_eager(x, r, w, b):
        y, s = eager.add_layer_norm(x, r, w, b)
        return eager.layer_norm_gelu(y, w, b, approximate="tanh") + eager.layer_norm(s, w, b)

    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")
    (o,), grads, g = grads_of(compiled, (x, r, w, b))
    (ref,), ref_g, _ = grads_of(both_eager, (x, r, w, b), g)
    for a, c in zip((o, *grads), (ref, *ref_g)):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


def test_bad_inputs():
    x, w, b = (t.detach() for t in _inputs((4, 8)))
    with pytest.raises(ValueError, match="weight"):
        ops.layer_norm(x, w[:5], b)
    with pytest.raises(ValueError, match="bias"):
        ops.layer_norm(x, w, torch.randn(8, 1, dtype=F64))
    with pytest.raises(TypeError, match="weight"):
        ops.layer_norm(x, w.float(), b)
    with pytest.raises(ValueError, match="residual"):
        ops.add_layer_norm(x, x[:2], w, b)
    with pytest.raises(ValueError, match="x_bias"):
        ops.add_layer_norm(x, x, w, b, 1e-5, w[:5])
    with pytest.raises(TypeError, match="x_bias"):
        ops.add_layer_norm(x, x, w, b, 1e-5, w.float())
    with pytest.raises(ValueError, match="approximate"):
        ops.layer_norm_gelu(x, w, b, approximate="erf")


@pytest.mark.gpu
@pytest.mark.parametrize("M,C", [(16384, 768), (4096, 4096), (1000, 1500)])
@pytest.mark.parametrize("op", ["layer_norm", "layer_norm_stream", "add_layer_norm",
                                "layer_norm_gelu"])
def test_gpu_bf16_accuracy(M, C, op):
    inputs = [t.detach().cuda().bfloat16().requires_grad_()
              for t in _inputs((M, C), dtype=torch.float32)]
    if op == "add_layer_norm":
        inputs.insert(1, torch.randn(M, C, device="cuda").bfloat16().requires_grad_())
    check_against_oracle(getattr(ops, op), getattr(eager, op), inputs, 1e-2, 1e-2, op)


@pytest.mark.gpu
@pytest.mark.parametrize("M,C", [(16384, 768), (1000, 1500)])
def test_gpu_add_layer_norm_x_bias_under_autocast(M, C):
    """The model's case: bf16 sublayer output, fp32 stream and fp32 x_bias (its gradient
    summed in fp32 by the backward) within twice eager's error against fp64."""
    x = torch.randn(M, C, device="cuda").bfloat16().requires_grad_()
    r = torch.randn(M, C, device="cuda", requires_grad=True)
    w, b = (t.detach().cuda().float().requires_grad_() for t in _inputs((C,))[1:])
    xb = (0.1 * torch.randn(C, device="cuda")).requires_grad_()

    def under_autocast(fn):
        def run(*a):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, s = fn(*a[:4], 1e-5, a[4])
            # The fused y is bf16 (the next GEMM's dtype), eager's fp32: compare like with
            # like; the fp64 oracle stays fp64.
            return y.to(torch.float64 if a[0].dtype == torch.float64 else torch.bfloat16), s
        return run
    check_against_oracle(under_autocast(ops.add_layer_norm), under_autocast(eager.add_layer_norm),
                         [x, r, w, b, xb], 1e-2, 1e-2, "add_layer_norm x_bias autocast")


@pytest.mark.gpu
def test_gpu_layer_norm_stream_under_autocast():
    """GPT's first block: an fp32 stream, the normalised output in bf16, and the stream's
    own gradient added by the LayerNorm's backward, within twice eager's error."""
    x = torch.randn(16384, 768, device="cuda", requires_grad=True)
    w, b = (t.detach().cuda().float().requires_grad_() for t in _inputs((768,))[1:])

    def under_autocast(fn):
        def run(*a):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, s = fn(*a)
            return y.to(torch.float64 if a[0].dtype == torch.float64 else torch.bfloat16), s
        return run
    check_against_oracle(under_autocast(ops.layer_norm_stream),
                         under_autocast(eager.layer_norm_stream), [x, w, b], 1e-2, 1e-2,
                         "layer_norm_stream autocast")


@pytest.mark.gpu
def test_gpu_bf16_layer_norm_gelu_tanh():
    inputs = [t.detach().cuda().bfloat16().requires_grad_()
              for t in _inputs((16384, 768), dtype=torch.float32)]
    check_against_oracle(lambda *a: ops.layer_norm_gelu(*a, approximate="tanh"),
                         lambda *a: eager.layer_norm_gelu(*a, approximate="tanh"), inputs,
                         1e-2, 1e-2, "layer_norm_gelu tanh")


def test_layernorm_tiles_are_chosen_by_gpu_time():
    """The LayerNorm kernels run for microseconds, less than a launch's host cost: their
    autotuners time CUDA-graph replays, not back-to-back launches."""
    from fusedtrain.kernels import layernorm as K
    from fusedtrain.kernels._tuning import graph_timed

    assert K._ln_fwd_kernel.do_bench is graph_timed
    assert K._ln_bwd_kernel.do_bench is graph_timed


def test_gradcheck_rms_norm():
    x, w, _ = _inputs((3, 5, 13))
    assert gradcheck(ops.rms_norm, (x, w), fast_mode=True)
    assert gradcheck(lambda x: ops.rms_norm(x, None), (x,), fast_mode=True)


def test_gradcheck_add_rms_norm():
    x, w, _ = _inputs((3, 5, 13))
    r = torch.randn(3, 5, 13, dtype=F64, requires_grad=True)
    assert gradcheck(ops.add_rms_norm, (x, r, w), fast_mode=True)


def test_rms_norm_is_transformers_llama_rmsnorm():
    """x / sqrt(mean(x^2) + eps) * weight, statistics in fp32 (LlamaRMSNorm's formula);
    add_rms_norm's stream is x + residual."""
    x, w, _ = _inputs((4, 7, 33))
    var = x.pow(2).mean(-1, keepdim=True)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), x * torch.rsqrt(var + 1e-6) * w)
    r = torch.randn_like(x)
    y, s = ops.add_rms_norm(x, r, w)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, eager.rms_norm(x + r, w))


@pytest.mark.parametrize("C", [1023, 768, 4096])
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_fp32_and_fp16_rms_norm_within_eager_error(C, op):
    for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x, w, _ = _inputs((37, C), dtype=dtype, mean=3.0)
        inputs = [x, w] if op == "rms_norm" else [x, torch.randn(37, C, dtype=dtype)
                                                    .requires_grad_(), w]
        check_against_oracle(getattr(ops, op), getattr(eager, op), inputs, atol, atol * 10,
                             f"{op} {dtype}")


def test_rms_norm_bad_input_is_named():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, torch.ones(8), eps=0.0)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, torch.randn(4, 9), torch.ones(8))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_gpu_bf16_rms_norm_within_eager_error(op):
    x = (3.0 + torch.randn(1151, 4096, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    w = (1 + 0.1 * torch.randn(4096, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    inputs = [x, w] if op == "rms_norm" else [x, torch.randn_like(x).requires_grad_(), w]
    check_against_oracle(getattr(ops, op), getattr(eager, op), inputs, 1e-2, 1e-1, op)
