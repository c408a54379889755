"""Helpers shared by every kernel family: GELU and its derivative, the GEMM main
loop, reductions, dtype plumbing and the autotune wrapper.

Kernels here use Triton's builtins only, never triton.language's own @jit helpers
(tl.sum, tl.max, tl.zeros, tl.sigmoid, tl.cdiv, ...): when triton was imported
before TRITON_INTERPRET was set (torch and lightning import it), those stay
compiled-mode functions that the interpreter cannot call. The few we need are
re-stated below on top of builtins (tl.reduce, tl.full, tl.exp); the reductions
pass tl.sum's / tl.max's own combine functions to tl.reduce.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import triton
import triton.language as tl
import triton.testing

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._launch import fast_launch

INV_SQRT2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
TANH_COEF = tl.constexpr(0.044715)
# The tanh form's z = sqrt(2/pi) (h + 0.044715 h^3) as h (sqrt(2/pi) + Z3 h^2), and its
# derivative dz/dh = sqrt(2/pi) + 3 Z3 h^2: one multiply-add on h^2 each.
Z3 = tl.constexpr(SQRT_2_OVER_PI.value * TANH_COEF.value)
Z3_DERIV = tl.constexpr(3 * Z3.value)

APPROXIMATIONS = {"none": 0, "tanh": 1}
FAST_TANH = tl.constexpr(2)  # the tanh form through tanh.approx (see gelu_mode)
FAST_ERF = tl.constexpr(3)  # the erf form through one exp2 and one reciprocal (see normal_cdf)


def gelu_mode(approximate: str, data: torch.Tensor) -> int:
    """A kernel's APPROX constexpr for `approximate` on `data`: 0 erf, 1 tanh, or, for
    16-bit data, a cheaper form whose error sits far below the output's rounding:
    FAST_TANH (on a GPU), where one tanh.approx.f32 (relative error about 2**-11) replaces
    an exp and a division, and FAST_ERF (GPU and interpreter), where normal_cdf's rational
    form (absolute error 1.5e-7) replaces the erf, which costs as much as the rest of a
    LayerNorm->GELU forward (docs/perf-notes.md, seventh round)."""
    mode = APPROXIMATIONS[approximate]
    if data.element_size() != 2:
        return mode
    if mode == 0:
        return FAST_ERF.value
    return mode if INTERPRET else FAST_TANH.value


def device_fn(fn):
    """@triton.jit for helpers called from kernels. Under the interpreter the helper
    becomes its rewritten Python function: the interpreter would otherwise re-patch
    triton.language on every helper call, which dominates its run time."""
    jitted = triton.jit(fn)
    return jitted.rewrite() if INTERPRET else jitted


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


# The combine functions behind tl.sum / tl.max, when this Triton has them: the
# interpreter recognises them and reduces with numpy instead of element by element.
_SUM_COMBINE: tl.constexpr = getattr(tl.standard, "_sum_combine", _add)
_MAX_COMBINE: tl.constexpr = getattr(tl.standard, "_elementwise_max", _maximum)


@device_fn
def row_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _SUM_COMBINE)


@device_fn
def row_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _MAX_COMBINE)


@device_fn
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@device_fn
def cdiv(a, b):
    return (a + b - 1) // b


@device_fn
def tanh_approx(x):
    """tanh of fp32 x in one special-function-unit instruction (NVIDIA GPUs only)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@device_fn
def _tanh_arg(h, h2):
    """z of the tanh form gelu(h) = 0.5 h (1 + tanh z), given h2 = h * h."""
    return h * (SQRT_2_OVER_PI + Z3 * h2)


@device_fn
def _reciprocal_rcp(x):
    """1 / x of fp32 x in one special-function-unit instruction (relative error 1 ulp;
    an IEEE division is a rcp plus a Newton step, a check and a slow path)."""
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                     dtype=tl.float32, is_pure=True, pack=1)


@device_fn
def _reciprocal_div(x):
    return 1.0 / x


reciprocal = _reciprocal_div if INTERPRET else _reciprocal_rcp


@device_fn
def _mul_rn(a, b):
    """a * b in fp32, rounded on its own: PTX's mul.rn is never contracted into an FMA
    with a later addition, as a plain product may be, so the result is the bits that
    multiplying in a separate pass (PyTorch's) stores."""
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@device_fn
def _mul_plain(a, b):
    return a * b


