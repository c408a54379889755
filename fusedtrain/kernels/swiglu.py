"""SwiGLU MLP kernels: the gate and up projections in one GEMM, and the backward GEMMs that
recompute silu(g) * u from the saved pre-activations instead of reading it.

  swiglu_fwd          g = x @ Wg.T, u = x @ Wu.T (one x tile feeds both dots), and
                      h = silu(g) * u from the fp32 accumulators; g and u stored for
                      backward only when asked, h for the down projection.
  matmul_dswiglu      dh = dy @ Wd with the SwiGLU derivative in the epilogue, from g and
                      u: dg = dh * u * silu'(g), du = dh * silu(g).
  matmul_swiglu_rhs   dWd = dy.T @ h, h = silu(g) * u recomputed as each tile of g and u is
                      loaded (rounded to dy's dtype, as the forward's h was), so h never
                      exists in memory in backward.

silu(g) = g * sigmoid(g); silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
Each as a persistent TMA GEMM (Hopper, 16-bit TMA-aligned operands; kernels/_tma.py), and
as a pointer-based GEMM for everything else (any strides, fp32/fp64 too; block sizes from
triton.autotune over _SHAPES keyed on M, N, K). The path is chosen once per operand
signature (_launch.plan_once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._device import ceil_div, stat_dtype
from fusedtrain.kernels._gemm import (
    INTERPRET_GEMM,
    WIDE_GEMM,
    gemm_configs,
    gemm_flags,
    gemm_tile,
    grouped_tile,
)
from fusedtrain.kernels._launch import fast_launch, operand_signature, plan_once, stand_in
from fusedtrain.kernels._primitives import cdiv, device_fn, sigmoid, tile_ptrs
from fusedtrain.kernels._tma import (
    TmaConfig,
    column_halves,
    k_splits,
    launch,
    matrix_desc,
    tile_halves,
    tile_origin,
    tma_config,
    tma_ok,
)
from fusedtrain.kernels._tuning import autotune

# Two (BLOCK_M, BLOCK_N) fp32 tiles live at once in each kernel (two accumulators, or the
# accumulator and g, u in the epilogue): at most 128 x 128 over 8 warps. compile_report's
# sm_90 build (triton 3.9) of GEMM_SHAPES' 256-wide and 4-warp 128 x 128 tiles spilled
# 2.9-5.6 KB a thread; these spill at most 1.6 KB (the dh GEMM at 128 x 128), the 64 x 64
# tiles none.
_SHAPES = [(128, 128, 64, 3, 8), (128, 128, 32, 4, 8), (128, 64, 64, 4, 4),
           (64, 128, 64, 4, 4), (64, 64, 64, 4, 4)]


@device_fn
def _swiglu(g, u):
    return g * sigmoid(g) * u


@device_fn
def _dswiglu(dh, g, u):
    """(dg, du) of h = silu(g) * u given dh."""
    s = sigmoid(g)
    return dh * u * s * (1.0 + g * (1.0 - s)), dh * g * s


@autotune(gemm_configs(_SHAPES), key=["M", "N", "K"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _swiglu_fwd_kernel(
    x_ptr, wg_ptr, wu_ptr, g_ptr, u_ptr, h_ptr, M, N, K,
    s_xm, s_xk, s_gn, s_gk, s_un, s_uk, s_om, s_on,
    STORE_GU: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows, cols_ok = offs_m.to(tl.int64) * s_xm, offs_n < N
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + rows[:, None] + k[None, :] * s_xk,
                    mask=(offs_m < M)[:, None] & (k < K)[None, :], other=0.0)
        w_ok = (k < K)[:, None] & cols_ok[None, :]
        # B[k, n] = W[n, k]: the transpose is only a choice of strides.
        wg = tl.load(wg_ptr + k[:, None] * s_gk + offs_n.to(tl.int64)[None, :] * s_gn,
                     mask=w_ok, other=0.0)
        wu = tl.load(wu_ptr + k[:, None] * s_uk + offs_n.to(tl.int64)[None, :] * s_un,
                     mask=w_ok, other=0.0)
        acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION, out_dtype=ACC)
        acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION, out_dtype=ACC)
    mask = (offs_m < M)[:, None] & cols_ok[None, :]
    if STORE_GU:
        tl.store(tile_ptrs(g_ptr, offs_m, offs_n, s_om, s_on),
                 acc_g.to(g_ptr.dtype.element_ty), mask=mask)
        tl.store(tile_ptrs(u_ptr, offs_m, offs_n, s_om, s_on),
                 acc_u.to(u_ptr.dtype.element_ty), mask=mask)
    tl.store(tile_ptrs(h_ptr, offs_m, offs_n, s_om, s_on),
             _swiglu(acc_g, acc_u).to(h_ptr.dtype.element_ty), mask=mask)


@autotune(gemm_configs(_SHAPES), key=["M", "N", "K"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _matmul_dswiglu_kernel(
    dy_ptr, w_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, M, N, K,
    s_dym, s_dyk, s_wk, s_wn, s_om, s_on,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    dh, offs_m, offs_n, mask = gemm_tile(dy_ptr, w_ptr, M, N, K, s_dym, s_dyk, s_wk, s_wn,
                                         ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    g = tl.load(tile_ptrs(g_ptr, offs_m, offs_n, s_om, s_on), mask=mask, other=0.0).to(ACC)
    u = tl.load(tile_ptrs(u_ptr, offs_m, offs_n, s_om, s_on), mask=mask, other=0.0).to(ACC)
    dg, du = _dswiglu(dh, g, u)
    tl.store(tile_ptrs(du_ptr, offs_m, offs_n, s_om, s_on), du.to(du_ptr.dtype.element_ty),
             mask=mask)
    tl.store(tile_ptrs(dg_ptr, offs_m, offs_n, s_om, s_on), dg.to(dg_ptr.dtype.element_ty),
             mask=mask)


@autotune(gemm_configs(_SHAPES), key=["M", "N", "K_SPLIT"], interpret=INTERPRET_GEMM,
          wide=WIDE_GEMM)
@triton.jit
def _matmul_swiglu_rhs_kernel(
    a_ptr, g_ptr, u_ptr, c_ptr, M, N, K, K_SPLIT,
    s_am, s_ak, s_hk, s_hn, s_cs, s_cm, s_cn,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Split-K as matmul_gelu_rhs: program (tile, s) reduces k in [s * K_SPLIT, (s + 1) *
    # K_SPLIT) into slice s of C (the output, C_out x H, is small and K, the tokens, long).
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = tl.program_id(1).to(tl.int64) * K_SPLIT
    k_len = tl.minimum(K - k0, K_SPLIT).to(tl.int32)
    a_ptr += k0 * s_ak
    g_ptr += k0 * s_hk
    u_ptr += k0 * s_hk
    rows, cols = offs_m.to(tl.int64) * s_am, offs_n.to(tl.int64) * s_hn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    for kk in range(0, k_len, BLOCK_K):
        k = kk + offs_k
        a = tl.load(a_ptr + rows[:, None] + k[None, :] * s_ak,
                    mask=(offs_m < M)[:, None] & (k < k_len)[None, :], other=0.0)
        h_ok = (k < k_len)[:, None] & (offs_n < N)[None, :]
        g = tl.load(g_ptr + k[:, None] * s_hk + cols[None, :], mask=h_ok, other=0.0)
        u = tl.load(u_ptr + k[:, None] * s_hk + cols[None, :], mask=h_ok, other=0.0)
        h = _swiglu(g.to(ACC), u.to(ACC)).to(a.dtype)
        acc = tl.dot(a, h, acc, input_precision=PRECISION, out_dtype=ACC)
    c_ptr += tl.program_id(1).to(tl.int64) * s_cs
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(tile_ptrs(c_ptr, offs_m, offs_n, s_cm, s_cn), acc.to(c_ptr.dtype.element_ty),
             mask=mask)


# ---------------------------------------------------------------- TMA (Hopper) versions
# The same three GEMMs as persistent TMA kernels (kernels/_tma.py), for 16-bit TMA-aligned
# operands on Hopper: one program per SM walking its tiles in one flattened loop, epilogues
# on the accumulator's column halves.


@device_fn
def _swiglu_store(g, u, off_m, off_n, g_desc, u_desc, h_desc, STORE_GU: tl.constexpr):
    """Epilogue of one column half of the forward: g, u (if asked) and h = silu(g) * u."""
    if STORE_GU:
        g_desc.store([off_m, off_n], g.to(g_desc.dtype))
        u_desc.store([off_m, off_n], u.to(u_desc.dtype))
    h_desc.store([off_m, off_n], _swiglu(g, u).to(h_desc.dtype))


@fast_launch
@triton.jit
def _swiglu_fwd_tma_kernel(
    x_ptr, wg_ptr, wu_ptr, g_ptr, u_ptr, h_ptr, M, N, K, s_xm, s_gn, s_un, s_om,
    STORE_GU: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # g = x @ Wg.T and u = x @ Wu.T: each x tile, loaded once, feeds both dots.
    x_desc = matrix_desc(x_ptr, M, K, s_xm, BLOCK_M, BLOCK_K)
    wg_desc = matrix_desc(wg_ptr, N, K, s_gn, BLOCK_N, BLOCK_K)
    wu_desc = matrix_desc(wu_ptr, N, K, s_un, BLOCK_N, BLOCK_K)
    g_desc = matrix_desc(g_ptr, M, N, s_om, BLOCK_M, BLOCK_N // 2)
    u_desc = matrix_desc(u_ptr, M, N, s_om, BLOCK_M, BLOCK_N // 2)
    h_desc = matrix_desc(h_ptr, M, N, s_om, BLOCK_M, BLOCK_N // 2)
    tiles = cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        off_m, off_n = tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
        acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
        for k in range(0, K, BLOCK_K):
            x = x_desc.load([off_m, k])
            acc_g = tl.dot(x, tl.trans(wg_desc.load([off_n, k])), acc_g,
                           input_precision=PRECISION, out_dtype=ACC)
            acc_u = tl.dot(x, tl.trans(wu_desc.load([off_n, k])), acc_u,
                           input_precision=PRECISION, out_dtype=ACC)
        g_left, g_right = column_halves(acc_g, BLOCK_M, BLOCK_N)
        u_left, u_right = column_halves(acc_u, BLOCK_M, BLOCK_N)
        _swiglu_store(g_left, u_left, off_m, off_n, g_desc, u_desc, h_desc, STORE_GU)
        _swiglu_store(g_right, u_right, off_m, off_n + BLOCK_N // 2, g_desc, u_desc, h_desc,
                      STORE_GU)


@device_fn
def _dswiglu_store(dh, off_m, off_n, g_desc, u_desc, dg_desc, du_desc):
    """Epilogue of one column half of dh: dg, du from g, u read back through TMA."""
    dg, du = _dswiglu(dh, g_desc.load([off_m, off_n]).to(dh.dtype),
                      u_desc.load([off_m, off_n]).to(dh.dtype))
    dg_desc.store([off_m, off_n], dg.to(dg_desc.dtype))
    du_desc.store([off_m, off_n], du.to(du_desc.dtype))


@fast_launch
@triton.jit
def _matmul_dswiglu_tma_kernel(
    dy_ptr, w_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, M, N, K, s_dym, s_wk, s_om,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    dy_desc = matrix_desc(dy_ptr, M, K, s_dym, BLOCK_M, BLOCK_K)
    w_desc = matrix_desc(w_ptr, K, N, s_wk, BLOCK_K, BLOCK_N)
    g_desc = matrix_desc(g_ptr, M, N, s_om, BLOCK_M, BLOCK_N // 2)
    u_desc = matrix_desc(u_ptr, M, N, s_om, BLOCK_M, BLOCK_N // 2)
    dg_desc = matrix_desc(dg_ptr, M, N, s_om, BLOCK_M, BLOCK_N // 2)
    du_desc = matrix_desc(du_ptr, M, N, s_om, BLOCK_M, BLOCK_N // 2)
    tiles = cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        off_m, off_n = tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        left, right = tile_halves(dy_desc, w_desc, off_m, off_n, K, ACC, PRECISION, BLOCK_M,
                                  BLOCK_N, BLOCK_K)
        _dswiglu_store(left, off_m, off_n, g_desc, u_desc, dg_desc, du_desc)
        _dswiglu_store(right, off_m, off_n + BLOCK_N // 2, g_desc, u_desc, dg_desc, du_desc)


@fast_launch
@triton.jit
def _matmul_swiglu_rhs_tma_kernel(
    g_ptr, u_ptr, dy_ptr, c_ptr, M, N, K, K_SPLIT, SPLITS, s_hk, s_dyk, s_cs, s_cm,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # C = dy.T @ h (M = C_out, N = H, over K tokens), computed as C.T = h.T @ dy, whose
    # recomputed operand h = silu(g) * u is A (taken from registers by the MMA; see
    # _tma.tma_matmul's A_GELU), one (BLOCK_M features of h) x (BLOCK_N of dy) tile at a
    # time, stored transposed. Work item w = (slice s, tile) reduces k in
    # [s * K_SPLIT, (s + 1) * K_SPLIT) into slice s of C (SPLITS, M, N), which the host adds;
    # K_SPLIT is a multiple of BLOCK_K. Rows past K read as zeros: g = u = 0 gives h = 0.
    g_desc = matrix_desc(g_ptr, K, N, s_hk, BLOCK_K, BLOCK_M)
    u_desc = matrix_desc(u_ptr, K, N, s_hk, BLOCK_K, BLOCK_M)
    dy_desc = matrix_desc(dy_ptr, K, M, s_dyk, BLOCK_K, BLOCK_N)
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[SPLITS, M, N], strides=[s_cs, s_cm, 1],
                                       block_shape=[1, BLOCK_N, BLOCK_M // 2])
    tiles = cdiv(N, BLOCK_M) * cdiv(M, BLOCK_N)
    for w in tl.range(tl.program_id(0), tiles * SPLITS, tl.num_programs(0), flatten=True):
        s = w // tiles
        k0 = s * K_SPLIT
        off_n, off_m = tile_origin(w % tiles, N, M, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
        for k in range(k0, tl.minimum(K, k0 + K_SPLIT), BLOCK_K):
            h = _swiglu(g_desc.load([k, off_n]).to(ACC), u_desc.load([k, off_n]).to(ACC))
            acc = tl.dot(tl.trans(h.to(dy_desc.dtype)), dy_desc.load([k, off_m]), acc,
                         input_precision=PRECISION, out_dtype=ACC)
        top, bottom = column_halves(tl.trans(acc), BLOCK_N, BLOCK_M)
        c_desc.store([s, off_m, off_n], top.to(c_desc.dtype)[None, :, :])
        c_desc.store([s, off_m, off_n + BLOCK_M // 2], bottom.to(c_desc.dtype)[None, :, :])


# The TMA kernels' tiles: two (128, 128) fp32 tiles live at once in the forward (and dh
# with g, u in the dh GEMM's epilogue halves), so 128 x 128 over 8 warps, 3 stages.
_TMA_TILES = TmaConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def _tma_config(config: TmaConfig | None) -> TmaConfig:
    """`config` (tuning, tests), else _TMA_TILES (the interpreter's one config there)."""
    return config or (tma_config(0) if INTERPRET else _TMA_TILES)


def _grid(M: int, N: int, *splits: int):
    """The programs of an (M, N) output: one a tile (GROUP_M order), times `splits`."""
    return lambda meta: (ceil_div(M, meta["BLOCK_M"]) * ceil_div(N, meta["BLOCK_N"]), *splits)


def swiglu_fwd(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
               store_gu: bool, config: TmaConfig | None = None
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """x: (M, K), gate_weight, up_weight: (N, K) -> (g, u, h), each (M, N) in x's dtype:
    g = x @ gate_weight.T, u = x @ up_weight.T (None unless store_gu), h = silu(g) * u.
    Through TMA where tma_ok; `config` overrides its tiles."""
    M, K = x.shape
    N = gate_weight.shape[0]
    h = torch.empty((M, N), device=x.device, dtype=x.dtype)
    # not written without STORE_GU
    g, u = (torch.empty_like(h) for _ in range(2)) if store_gu else (stand_in(h), stand_in(h))
    key = None if config else (*operand_signature("swiglu_fwd", x, gate_weight, up_weight),
                               store_gu)
    use_tma, flags = plan_once(key, lambda: (tma_ok(x, gate_weight, up_weight, h),
                                             dict(STORE_GU=store_gu, **gemm_flags(x))))
    if use_tma:
        cfg = _tma_config(config)
        launch(_swiglu_fwd_tma_kernel, ceil_div(M, cfg.block_m) * ceil_div(N, cfg.block_n),
               x.device, x, gate_weight, up_weight, g, u, h, M, N, K, x.stride(0),
               gate_weight.stride(0), up_weight.stride(0), N, config=cfg, key=key, **flags)
    else:
        _swiglu_fwd_kernel.planned(key, (
            x, gate_weight, up_weight, g, u, h, M, N, K, x.stride(0), x.stride(1),
            gate_weight.stride(0), gate_weight.stride(1), up_weight.stride(0),
            up_weight.stride(1), h.stride(0), h.stride(1)), lambda: (_grid(M, N), flags))
    return (g, u, h) if store_gu else (None, None, h)


def matmul_dswiglu(dy: torch.Tensor, down_weight: torch.Tensor, g: torch.Tensor,
                   u: torch.Tensor, config: TmaConfig | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """dy: (M, C_out), down_weight: (C_out, N), g, u: (M, N) of one layout -> (dg, du):
    (M, N) in g's dtype and layout, through dh = dy @ down_weight."""
    M, K = dy.shape
    N = down_weight.shape[1]
    dg, du = (torch.empty_like(g) for _ in range(2))
    key = None if config else operand_signature("dswiglu", dy, down_weight, g, u)
    use_tma, flags = plan_once(key, lambda: (
        tma_ok(dy, down_weight, g, u, dg) and g.stride() == u.stride() == dg.stride(),
        gemm_flags(dy)))
    if use_tma:
        cfg = _tma_config(config)
        launch(_matmul_dswiglu_tma_kernel, ceil_div(M, cfg.block_m) * ceil_div(N, cfg.block_n),
               dy.device, dy, down_weight, g, u, dg, du, M, N, K, dy.stride(0),
               down_weight.stride(0), g.stride(0), config=cfg, key=key, **flags)
    else:
        _matmul_dswiglu_kernel.planned(key, (
            dy, down_weight, g, u, dg, du, M, N, K, dy.stride(0), dy.stride(1),
            down_weight.stride(0), down_weight.stride(1), g.stride(0), g.stride(1)),
            lambda: (_grid(M, N), flags))
    return dg, du


def _rhs_plan(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor, out_dtype: torch.dtype,
              config: TmaConfig | None) -> tuple:
    """(use_tma, config, tiles, splits, k_split, partial-sum dtype, constexprs) of
    matmul_swiglu_rhs."""
    K, M = dy.shape
    N = g.shape[1]
    # With g TMA-aligned and dy of its dtype, an (S, M, N) output of dy's or a wider dtype
    # is TMA-aligned too.
    use_tma = (tma_ok(dy, g, u) and dy.dtype == g.dtype == u.dtype
               and g.stride() == u.stride())
    cfg = _tma_config(config)
    tiles = (ceil_div(N, cfg.block_m) * ceil_div(M, cfg.block_n) if use_tma
             else ceil_div(M, 128) * ceil_div(N, 128))
    splits = k_splits(tiles, K, dy.device)
    k_split = ceil_div(ceil_div(K, splits), 128) * 128  # a multiple of any BLOCK_K
    splits = ceil_div(K, k_split)
    part_dtype = out_dtype if splits == 1 else stat_dtype(dy)
    return use_tma, cfg, tiles, splits, k_split, part_dtype, gemm_flags(dy)


def matmul_swiglu_rhs(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor,
                      out_dtype: torch.dtype, config: TmaConfig | None = None) -> torch.Tensor:
    """dy: (K, M), g, u: (K, N) of one layout -> dy.T @ (silu(g) * u): (M, N) in out_dtype,
    reduced in fp32 (fp64) over slices of K (kernels._tma.k_splits) that the host adds."""
    K, M = dy.shape
    N = g.shape[1]
    key = None if config else (*operand_signature("swiglu_rhs", dy, g, u), out_dtype)
    use_tma, cfg, tiles, splits, k_split, part_dtype, flags = plan_once(
        key, lambda: _rhs_plan(dy, g, u, out_dtype, config))
    out = torch.empty(splits, M, N, device=dy.device, dtype=part_dtype)
    if use_tma:
        launch(_matmul_swiglu_rhs_tma_kernel, tiles * splits, dy.device, g, u, dy, out,
               M, N, K, k_split, splits, g.stride(0), dy.stride(0), M * N, N,
               config=cfg, key=key, **flags)
    else:
        _matmul_swiglu_rhs_kernel.planned(key, (
            dy, g, u, out, M, N, K, k_split, dy.stride(1), dy.stride(0), g.stride(0),
            g.stride(1), M * N, N, 1), lambda: (_grid(M, N, splits), flags))
    return out.view(M, N) if splits == 1 else out.sum(0).to(out_dtype)
