import itertools

import pytest
import torch
import triton
import triton.language as tl
from conftest import check_against_oracle, grads_of

from fusedtrain import eager, ops
from fusedtrain.gradcheck import gradcheck
from fusedtrain.kernels.gelu import FAST_ERF, FAST_TANH, gelu, gelu_grad, gelu_mode

F64 = torch.float64


def _mlp_inputs(M, C, Hd, dtype=F64, bias=True, lead=()):
    x = torch.randn(*lead, M, C, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(Hd, C, dtype=dtype) / C ** 0.5).requires_grad_()
    b1 = torch.randn(Hd, dtype=dtype, requires_grad=True) if bias else None
    w2 = (torch.randn(C, Hd, dtype=dtype) / Hd ** 0.5).requires_grad_()
    b2 = torch.randn(C, dtype=dtype, requires_grad=True) if bias else None
    return x, w1, b1, w2, b2


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(), (2,)])
def test_gradcheck_linear_gelu(approximate, bias, lead):
    x, w, b, _, _ = _mlp_inputs(5, 7, 9, bias=bias, lead=lead)
    assert gradcheck(lambda *a: ops.linear_gelu(*a, approximate=approximate), (x, w, b),
                     fast_mode=True)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_gradcheck_fused_mlp(approximate, bias, lead):
    inputs = _mlp_inputs(5, 7, 9, bias=bias, lead=lead)
    assert gradcheck(lambda *a: ops.fused_mlp(*a, approximate=approximate), inputs,
                     fast_mode=True)


