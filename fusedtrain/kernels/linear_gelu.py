"""Linear+GELU kernels.

  linear_gelu_fwd   y = gelu(x @ W.T + b), bias and GELU applied to the accumulator in
                    registers; optionally also writes h = x @ W.T + b for backward.
  matmul_dgelu      dh = (dy @ W2) * gelu'(h): the MLP's backward GEMM, gelu'(h)
                    recomputed from h in the epilogue (no dGELU tensor in memory);
                    optionally also the bias gradient dh.sum(0), from the epilogue's tiles.
  matmul_gelu_rhs   dW2 = dy.T @ gelu(h): gelu(h) recomputed while each tile of h is
                    loaded, so gelu(h) is never stored.
  gelu_bwd          dh = dy * gelu'(h), elementwise, optionally with dh.sum(0)
                    (standalone linear_gelu backward).

Each GEMM has two versions: a persistent one loading through TMA descriptors (Hopper,
16-bit data, TMA-aligned operands; tiles from kernels._tma.tma_config's measured table),
and a pointer-based one for every other case (any strides, fp32/fp64; block sizes from
triton.autotune over Hopper-leaning tilings, keyed on M, N, K, cached on disk). On an
sm_90 GPU the forward and dGELU GEMMs run instead as warp-specialised Gluon kernels
(linear_gelu_gluon), whose epilogues overlap the MMAs (where _tma.gluon_ok allows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._device import acc_dtype, ceil_div, stat_dtype
from fusedtrain.kernels._gemm import INTERPRET_GEMM, WIDE_GEMM, gemm_configs, gemm_flags, gemm_tile
from fusedtrain.kernels._launch import fast_launch, operand_signature, plan_once, stand_in
from fusedtrain.kernels._primitives import cdiv, device_fn, tile_ptrs
from fusedtrain.kernels._tma import (
    TmaConfig,
    column_halves,
    gluon_ok,
    k_splits,
    launch,
    matrix_desc,
    reduce_tile,
    tile_halves,
    tile_origin,
    tma_config,
    tma_matmul,
    tma_ok,
)
from fusedtrain.kernels._tuning import autotune
from fusedtrain.kernels.bias_grad import bias_grad, store_column_sums
from fusedtrain.kernels.gelu import gelu, gelu_grad, gelu_mode


@autotune(gemm_configs(), key=["M", "N", "K"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _linear_gelu_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, h_ptr, M, N, K,
    s_xm, s_xk, s_wn, s_wk, s_ym, s_yn, s_hm, s_hn,
    HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, APPROX: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # B[k, n] = W[n, k]: the transpose is only a choice of strides.
    acc, offs_m, offs_n, mask = gemm_tile(x_ptr, w_ptr, M, N, K, s_xm, s_xk, s_wk, s_wn, ACC,
                                          PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(ACC)[None, :]
    if STORE_H:
        tl.store(tile_ptrs(h_ptr, offs_m, offs_n, s_hm, s_hn), acc.to(h_ptr.dtype.element_ty),
                 mask=mask)
    y = gelu(acc, APPROX)
    tl.store(tile_ptrs(y_ptr, offs_m, offs_n, s_ym, s_yn), y.to(y_ptr.dtype.element_ty),
             mask=mask)


@autotune(gemm_configs(), key=["M", "N", "K"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _matmul_dgelu_kernel(
    dy_ptr, w_ptr, h_ptr, dh_ptr, M, N, K,
    s_dym, s_dyk, s_wk, s_wn, s_hm, s_hn, s_dhm, s_dhn,
    APPROX: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    acc, offs_m, offs_n, mask = gemm_tile(dy_ptr, w_ptr, M, N, K, s_dym, s_dyk, s_wk, s_wn,
                                          ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    h = tl.load(tile_ptrs(h_ptr, offs_m, offs_n, s_hm, s_hn), mask=mask, other=0.0).to(ACC)
    dh = acc * gelu_grad(h, APPROX)
    tl.store(tile_ptrs(dh_ptr, offs_m, offs_n, s_dhm, s_dhn), dh.to(dh_ptr.dtype.element_ty),
             mask=mask)


@autotune(gemm_configs(), key=["M", "N", "K_SPLIT"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _matmul_gelu_rhs_kernel(
    a_ptr, h_ptr, c_ptr, M, N, K, K_SPLIT,
    s_am, s_ak, s_hk, s_hn, s_cs, s_cm, s_cn,
    APPROX: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Split-K: program (tile, s) reduces k in [s * K_SPLIT, (s + 1) * K_SPLIT) and writes
    # its own slice s of C; the host sums the slices. The output (C x 4C) is small and
    # K (tokens) long, so without the split too few tiles exist to fill the GPU.
    k0 = tl.program_id(1).to(tl.int64) * K_SPLIT
    k_len = tl.minimum(K - k0, K_SPLIT).to(tl.int32)
    acc, offs_m, offs_n, mask = gemm_tile(a_ptr + k0 * s_ak, h_ptr + k0 * s_hk, M, N, k_len,
                                          s_am, s_ak, s_hk, s_hn,
                                          ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                          B_GELU=True, APPROX=APPROX)
    c_ptr += tl.program_id(1).to(tl.int64) * s_cs
    tl.store(tile_ptrs(c_ptr, offs_m, offs_n, s_cm, s_cn), acc.to(c_ptr.dtype.element_ty),
             mask=mask)


@fast_launch
@triton.jit
def _gelu_bwd_kernel(dy_ptr, h_ptr, dh_ptr, part_ptr, M, N, s_dym, s_hm, s_dhm,
                     COL_SUMS: tl.constexpr, APPROX: tl.constexpr, ACC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One (BLOCK_M, BLOCK_N) tile of dh; with COL_SUMS its column sums become row
    # program_id(0) of the partial-sum buffer.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    dy = tl.load(tile_ptrs(dy_ptr, offs_m, offs_n, s_dym, 1), mask=mask, other=0.0).to(ACC)
    h = tl.load(tile_ptrs(h_ptr, offs_m, offs_n, s_hm, 1), mask=mask, other=0.0).to(ACC)
    dh = dy * gelu_grad(h, APPROX)
    tl.store(tile_ptrs(dh_ptr, offs_m, offs_n, s_dhm, 1), dh.to(dh_ptr.dtype.element_ty),
             mask=mask)
    if COL_SUMS:
        store_column_sums(part_ptr, tl.program_id(0), offs_n, N, dh)


# ---------------------------------------------------------------- TMA (Hopper) versions


@device_fn
def _bias_gelu_store(acc, off_m, off_n, b_ptr, y_desc, h_desc, N, HAS_BIAS: tl.constexpr,
                     STORE_H: tl.constexpr, APPROX: tl.constexpr):
    """Epilogue of one column half: + bias, store h (if asked), store gelu(h)."""
    if HAS_BIAS:
        offs_n = off_n + tl.arange(0, acc.shape[1])
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(acc.dtype)[None, :]
    if STORE_H:
        h_desc.store([off_m, off_n], acc.to(h_desc.dtype))
    y_desc.store([off_m, off_n], gelu(acc, APPROX).to(y_desc.dtype))


@fast_launch
@triton.jit
def _linear_gelu_fwd_tma_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, h_ptr, M, N, K, s_xm, s_wn, s_ym, s_hm,
    HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, APPROX: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    x_desc = matrix_desc(x_ptr, M, K, s_xm, BLOCK_M, BLOCK_K)
    w_desc = matrix_desc(w_ptr, N, K, s_wn, BLOCK_N, BLOCK_K)
    y_desc = matrix_desc(y_ptr, M, N, s_ym, BLOCK_M, BLOCK_N // 2)
    h_desc = matrix_desc(h_ptr, M, N, s_hm, BLOCK_M, BLOCK_N // 2)
    tiles = cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        off_m, off_n = tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        left, right = tile_halves(x_desc, w_desc, off_m, off_n, K, ACC, PRECISION, BLOCK_M,
                                  BLOCK_N, BLOCK_K, B_TRANS=True)
        _bias_gelu_store(left, off_m, off_n, b_ptr, y_desc, h_desc, N,
                         HAS_BIAS, STORE_H, APPROX)
        _bias_gelu_store(right, off_m, off_n + BLOCK_N // 2, b_ptr, y_desc, h_desc, N,
                         HAS_BIAS, STORE_H, APPROX)


@device_fn
def _dgelu_store(acc, off_m, off_n, h_desc, dh_desc, part_ptr, N, APPROX: tl.constexpr,
                 COL_SUMS: tl.constexpr):
    """Epilogue of one column half: dh = acc * gelu'(h), h read back through TMA; with
    COL_SUMS, dh's column sums (before rounding) into row off_m / BLOCK_M of part_ptr.
    Rows past M are zero: dy's and h's TMA loads read zeros there."""
    h = h_desc.load([off_m, off_n]).to(acc.dtype)
    dh = acc * gelu_grad(h, APPROX)
    dh_desc.store([off_m, off_n], dh.to(dh_desc.dtype))
    if COL_SUMS:
        store_column_sums(part_ptr, off_m // acc.shape[0], off_n + tl.arange(0, acc.shape[1]),
                          N, dh)


@fast_launch
@triton.jit
def _matmul_dgelu_tma_kernel(
    dy_ptr, w_ptr, h_ptr, dh_ptr, part_ptr, M, N, K, s_dym, s_wk, s_hm, s_dhm,
    COL_SUMS: tl.constexpr, APPROX: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    dy_desc = matrix_desc(dy_ptr, M, K, s_dym, BLOCK_M, BLOCK_K)
    w_desc = matrix_desc(w_ptr, K, N, s_wk, BLOCK_K, BLOCK_N)
    h_desc = matrix_desc(h_ptr, M, N, s_hm, BLOCK_M, BLOCK_N // 2)
    dh_desc = matrix_desc(dh_ptr, M, N, s_dhm, BLOCK_M, BLOCK_N // 2)
    tiles = cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        off_m, off_n = tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        left, right = tile_halves(dy_desc, w_desc, off_m, off_n, K, ACC, PRECISION, BLOCK_M,
                                  BLOCK_N, BLOCK_K)
        _dgelu_store(left, off_m, off_n, h_desc, dh_desc, part_ptr, N, APPROX, COL_SUMS)
        _dgelu_store(right, off_m, off_n + BLOCK_N // 2, h_desc, dh_desc, part_ptr, N,
                     APPROX, COL_SUMS)


@device_fn
def _gelu_rhs_piece(h_desc, dy_desc, c_desc, s, tile, k0, k_len, M, N,
                    STREAM_K: tl.constexpr, APPROX: tl.constexpr, ACC: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile `tile` of C.T over k in [k0, k0 + k_len): added into C[0] (STREAM_K) or
    stored as slice s of C."""
    off_n, off_m = tile_origin(tile, N, M, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tma_matmul(h_desc, dy_desc, off_n, off_m, k0, k_len, ACC, PRECISION,
                     BLOCK_M, BLOCK_N, BLOCK_K, A_TRANS=True, A_GELU=True, APPROX=APPROX)
    top, bottom = column_halves(tl.trans(acc), BLOCK_N, BLOCK_M)
    if STREAM_K:
        reduce_tile(c_desc, [0, off_m, off_n], top[None, :, :])
        reduce_tile(c_desc, [0, off_m, off_n + BLOCK_M // 2], bottom[None, :, :])
    else:
        c_desc.store([s, off_m, off_n], top.to(c_desc.dtype)[None, :, :])
        c_desc.store([s, off_m, off_n + BLOCK_M // 2], bottom.to(c_desc.dtype)[None, :, :])


@fast_launch
@triton.jit
def _matmul_gelu_rhs_tma_kernel(
    h_ptr, dy_ptr, c_ptr, M, N, K, K_SPLIT, SPLITS, s_hk, s_dyk, s_cs, s_cm,
    STREAM_K: tl.constexpr, APPROX: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Computes C.T = gelu(h).T @ dy, whose recomputed operand is A (see tma_matmul), one
    # (BLOCK_M features of h) x (BLOCK_N features of dy) tile at a time, stored transposed.
    # STREAM_K: the programs share out the (tile, k step) pairs, tile after tile, in equal
    # runs; each piece of a tile a run holds adds into C (1, M, N) (fp32, zeroed by the
    # host) by TMA bulk reductions. Every SM gets the same MMA work (at gpt2's dW2, 72
    # tiles for 132 SMs) and at most two or three tile epilogues, where equal split-K
    # slices gave some SMs more work items than others and each item its own epilogue.
    # Otherwise work item w = (slice s, tile) reduces k in [s * K_SPLIT, (s + 1) * K_SPLIT)
    # into slice s of C (SPLITS, M, N); K_SPLIT is a multiple of BLOCK_K.
    h_desc = matrix_desc(h_ptr, K, N, s_hk, BLOCK_K, BLOCK_M)
    dy_desc = matrix_desc(dy_ptr, K, M, s_dyk, BLOCK_K, BLOCK_N)
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[SPLITS, M, N], strides=[s_cs, s_cm, 1],
                                       block_shape=[1, BLOCK_N, BLOCK_M // 2])
    tiles = cdiv(N, BLOCK_M) * cdiv(M, BLOCK_N)
    if STREAM_K:
        k_steps = cdiv(K, BLOCK_K)
        units = tiles.to(tl.int64) * k_steps
        u = tl.program_id(0) * units // tl.num_programs(0)
        end = (tl.program_id(0) + 1) * units // tl.num_programs(0)
        while u < end:
            step = u % k_steps
            run = tl.minimum(k_steps - step, end - u)
            k0 = (step * BLOCK_K).to(tl.int32)
            _gelu_rhs_piece(h_desc, dy_desc, c_desc, 0, (u // k_steps).to(tl.int32), k0,
                            tl.minimum(K - k0, (run * BLOCK_K).to(tl.int32)), M, N, STREAM_K,
                            APPROX, ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
            u += run
    else:
        for w in tl.range(tl.program_id(0), tiles * SPLITS, tl.num_programs(0), flatten=True):
            s = w // tiles
            k0 = s * K_SPLIT
            _gelu_rhs_piece(h_desc, dy_desc, c_desc, s, w % tiles, k0,
                            tl.minimum(K - k0, K_SPLIT), M, N, STREAM_K, APPROX, ACC,
                            PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


# gelu_bwd's tile: 8K elements, 32 per thread at 8 warps; 64 rows make the partial-sum
# buffer 1/64 of dh (256 rows at 16384 tokens: one short column-sum launch).
_GELU_BWD_TILE = (64, 128)

def _gemm_grid(M: int, N: int):
    return lambda meta: (ceil_div(M, meta["BLOCK_M"]) * ceil_div(N, meta["BLOCK_N"]),)


def _fwd_plan(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, has_bias: bool,
              approximate: str, store_h: bool, config: TmaConfig | None) -> tuple:
    """(path, constexprs, TMA config or None) of linear_gelu_fwd."""
    K, N = x.shape[1], weight.shape[0]
    flags = dict(HAS_BIAS=has_bias, STORE_H=store_h, **gemm_flags(x, approximate))
    # The warp-specialised kernel where measured faster: at N >= K (H200: 141 against 159
    # us at 16384 x 768 x 3072, 886 against 914-1171 at 16384 x 2048 x 8192); at
    # 16384 x 3072 x 768 it took 136 us against the Triton kernel's 124-126.
    if config is None and N >= K and gluon_ok(x, weight, y):
        return "gluon", flags, None
    if tma_ok(x, weight, y):
        return "tma", flags, config or tma_config(N)
    return "pointer", flags, None


def linear_gelu_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    approximate: str, store_h: bool,
                    config: TmaConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: (M, K), weight: (N, K), bias: (N,) -> (y, h), both (M, N); h is None unless store_h.
    `config` overrides the TMA tile table (for tuning)."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    h = torch.empty(M, N, device=x.device, dtype=x.dtype) if store_h else None
    h_arg = h if store_h else stand_in(y)  # never written when STORE_H is off
    b_arg = bias if bias is not None else x
    key = None if config else (*operand_signature("fwd", x, weight), bias is None, approximate,
                               store_h)
    path, flags, cfg = plan_once(key, lambda: _fwd_plan(x, weight, y, bias is not None,
                                                    approximate, store_h, config))
    if path == "gluon":
        from fusedtrain.kernels import linear_gelu_gluon  # Gluon: imported where it compiles

        linear_gelu_gluon.linear_gelu_fwd(x, weight, bias, y, h, flags["APPROX"], key)
    elif path == "tma":
        tiles = ceil_div(M, cfg.block_m) * ceil_div(N, cfg.block_n)
        launch(_linear_gelu_fwd_tma_kernel, tiles, x.device,
               x, weight, b_arg, y, h_arg, M, N, K,
               x.stride(0), weight.stride(0), N, N, config=cfg, key=key, **flags)
    else:
        _linear_gelu_fwd_kernel.planned(key, (
            x, weight, b_arg, y, h_arg, M, N, K, x.stride(0), x.stride(1),
            weight.stride(0), weight.stride(1), N, 1, N, 1), lambda: (_gemm_grid(M, N), flags))
    return y, h


def _tile_column_sums(dh: torch.Tensor, block_m: int) -> torch.Tensor:
    """The buffer of dh's column sums per block_m rows that a dGELU kernel writes:
    (cdiv(M, block_m), N) in dh's statistics dtype (fp32; fp64 for fp64)."""
    return torch.empty(ceil_div(dh.shape[0], block_m), dh.shape[1], device=dh.device,
                       dtype=stat_dtype(dh))


def _dgelu_plan(dy: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, approximate: str,
                config: TmaConfig | None) -> tuple:
    """(path, constexprs, TMA config or None) of matmul_dgelu."""
    flags = gemm_flags(dy, approximate)
    if config is None and gluon_ok(dy, w2, h):
        return "gluon", flags, None
    if tma_ok(dy, w2, h):
        return "tma", flags, config or tma_config(w2.shape[1])
    return "pointer", flags, None


def matmul_dgelu(dy: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, approximate: str,
                 sums_dtype: torch.dtype | None = None,
                 config: TmaConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dy: (M, N2), w2: (N2, N), h: (M, N) -> (dh, db): dh = (dy @ w2) * gelu'(h): (M, N),
    and with a sums_dtype db = dh.sum(0): (N,) in it, accumulated in fp32 (fp64), else
    None.

    Through TMA the GEMM's epilogue sums each tile's columns, so dh is not read again; the
    pointer version sums dh afterwards."""
    M, K = dy.shape
    N = w2.shape[1]
    dh = torch.empty(M, N, device=dy.device, dtype=dy.dtype)
    col_sums = sums_dtype is not None
    key = None if config else (*operand_signature("dgelu", dy, w2, h), approximate, col_sums)
    path, flags, cfg = plan_once(key, lambda: _dgelu_plan(dy, w2, h, approximate, config))
    if path == "gluon":
        from fusedtrain.kernels import gemm_gluon, linear_gelu_gluon

        parts = _tile_column_sums(dh, gemm_gluon.BM.value) if col_sums else None
        linear_gelu_gluon.matmul_dgelu(dy, w2, h, dh, parts, flags["APPROX"], key)
        return dh, bias_grad(parts, sums_dtype) if col_sums else None
    if path == "tma":
        tiles = ceil_div(M, cfg.block_m) * ceil_div(N, cfg.block_n)
        parts = _tile_column_sums(dh, cfg.block_m) if col_sums else dh  # dh: never written
        launch(_matmul_dgelu_tma_kernel, tiles, dy.device, dy, w2, h, dh, parts, M, N, K,
               dy.stride(0), w2.stride(0), h.stride(0), N, config=cfg, key=key,
               COL_SUMS=col_sums, **flags)
        return dh, bias_grad(parts, sums_dtype) if col_sums else None
    _matmul_dgelu_kernel.planned(key, (
        dy, w2, h, dh, M, N, K, dy.stride(0), dy.stride(1), w2.stride(0), w2.stride(1),
        h.stride(0), h.stride(1), N, 1), lambda: (_gemm_grid(M, N), flags))
    return dh, bias_grad(dh, sums_dtype) if col_sums else None


def _gelu_rhs_plan(dy: torch.Tensor, h: torch.Tensor, approximate: str,
                   out_dtype: torch.dtype, splits: int | None,
                   config: TmaConfig | None) -> tuple:
    """(use_tma, config, tiles, splits, k_split, stream_k, partial-sum dtype, constexprs,
    programs) of matmul_gelu_rhs."""
    K, M = dy.shape
    N = h.shape[1]
    # With h TMA-aligned and dy of its dtype, an (S, M, N) output of dy's or a wider dtype
    # is TMA-aligned too.
    use_tma = tma_ok(dy, h) and dy.dtype == h.dtype
    cfg = config or tma_config(M)
    tiles = (ceil_div(N, cfg.block_m) * ceil_div(M, cfg.block_n) if use_tma
             else ceil_div(M, 128) * ceil_div(N, 128))
    splits = splits or k_splits(tiles, K, dy.device, cfg.per_sm if use_tma else 1)
    k_split = ceil_div(ceil_div(K, splits), 128) * 128  # a multiple of any BLOCK_K
    splits = ceil_div(K, k_split)
    stream_k = use_tma and splits > 1 and not torch.are_deterministic_algorithms_enabled()
    part_dtype = out_dtype if splits == 1 else stat_dtype(dy)
    # Under the interpreter (one program by default) one program a slice, so that the
    # stream-K runs end inside tiles there too.
    programs = splits if INTERPRET and stream_k else None
    return (use_tma, cfg, tiles, splits, k_split, stream_k, part_dtype,
            gemm_flags(dy, approximate), programs)


def matmul_gelu_rhs(dy: torch.Tensor, h: torch.Tensor, approximate: str,
                    out_dtype: torch.dtype | None = None, splits: int | None = None,
                    config: TmaConfig | None = None) -> torch.Tensor:
    """dy: (K, M), h: (K, N) -> dy.T @ gelu(h): (M, N) in out_dtype (default dy's), reduced
    in fp32 over `splits` slices of K (default: k_splits; 1 when whole tiles fill the GPU).

    Split through TMA, the work is shared out stream-K (see the kernel) and the pieces add
    into one fp32 sum in place (bulk reductions in L2), whose order, and so whose last bits,
    vary run to run; under torch's deterministic mode, and in the pointer version, each
    slice writes its own partial sum and the host adds them."""
    K, M = dy.shape
    N = h.shape[1]
    out_dtype = out_dtype or dy.dtype
    key = None if config else (*operand_signature("gelu_rhs", dy, h), approximate, out_dtype,
                               splits, torch.are_deterministic_algorithms_enabled())
    use_tma, cfg, tiles, splits, k_split, stream_k, part_dtype, flags, programs = plan_once(
        key, lambda: _gelu_rhs_plan(dy, h, approximate, out_dtype, splits, config))
    if stream_k:
        out = torch.zeros(1, M, N, device=dy.device, dtype=part_dtype)
    else:
        out = torch.empty(splits, M, N, device=dy.device, dtype=part_dtype)
    if use_tma:
        launch(_matmul_gelu_rhs_tma_kernel, tiles * splits, dy.device, h, dy, out,
               M, N, K, k_split, splits, h.stride(0), dy.stride(0), M * N, N,
               config=cfg, programs=programs, key=key, STREAM_K=stream_k, **flags)
    else:
        _matmul_gelu_rhs_kernel.planned(key, (
            dy, h, out, M, N, K, k_split, dy.stride(1), dy.stride(0), h.stride(0),
            h.stride(1), M * N, N, 1), lambda: (
                lambda meta: (_gemm_grid(M, N)(meta)[0], splits), flags))
    if splits == 1:
        return out.view(M, N)
    total = out.view(M, N) if stream_k else out.sum(0)
    return total if total.dtype == out_dtype else total.to(out_dtype)


def gelu_bwd(dy: torch.Tensor, h: torch.Tensor, approximate: str,
             sums_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dy, h: (M, N) -> (dh, db): dh = dy * gelu'(h), and with a sums_dtype db = dh.sum(0):
    (N,) in it (accumulated in fp32, fp64), from the kernel's tiles, else None."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    if h.stride(-1) != 1:
        h = h.contiguous()
    M, N = h.shape
    dh = torch.empty(M, N, device=h.device, dtype=h.dtype)
    block_m, block_n = _GELU_BWD_TILE
    col_sums = sums_dtype is not None
    parts = _tile_column_sums(dh, block_m) if col_sums else dh  # dh: never written as parts
    s_dy, s_h = dy.stride(0), h.stride(0)
    _gelu_bwd_kernel.planned(
        (M, N, s_dy, s_h, dy.dtype, h.dtype, col_sums, approximate),
        (dy, h, dh, parts, M, N, s_dy, s_h, N),
        lambda: ((ceil_div(M, block_m), ceil_div(N, block_n)), dict(
            COL_SUMS=col_sums, APPROX=gelu_mode(approximate, h), ACC=acc_dtype(h),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)))
    return dh, bias_grad(parts, sums_dtype) if col_sums else None