mul_rounded = _mul_plain if INTERPRET else _mul_rn  # the interpreter's numpy never fuses

# Abramowitz & Stegun 7.1.26: erfc(z) = t P(t) exp(-z^2) + e(z), t = 1 / (1 + p z), z >= 0,
# |e| <= 1.5e-7. Below z = |h| / sqrt 2, so p is pre-divided by sqrt 2, P's coefficients are
# pre-halved (the GELU wants erfc / 2) and exp(-h^2 / 2) is exp2(h^2 * AS_EXP2).
AS_P = tl.constexpr(0.3275911 * 0.7071067811865476)
AS_EXP2 = tl.constexpr(-0.5 * 1.4426950408889634)
AS_A1 = tl.constexpr(0.254829592 / 2)
AS_A2 = tl.constexpr(-0.284496736 / 2)
AS_A3 = tl.constexpr(1.421413741 / 2)
AS_A4 = tl.constexpr(-1.453152027 / 2)
AS_A5 = tl.constexpr(1.061405429 / 2)


@device_fn
def normal_cdf(h):
    """(Phi(h), exp(-h^2 / 2)) for FAST_ERF: the standard normal CDF from A&S's erfc form,
    which needs one exp2 and one reciprocal (two special-function instructions and ~12
    others) where erf's polynomials need several times the instructions.
    Phi(h) = erfc(-h / sqrt 2) / 2: for h < 0 the tail itself, no 1 - erf cancellation.
    The exp is returned for the derivative, phi(h) = exp(-h^2 / 2) / sqrt(2 pi)."""
    t = reciprocal(1.0 + AS_P * tl.abs(h))
    e = tl.exp2(h * h * AS_EXP2)
    half_erfc = t * (AS_A1 + t * (AS_A2 + t * (AS_A3 + t * (AS_A4 + t * AS_A5)))) * e
    return tl.where(h >= 0, 1.0 - half_erfc, half_erfc), e


@device_fn
def gelu(h, APPROX: tl.constexpr):
    """GELU of h (fp32 or fp64). APPROX=0: exact erf form; 1: tanh form, computed as
    h * sigmoid(2z) with z = sqrt(2/pi) (h + 0.044715 h^3), since 0.5 (1 + tanh z) = sigmoid(2z);
    FAST_TANH: the tanh form with tanh_approx; FAST_ERF: the erf form with normal_cdf."""
    if APPROX == FAST_TANH:  # 0.5 h + 0.5 h tanh z: five floating-point ops and a tanh
        half_h = 0.5 * h
        return half_h + half_h * tanh_approx(_tanh_arg(h, h * h))
    elif APPROX == FAST_ERF:
        cdf, _ = normal_cdf(h)
        return h * cdf
    elif APPROX:
        return h * sigmoid(2.0 * _tanh_arg(h, h * h))
    else:
        return 0.5 * h * (1.0 + tl.erf(h * INV_SQRT2))


@device_fn
def gelu_operand(a, APPROX: tl.constexpr, ACC: tl.constexpr):
    """gelu(a) of a 16-bit tile a (a GEMM operand, a stored pre-activation): computed in
    ACC and rounded once to a's dtype. (Not in a's own 16-bit format, two values an
    instruction: that form's constants and intermediates, rounded to bf16, shifted every
    activation the same way, about -0.2% of their mean magnitude against eager's
    +0.01%, and the fused model's loss drifted above the eager one's within its first
    ~30 steps of training; docs/perf-notes.md, thirty-second round.)"""
    return gelu(a.to(ACC), APPROX).to(a.dtype)


@device_fn
def gelu_grad(h, APPROX: tl.constexpr):
    """d gelu(h) / dh, recomputed from the pre-activation h."""
    if APPROX == FAST_TANH:  # 0.5 (1 + t) + 0.5 h (1 - t^2) dz/dh, t = tanh z
        h2 = h * h
        t = tanh_approx(_tanh_arg(h, h2))
        return (0.5 + 0.5 * t) + (0.5 * h) * (SQRT_2_OVER_PI + Z3_DERIV * h2) * (1.0 - t * t)
    elif APPROX == FAST_ERF:
        cdf, e = normal_cdf(h)
        return cdf + h * INV_SQRT_2PI * e
    elif APPROX:
        h2 = h * h
        s = sigmoid(2.0 * _tanh_arg(h, h2))
        return s + h * s * (1.0 - s) * 2.0 * (SQRT_2_OVER_PI + Z3_DERIV * h2)
    else:
        cdf = 0.5 * (1.0 + tl.erf(h * INV_SQRT2))
        return cdf + h * INV_SQRT_2PI * tl.exp(-0.5 * h * h)