def test_strided_input():
    base = torch.randn(9, 14, dtype=F64)
    x = base[:, ::2]  # non-contiguous (..., K)
    w, b = torch.randn(5, 7, dtype=F64), torch.randn(5, dtype=F64)
    torch.testing.assert_close(ops.linear_gelu(x, w, b), eager.linear_gelu(x, w, b))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("M,K,N", [(113, 72, 130), (1151, 40, 24)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_gelu_accuracy(dtype, atol, M, K, N, approximate):
    x = torch.randn(M, K)
    w, b = torch.randn(N, K) / K ** 0.5, torch.randn(N)
    inputs = [t.to(dtype).requires_grad_() for t in (x, w, b)]
    check_against_oracle(lambda *a: ops.linear_gelu(*a, approximate),
                         lambda *a: eager.linear_gelu(*a, approximate), inputs, atol, atol * 10)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_fused_mlp_accuracy(dtype, atol):
    inputs = [t.detach().to(dtype).requires_grad_() for t in _mlp_inputs(113, 72, 130)]
    check_against_oracle(lambda *a: ops.fused_mlp(*a, "tanh"),
                         lambda *a: eager.fused_mlp(*a, "tanh"), inputs, atol, atol * 10)


def _saved_activation_bytes(fn, inputs, params):
    """Bytes autograd saves for backward, parameters (and views of them) left out."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in param_ptrs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(saved.values())


def test_fused_mlp_output_takes_an_in_place_add():
    """The (B, T, C) output takes an in-place add as the twin's does, with the same
    gradients (a view made inside the Function would refuse it)."""
    F64 = torch.float64
    x = torch.randn(2, 5, 16, dtype=F64, requires_grad=True)
    params = [torch.randn(*s, dtype=F64, requires_grad=True)
              for s in ((32, 16), (32,), (16, 32), (16,))]
    grads = []
    for fn in (ops.fused_mlp, eager.fused_mlp):
        out = fn(x, *params)
        out.add_(1.0)
        grads.append(torch.autograd.grad((out * out).sum(), [x, *params]))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_inference_forward_writes_no_pre_activation():
    """Without a backward to come (no_grad, or no input needing a gradient) the forward
    runs the kernel that writes y alone; results equal the training forward's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.name())
            return func(*args, **(kwargs or {}))

    x, w1, b1, w2, b2 = _mlp_inputs(37, 24, 40)
    for run in (lambda: ops.linear_gelu(x, w1, b1), lambda: ops.fused_mlp(x, w1, b1, w2, b2)):
        trained = run()
        with torch.no_grad(), OpNames() as seen:
            inferred = run()
        assert "fusedtrain::linear_gelu_infer" in seen.names
        assert "fusedtrain::linear_gelu_fwd" not in seen.names
        torch.testing.assert_close(inferred, trained.detach(), rtol=0, atol=0)


@triton.jit
def _gelu_and_grad(h_ptr, y_ptr, dh_ptr, n, APPROX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    h = tl.load(h_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, gelu(h, APPROX), mask=offs < n)
    tl.store(dh_ptr + offs, gelu_grad(h, APPROX), mask=offs < n)


def _gelu_and_grad_on(h: torch.Tensor, approx: int) -> tuple[torch.Tensor, torch.Tensor]:
    y, dh = torch.empty_like(h), torch.empty_like(h)
    _gelu_and_grad[(1,)](h, y, dh, h.numel(), APPROX=approx, BLOCK=4096)
    return y.cpu().double(), dh.cpu().double()


_GELU_RANGE = torch.cat([torch.linspace(-12, 12, 3001), torch.tensor([0.0, -1e-30, 1e-30])])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fast_erf_gelu_and_its_derivative_hold_fp32_precision(device):
    """FAST_ERF, the erf GELU that 16-bit data gets, against the exact erf form in fp64 over
    the whole range, tails included: errors near fp32 rounding (the tanh form is 5e-4 off),
    far below a 16-bit output's rounding. On a GPU its reciprocal is the hardware's."""
    assert gelu_mode("none", torch.ones(1, dtype=torch.bfloat16)) == FAST_ERF.value
    assert gelu_mode("none", torch.ones(1)) == 0
    y, dh = _gelu_and_grad_on(_GELU_RANGE.to(device), FAST_ERF.value)
    h64 = _GELU_RANGE.double()
    cdf = 0.5 * (1 + torch.special.erf(h64 / 2 ** 0.5))
    y_ref = h64 * cdf
    dh_ref = cdf + h64 * torch.exp(-0.5 * h64 ** 2) / (2 * torch.pi) ** 0.5
    scale = h64.abs().clamp(min=1)
    assert ((y - y_ref).abs() / scale).max() < 3e-7
    assert ((dh - dh_ref).abs() / scale).max() < 3e-7
    assert torch.isfinite(y).all() and torch.isfinite(dh).all()


@pytest.mark.parametrize("approx,device,tol", [
    (1, "cpu", 1e-6),
    pytest.param(1, "cuda", 1e-6, marks=pytest.mark.gpu),
    # FAST_TANH: tanh.approx.f32 (relative error about 2**-11), GPU only, for 16-bit data
    pytest.param(FAST_TANH.value, "cuda", 2e-3, marks=pytest.mark.gpu),
])
def test_tanh_gelu_and_its_derivative_against_fp64(approx, device, tol):
    """The tanh form (z = h (sqrt(2/pi) + 0.0356774 h^2)) and its derivative against the
    same formula in fp64 over [-12, 12]: fp32 rounding for the exact tanh, the hardware
    tanh's error for FAST_TANH, which 16-bit outputs round away."""
    y, dh = _gelu_and_grad_on(_GELU_RANGE.to(device), approx)
    h64 = _GELU_RANGE.double()
    t = torch.tanh((2 / torch.pi) ** 0.5 * (h64 + 0.044715 * h64 ** 3))
    y_ref = 0.5 * h64 * (1 + t)
    dz = (2 / torch.pi) ** 0.5 * (1 + 3 * 0.044715 * h64 ** 2)
    dh_ref = 0.5 * (1 + t) + 0.5 * h64 * (1 - t ** 2) * dz
    scale = h64.abs().clamp(min=1)
    assert ((y - y_ref).abs() / scale).max() < tol
    assert ((dh - dh_ref).abs() / scale).max() < tol
    assert torch.isfinite(y).all() and torch.isfinite(dh).all()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("M,N", [(16, 40), (17, 33)])  # TMA-aligned or not
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype,out_dtype", [(F64, None), (torch.float16, None),
                                             (torch.float16, torch.float32)])
def test_split_k_weight_gradient(splits, dtype, out_dtype, M, N, deterministic):
    """Slices added in place (TMA reductions) and, in deterministic mode or unaligned, as
    partial sums; in the inputs' dtype or a wider one (an fp32 parameter's gradient)."""
    from fusedtrain.kernels.linear_gelu import matmul_gelu_rhs

    dy, h = torch.randn(203, M, dtype=dtype), torch.randn(203, N, dtype=dtype)
    mode = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out = matmul_gelu_rhs(dy, h, "tanh", out_dtype, splits=splits)
    finally:
        torch.use_deterministic_algorithms(mode)
    ref = dy.double().t() @ torch.nn.functional.gelu(h.double(), approximate="tanh")
    assert out.dtype == (out_dtype or dtype) and out.shape == (M, N)
    tol = 1e-9 if dtype == F64 else 1e-2  # gelu(h) is rounded to dtype for the MMA
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("strided", [False, True])
def test_tma_and_pointer_gemms_agree_with_the_oracle(strided):
    """The three MLP GEMMs through their TMA version (aligned operands; small tiles, so
    each program walks several tiles, split-K slices end mid-tensor and every dimension
    has a tail) and through the pointer version (a transposed, unaligned operand)."""
    from fusedtrain.kernels import linear_gelu as K
    from fusedtrain.kernels._tma import TmaConfig, tma_ok

    small = TmaConfig(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=1)
    M, C, Hd = 203, 72, 136
    x = torch.randn(C, M, dtype=F64).t() if strided else torch.randn(M, C, dtype=F64)
    w, b = torch.randn(Hd, C, dtype=F64) / 9, torch.randn(Hd, dtype=F64)
    dy, w2 = torch.randn(M, 40, dtype=F64), torch.randn(40, Hd, dtype=F64) / 7
    assert tma_ok(x) != strided

    y, h = K.linear_gelu_fwd(x, w, b, "tanh", store_h=True, config=small)
    h_ref = x @ w.t() + b
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(y, torch.nn.functional.gelu(h_ref, approximate="tanh"))
    dh, db = K.matmul_dgelu(dy, w2, h, "none", F64, config=small)
    gelu_grad = torch.func.grad(lambda t: torch.nn.functional.gelu(t).sum())
    dh_ref = (dy @ w2) * torch.vmap(gelu_grad)(h)
    torch.testing.assert_close(dh, dh_ref)
    torch.testing.assert_close(db, dh_ref.sum(0))  # the epilogue's sums, row tail included
    assert K.matmul_dgelu(dy, w2, h, "none", config=small)[1] is None
    dw2 = K.matmul_gelu_rhs(x, h, "none", splits=3, config=small)
    torch.testing.assert_close(dw2, x.t() @ torch.nn.functional.gelu(h))


def test_gemm_paths_are_planned_per_signature_alignment_included():
    """The MLP GEMMs decide their kernel once per call signature: an operand of the same
    shape and strides but a base off by 8 bytes gets a plan of its own (the pointer
    kernel, not the TMA one), a deterministic-mode call a split-K plan of its own; every
    call's values match the oracle."""
    from fusedtrain.kernels import _launch
    from fusedtrain.kernels import linear_gelu as K

    M, C, Hd = 70, 64, 96
    w, b = torch.randn(Hd, C, dtype=F64) / 8, torch.randn(Hd, dtype=F64)
    aligned = torch.randn(M, C, dtype=F64)
    shifted = torch.randn(1 + M * C, dtype=F64)[1:].view(M, C)
    _launch._PLANS.clear()
    for x in (aligned, shifted, aligned):
        y, h = K.linear_gelu_fwd(x, w, b, "none", store_h=True)
        torch.testing.assert_close(h, x @ w.t() + b)
        torch.testing.assert_close(y, torch.nn.functional.gelu(x @ w.t() + b))
    assert sorted(plan[0] for plan in _launch._PLANS.values()) == ["pointer", "tma"]
    dy = torch.randn(M, Hd, dtype=F64)
    ref = dy.t() @ torch.nn.functional.gelu(h)
    torch.testing.assert_close(K.matmul_gelu_rhs(dy, h, "none"), ref)
    torch.use_deterministic_algorithms(True)
    try:
        torch.testing.assert_close(K.matmul_gelu_rhs(dy, h, "none"), ref)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len([key for key in _launch._PLANS if key[0] == "gelu_rhs"]) == 2


@pytest.mark.parametrize("M,N", [(1, 1), (203, 130)])
@pytest.mark.parametrize("dtype", [F64, torch.float16])
def test_gelu_bwd_with_column_sums(M, N, dtype):
    """dh = dy * gelu'(h) and its column sums from the kernel's tiles, at row and column
    tails, with dy's rows strided."""
    from fusedtrain.kernels.linear_gelu import gelu_bwd

    dy, h = torch.randn(M, N + 5, dtype=dtype)[:, :N], torch.randn(M, N, dtype=dtype)
    sums_dtype = torch.float32 if dtype == torch.float16 else dtype  # fp16: a wider bias
    dh, db = gelu_bwd(dy, h, "tanh", sums_dtype)
    gelu_grad = torch.func.grad(lambda t: torch.nn.functional.gelu(t, approximate="tanh").sum())
    dh_ref = dy.double() * torch.vmap(gelu_grad)(h.double().flatten()).view(M, N)
    tol = 1e-9 if dtype == F64 else 2e-3
    assert dh.dtype == dtype and db.dtype == sums_dtype  # summed in fp32, rounded once
    torch.testing.assert_close(dh.double(), dh_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(db.double(), dh_ref.sum(0), rtol=tol, atol=tol * M)
    assert gelu_bwd(dy, h, "tanh")[1] is None


@pytest.mark.parametrize("M,N", [(0, 5), (1, 1), (203, 130), (1151, 300), (4099, 33)])
def test_bias_grad_kernel(M, N):
    """Column sums in fp32 partials: every row and column tail, rows with a stride, and
    both paths (one pass up to 2048 rows; partial sums, then their own column sums)."""
    from fusedtrain.kernels.bias_grad import bias_grad

    g = torch.randn(M, N + 7)[:, 3:N + 3]  # unit column stride, row stride N + 7
    db = bias_grad(g)
    assert db.dtype == torch.float32 and db.shape == (N,)
    torch.testing.assert_close(db.double(), g.double().sum(0), rtol=1e-5, atol=1e-5)
    # In another dtype: the fp32 sums, rounded once by the last pass (to nearest on a
    # GPU; triton's interpreter truncates: within one bf16 unit either way).
    db16 = bias_grad(g, torch.bfloat16)
    assert db16.dtype == torch.bfloat16
    torch.testing.assert_close(db16.float(), db, rtol=2 ** -7, atol=0)


def test_tma_alignment_rule():
    from fusedtrain.kernels._tma import tma_aligned

    base = torch.randn(64, 72)
    assert tma_aligned(base)
    assert not tma_aligned(base.t())             # unit stride must be the last
    assert not tma_aligned(torch.randn(1 + 64 * 72)[1:].view(64, 72))  # base off by 4 bytes
    assert not tma_aligned(torch.randn(64, 70))  # row stride 280 bytes


def test_warp_specialised_kernels_stay_off_the_cpu_path(monkeypatch):
    """The Gluon kernels (sm_90, triton 3.6 only) never take CPU tensors or the interpreter;
    the Triton kernels run there."""
    from fusedtrain.kernels import _tma

    a = torch.randn(64, 72, dtype=torch.bfloat16)
    assert not _tma.gluon_ok(a, a)
    monkeypatch.setattr(_tma, "INTERPRET", False)
    monkeypatch.setattr(triton, "__version__", _tma.GLUON_TRITON + "0")
    assert not _tma.gluon_ok(a, a)  # not on a GPU


def test_split_k_count_balances_the_persistent_grid(monkeypatch):
    """k_splits picks the slice count whose work items spread most evenly over the SMs:
    GPT-2's dW2 (72 tiles of 128 x 256 on 132 SMs) -> 7 slices (504 items: 4 rounds of
    1/7 of K, against 1 round of all of K unsplit); a short K caps the slices at K / 1024."""
    from fusedtrain.kernels import _tma as K

    monkeypatch.setattr(K, "INTERPRET", False)
    monkeypatch.setattr(K, "sm_count", lambda device: 132)
    assert K.k_splits(72, 16384, None) == 7
    assert K.k_splits(66, 2048, None) == 2  # 132 items: one full wave
    assert K.k_splits(66, 1024, None) == 1  # K too short to split
    assert K.k_splits(512, 16384, None) == 1  # already > 3 waves of whole tiles
    assert K.k_splits(132, 16384, None) == 1  # one full wave already
    assert K.k_splits(132, 16384, None, per_sm=2) == 2  # two programs per SM: half a wave


def test_tma_launch_runs_per_sm_programs_and_caps_registers_only_when_asked(monkeypatch):
    from fusedtrain.kernels import _tma

    monkeypatch.setattr(_tma, "INTERPRET", False)
    monkeypatch.setattr(_tma, "sm_count", lambda device: 132)
    assert _tma.TmaConfig().programs(1000, None) == 132
    assert _tma.TmaConfig(per_sm=2).programs(1000, None) == 264
    assert _tma.TmaConfig(per_sm=2).programs(100, None) == 100  # one per tile at most
    assert "maxnreg" not in _tma.TmaConfig().meta()
    assert _tma.TmaConfig(maxnreg=128).meta()["maxnreg"] == 128
    with pytest.raises(ValueError, match="per_sm"):
        _tma.TmaConfig(per_sm=0)


def test_fused_mlp_saves_only_x_and_h():
    M, C, Hd = 64, 16, 64
    x, w1, b1, w2, b2 = _mlp_inputs(M, C, Hd, dtype=torch.float32)
    params = [w1, b1, w2, b2]
    fused = _saved_activation_bytes(ops.fused_mlp, (x, w1, b1, w2, b2), params)
    eager_b = _saved_activation_bytes(eager.fused_mlp, (x, w1, b1, w2, b2), params)
    x_bytes, h_bytes = M * C * 4, M * Hd * 4
    assert fused == x_bytes + h_bytes
    assert eager_b == x_bytes + 2 * h_bytes  # x, h and gelu(h)


def test_compile_fullgraph_matches_eager():
    mlp = lambda *a: ops.fused_mlp(*a, approximate="tanh")  # noqa: E731
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    inputs = [t.detach().float().requires_grad_() for t in _mlp_inputs(13, 8, 32)]
    (yc,), gc, g = grads_of(compiled, inputs)
    (ye,), ge, _ = grads_of(lambda *a: eager.fused_mlp(*a, "tanh"), inputs, g)
    torch.testing.assert_close(yc, ye, rtol=1e-4, atol=1e-5)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_flop_counter_counts_the_fused_gemms():
    from torch.utils.flop_counter import FlopCounterMode

    x, w, b, _, _ = _mlp_inputs(16, 8, 24, dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        ops.linear_gelu(x, w, b)
    assert counter.get_total_flops() == 2 * 16 * 8 * 24


def test_bad_inputs():
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    with pytest.raises(ValueError, match="weight"):
        ops.linear_gelu(x, torch.randn(6, 7), b)
    with pytest.raises(TypeError, match="weight"):
        ops.linear_gelu(x, w.double(), b)
    with pytest.raises(TypeError, match="x"):
        ops.linear_gelu(x.int(), w, b)
    with pytest.raises(ValueError, match="approximate"):
        ops.linear_gelu(x, w, b, approximate="fast")
    with pytest.raises(ValueError, match="bias"):
        ops.linear_gelu(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="proj_weight"):
        ops.fused_mlp(x, w, b, torch.randn(8, 5), None)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", [(16384, 768, 3072), (4096, 1024, 4096)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gpu_bf16_accuracy(M, K, N, approximate):
    dev = "cuda"
    x = torch.randn(M, K, device=dev)
    w1, b1 = torch.randn(N, K, device=dev) / K ** 0.5, torch.randn(N, device=dev)
    w2, b2 = torch.randn(K, N, device=dev) / N ** 0.5, torch.randn(K, device=dev)
    inputs = [t.bfloat16().requires_grad_() for t in (x, w1, b1, w2, b2)]
    check_against_oracle(lambda *a: ops.fused_mlp(*a, approximate),
                         lambda *a: eager.fused_mlp(*a, approximate), inputs, 1e-2, 1e-2, "mlp")
    check_against_oracle(lambda *a: ops.linear_gelu(*a, approximate),
                         lambda *a: eager.linear_gelu(*a, approximate), inputs[:3], 1e-2, 1e-2,
                         "linear_gelu")


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gpu_bf16_gelu_activations_are_not_biased(approximate):
    """The MLP's activations gelu(x W^T + b) against fp64: their mean signed error (over the
    mean magnitude) within twice eager's plus 2e-4. The max-error rule alone let through a
    GELU whose every value leaned the same way (-1.8e-3 against eager's +9e-5 at gpt2's
    shape), and the fused model then trained apart from the eager one
    (docs/journal.md)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 768, device="cuda", generator=g).bfloat16()
    w = (torch.randn(3072, 768, device="cuda", generator=g) * 0.02).bfloat16()
    b = (torch.randn(3072, device="cuda", generator=g) * 0.02).bfloat16()
    ref = torch.nn.functional.gelu(x.double() @ w.double().T + b.double(),
                                   approximate=approximate)

    def bias(y):
        return ((y.double() - ref).mean() / ref.abs().mean()).item()

    fused = ops.linear_gelu(*(t.clone().requires_grad_() for t in (x, w, b)), approximate)
    eager_bias = bias(eager.linear_gelu(x, w, b, approximate))
    assert abs(bias(fused)) <= 2 * abs(eager_bias) + 2e-4, (bias(fused), eager_bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_tanh_gelu_within_eager_error_over_a_wide_range(dtype):
    """The tanh form's GELU (the forward's epilogue and dW2's recomputed operand, through
    tanh.approx on a GPU) against the fp64 oracle, with pre-activations spread over about
    [-12, 12], the far negative tail included, where h/2 + h/2 tanh z cancels; then very
    large ones. M = 1151 leaves a partial tile."""
    M, K, N = 1151, 768, 3072
    x = torch.randn(M, K, device="cuda")
    w1, b1 = torch.randn(N, K, device="cuda") * 3 / K ** 0.5, torch.randn(N, device="cuda") * 3
    w2, b2 = torch.randn(K, N, device="cuda") / N ** 0.5, torch.randn(K, device="cuda")
    inputs = [t.to(dtype).requires_grad_() for t in (x, w1, b1, w2, b2)]
    check_against_oracle(lambda *a: ops.fused_mlp(*a, "tanh"),
                         lambda *a: eager.fused_mlp(*a, "tanh"), inputs, 1e-2, 1e-2, "mlp")
    check_against_oracle(lambda *a: ops.linear_gelu(*a, "tanh"),
                         lambda *a: eager.linear_gelu(*a, "tanh"), inputs[:3], 1e-2, 1e-2,
                         "linear_gelu")
    # One row whose pre-activations reach about 1000 (h^2 past fp16's largest value):
    # gelu(h) is h or 0 there, finite.
    x[0] = 400 / K ** 0.5 * w1[0].sign()
    inputs = [t.to(dtype).requires_grad_() for t in (x, w1, b1)]
    check_against_oracle(lambda *a: ops.linear_gelu(*a, "tanh"),
                         lambda *a: eager.linear_gelu(*a, "tanh"), inputs, 1e-2, 1e-2,
                         "linear_gelu, large h")


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", [(1000, 72, 3000), (16384, 768, 3072), (129, 1000, 200),
                                   (1, 64, 136)])
@pytest.mark.parametrize("approximate,bias", [("tanh", True), ("none", False)])
def test_gpu_warp_specialised_gemms_match_the_triton_kernels(M, K, N, approximate, bias):
    """The Gluon forward and dGELU GEMMs (used on sm_90) against the Triton TMA kernels
    (forced by a config) on the same bf16 data: every dimension with a tail in the first
    and third shapes, several tiles per consumer at gpt2's, one row in the last (sizes of
    1 reach the kernels as constants). The same fp32 accumulation over the same K steps,
    so equal to a bf16 rounding; the column sums to fp32's."""
    from fusedtrain.kernels import linear_gelu as Kn
    from fusedtrain.kernels import linear_gelu_gluon
    from fusedtrain.kernels._tma import gluon_ok, tma_config

    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device=dev) / K ** 0.5).bfloat16()
    b = torch.randn(N, device=dev, dtype=torch.bfloat16) if bias else None
    dy = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w2 = (torch.randn(K, N, device=dev) / 9).bfloat16()
    if not gluon_ok(x, w, dy, w2):
        pytest.skip("the warp-specialised kernels need an sm_90 GPU and triton 3.6")
    cfg = tma_config(N)
    # The forward kernel itself (linear_gelu_fwd takes it only where N >= K).
    y, h, y_only = (torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in range(3))
    approx = gelu_mode(approximate, x)
    linear_gelu_gluon.linear_gelu_fwd(x, w, b, y, h, approx)
    linear_gelu_gluon.linear_gelu_fwd(x, w, b, y_only, None, approx)
    y_ref, h_ref = Kn.linear_gelu_fwd(x, w, b, approximate, store_h=True, config=cfg)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(y_only, y_ref)
    dh, db = Kn.matmul_dgelu(dy, w2, h, approximate, torch.float32)
    dh_ref, db_ref = Kn.matmul_dgelu(dy, w2, h, approximate, torch.float32, config=cfg)
    torch.testing.assert_close(dh, dh_ref)
    torch.testing.assert_close(db, db_ref, rtol=1e-4, atol=1e-3)
    assert Kn.matmul_dgelu(dy, w2, h, approximate)[1] is None


@pytest.mark.gpu
def test_gpu_mlp_peak_memory_below_eager_by_one_hidden_tensor():
    M, K, N = 16384, 768, 3072
    x = torch.randn(M, K, device="cuda")
    w1, b1 = torch.randn(N, K, device="cuda") / K ** 0.5, torch.randn(N, device="cuda")
    w2, b2 = torch.randn(K, N, device="cuda") / N ** 0.5, torch.randn(K, device="cuda")
    inputs = [t.bfloat16() for t in (x, w1, b1, w2, b2)]
    g = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    for _, (name, fn) in itertools.product(range(2), (("eager", eager.fused_mlp),
                                                      ("fused", ops.fused_mlp))):
        # The first pass warms up (autotuning, cuBLAS workspaces); the second is kept.
        leaves = [t.detach().requires_grad_() for t in inputs]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(*leaves, "tanh").backward(g)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    # One (M x N) bf16 tensor less, give or take the small (M x K) buffers around it.
    saved = peaks["eager"] - peaks["fused"]
    print(f"MLP forward+backward peak MB above inputs: eager {peaks['eager'] / 1e6:.1f}, "
          f"fused {peaks['fused'] / 1e6:.1f}; one hidden tensor {M * N * 2 / 1e6:.1f}")
    assert saved >= 0.9 * M * N * 2, f"peaks {peaks}, saved {saved} < 0.9 x {M * N * 2}"