@device_fn
def matmul_acc(acc, a_ptr, b_ptr, a_rows, b_cols, rows_ok, cols_ok,
               K_OUTER, K_INNER, s_a_outer, s_a_inner, s_b_outer, s_b_inner,
               BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
               B_GELU: tl.constexpr = False, APPROX: tl.constexpr = 0):
    """acc += A @ B over one output tile.

    A[r, k] lives at a_ptr + a_rows[r] + koff_a(k) and B[k, c] at b_ptr + koff_b(k) + b_cols[c],
    where a_rows / b_cols are precomputed element offsets (int64) of the tile's rows and
    columns, and the reduction index runs as k = (outer, inner) over K_OUTER x K_INNER with
    koff_a = outer * s_a_outer + inner * s_a_inner (koff_b likewise). A plain GEMM has
    K_OUTER = 1; the two-level form lets an operand live in a head-split (B, H, T, D) layout
    (k = (head, d) or (batch, t)) and still be read in place, with masked tails.

    B_GELU: B holds a pre-activation and gelu(B) is multiplied instead (recomputed in
    registers as each tile is loaded, so gelu(B) never exists in memory).

    The two levels run as ONE loop over (outer, inner chunk) pairs: Triton software-
    pipelines only a kernel's innermost loop, and with K_INNER = one head (D = 64) an inner
    loop of a single chunk would leave every load exposed.
    """
    offs_k = tl.arange(0, BLOCK_K)
    chunks = cdiv(K_INNER, BLOCK_K)
    for it in range(0, K_OUTER * chunks):
        o = tl.cast(it // chunks, tl.int64)
        k = (it % chunks) * BLOCK_K + offs_k
        k_ok = k < K_INNER
        a = tl.load(a_ptr + o * s_a_outer + a_rows[:, None] + k[None, :] * s_a_inner,
                    mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + o * s_b_outer + k[:, None] * s_b_inner + b_cols[None, :],
                    mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
        if B_GELU:
            b = gelu_operand(b, APPROX, acc.dtype)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc.dtype)
    return acc


def gemm_flags(data: torch.Tensor, approximate: str | None = None) -> dict:
    """The ACC and PRECISION constexprs a GEMM kernel takes for `data`, and APPROX (see
    gelu_mode) when it applies a GELU form."""
    flags = {"ACC": acc_dtype(data), "PRECISION": dot_precision(data)}
    if approximate is not None:
        flags["APPROX"] = gelu_mode(approximate, data)
    return flags


def acc_dtype(t: torch.Tensor) -> tl.dtype:
    """Accumulator type for a kernel's `ACC` constexpr: fp64 for fp64 data, else fp32."""
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def stat_dtype(t: torch.Tensor) -> torch.dtype:
    """Torch dtype of statistics and partial sums kept beside t (log-sum-exp, mean/rstd,
    split-K and dW partials): fp64 for fp64 data, else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def dot_precision(t: torch.Tensor) -> str:
    """For a kernel's `PRECISION` constexpr. fp32 operands are multiplied in full
    precision, as eager fp32 matmul is by default, not in tf32: the fused op must
    stay within 2x the eager op's error."""
    return "ieee" if t.dtype in (torch.float32, torch.float64) else "tf32"


@functools.lru_cache
def _properties(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def _device_properties(device: torch.device):
    """A CUDA device's properties (cached: the query costs microseconds)."""
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


# Host-side arithmetic for grids and block sizes. triton.cdiv and triton.next_power_of_2
# are constexpr functions (usable in kernels too), whose calls from Python unwrap their
# arguments: ~5 us each against 0.2, paid ~570 times a GPT-2 step (docs/perf-notes.md,
# thirtieth round).


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return _device_properties(device).multi_processor_count


def l2_cache_bytes(device: torch.device) -> int:
    """L2 cache size of a CUDA device; under the interpreter, an H100's 50 MiB."""
    if device.type != "cuda":
        return 50 * 2**20
    return _device_properties(device).L2_cache_size


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def autotune(configs: list[triton.Config], key: list[str], interpret: triton.Config,
             wide: list[triton.Config], keep: Callable[..., bool] | None = None, **kwargs):
    """triton.autotune over `configs` for 16-bit data on a GPU, over the small `wide`
    configs for fp32/fp64 data (large tiles of 4- and 8-byte elements overflow shared
    memory or take minutes to compile, and those dtypes are for checking, not speed),
    and under the interpreter the single `interpret` config (tuned for few, large
    programs, which the interpreter runs fastest). `keep(config, **constexprs)`, if
    given, drops 16-bit candidates for a call's constexprs. The GPU choice is cached on
    disk where this Triton supports it, so a second process does not re-tune."""
    if INTERPRET:
        configs = [interpret]

    def by_dtype(candidates, named_args, **constexprs):
        data = next(a for a in named_args.values() if isinstance(a, torch.Tensor))
        if data.element_size() >= 4:
            return wide
        return [c for c in candidates if keep is None or keep(c, **constexprs)] or candidates

    return cached_autotune(configs, key, by_dtype, **kwargs)


def graph_timed(kernel_call: Callable, quantiles: tuple[float, ...]) -> list[float]:
    """The autotuner's benchmark for kernels of a few microseconds: CUDA-graph replays of
    the call, so that its GPU time decides and not the host's launch cost, which exceeds
    it (triton's default times back-to-back launches: ~19 us a LayerNorm of 13)."""
    return triton.testing.do_bench_cudagraph(kernel_call, quantiles=quantiles)


def cached_autotune(configs: list[triton.Config], key: list[str], prune: Callable, **kwargs):
    """triton.autotune over the configs `prune(configs, named_args, **constexprs)` keeps,
    its choice cached on disk where this Triton supports it; launched through
    _launch.fast_launch."""
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        kwargs.setdefault("cache_results", True)
    tune = triton.autotune(configs=configs, key=key,
                           prune_configs_by={"early_config_prune": prune}, **kwargs)
    return lambda kernel: fast_launch(tune(kernel))


@device_fn
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map a 1-D program id to an output tile (pid_m, pid_n), walking GROUP_M row
    tiles down each column before moving right, so concurrently running programs
    share A rows and B columns in L2."""
    num_m = cdiv(M, BLOCK_M)
    num_n = cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    return pid_m, pid_n


@device_fn
def gemm_tile(a_ptr, b_ptr, M, N, K, s_am, s_ak, s_bk, s_bn,
              ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
              B_GELU: tl.constexpr = False, APPROX: tl.constexpr = 0):
    """This program's output tile of C = A @ B (A: (M, K), B: (K, N), any strides):
    returns (acc, offs_m, offs_n, mask), the fp32 (fp64) accumulator ready for an epilogue."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    acc = matmul_acc(acc, a_ptr, b_ptr, offs_m.to(tl.int64) * s_am, offs_n.to(tl.int64) * s_bn,
                     offs_m < M, offs_n < N, 1, K, 0, s_ak, 0, s_bk, BLOCK_K, PRECISION,
                     B_GELU, APPROX)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    return acc, offs_m, offs_n, mask


@device_fn
def tile_ptrs(ptr, offs_m, offs_n, s_m, s_n):
    """Pointers of a (rows, cols) tile of a strided 2-D tensor, int64 offsets."""
    return ptr + offs_m.to(tl.int64)[:, None] * s_m + offs_n.to(tl.int64)[None, :] * s_n


def gemm_configs() -> list[triton.Config]:
    """Hopper-leaning GEMM tilings for the autotuner (bf16/fp16; the fp32 ones that do
    not fit in shared memory are skipped by the autotuner)."""
    shapes = [(128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4),
              (128, 128, 64, 3, 8), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
              (64, 64, 64, 4, 4), (128, 128, 32, 4, 4)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8},
                          num_stages=s, num_warps=w) for m, n, k, s, w in shapes]


INTERPRET_GEMM = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8})
WIDE_GEMM = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8},
                           num_stages=2, num_warps=4)]


@device_fn
def pick3(i, p0, p1, p2):
    """p0, p1 or p2 by a run-time index i in {0, 1, 2} (e.g. q, k or v)."""
    return tl.where(i == 0, p0, tl.where(i == 1, p1, p2))
