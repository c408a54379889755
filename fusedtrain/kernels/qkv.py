"""Fused QKV projection kernels: one GEMM over W_qkv = [Wq|Wk|Wv] ((H + 2 HK) D, C) whose
epilogue writes q (B, H, T, D) and k, v (B, HK, T, D) straight into the head-split layout,
q and k rotated there with rotary embeddings (ROPE); and a backward that reads dq, dk, dv
in place from that layout (no concatenation, no transpose copies), for equal head counts.

Index maps used throughout, with M = B*T tokens and the output features split into
segments s in {q, k, v} of CQ = H*D and CKV = HK*D features:
  token m   -> (b, t) = (m // T, m % T)
  feature c -> (h, d) = (c // D, c % D)        within segment s
Every program works inside one segment, so its q/k/v pointer is a scalar choice.
The forward and dx GEMMs have a persistent TMA version (kernels/_tma.py: Hopper, 16-bit,
aligned operands; tiles from its measured table) beside the pointer-based one used for
everything else (block sizes: triton.autotune over the shared tilings, keyed on the
sizes). The rotation needs each pair (d, d + D/2) in one tile: the TMA forward has it
where a tile's halves are whole heads, the pointer forward by loading the W rows of the
pairs' two halves into the tile's two halves. On an sm_90 GPU the forward runs instead
as a warp-specialised Gluon kernel (qkv_gluon), whose epilogue (bias, rotation, head
stores) overlaps the MMAs, where its tiles fit the heads (qkv_gluon.fits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels._device import ceil_div, stat_dtype
from fusedtrain.kernels._gemm import (
    INTERPRET_GEMM,
    WIDE_GEMM,
    gemm_configs,
    gemm_flags,
    grouped_tile,
    matmul_acc,
)
from fusedtrain.kernels._launch import fast_launch
from fusedtrain.kernels._primitives import cdiv, device_fn, pick3, sin_cos
from fusedtrain.kernels._tma import (
    GLUON_EPILOGUE_MAX_K,
    TmaConfig,
    column_halves,
    column_join,
    gluon_ok,
    k_splits,
    launch,
    matrix_desc,
    tile_origin,
    tma_config,
    tma_matmul,
    tma_ok,
)
from fusedtrain.kernels._tuning import autotune
from fusedtrain.kernels.rope import inv_freq


@device_fn
def _add_bias(acc, b_ptr, row0, offs_c, width, HAS_BIAS: tl.constexpr):
    """acc (rows, len(offs_c)) + the bias of the segment whose rows of W start at row0,
    at its features offs_c (< width)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + row0 + offs_c, mask=offs_c < width, other=0.0).to(acc.dtype)[None, :]
    return acc


@device_fn
def _segment_of(pid_n, tiles_q, tiles_kv):
    """(segment, its column tile) of output column tile pid_n: q's tiles_q tiles first,
    then k's and v's tiles_kv each."""
    rest = tl.maximum(pid_n - tiles_q, 0)
    in_q = pid_n < tiles_q
    return tl.where(in_q, 0, 1 + rest // tiles_kv), tl.where(in_q, pid_n, rest % tiles_kv)


@device_fn
def _tile_features(j, seg, D, ROPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The features c = h * D + d of segment seg that its column tile j computes: BLOCK_N
    in a row; with ROPE, in q and k, BLOCK_N // 2 rotation pairs (counted over the heads'
    dims d < D/2), their dims d in the tile's first half and the partners d + D/2 in its
    second, so that the epilogue rotates the accumulator's halves against each other."""
    idx = tl.arange(0, BLOCK_N)
    plain = j * BLOCK_N + idx
    if ROPE:
        half = D // 2
        pair = j * (BLOCK_N // 2) + idx % (BLOCK_N // 2)
        paired = (pair // half) * D + pair % half + (idx // (BLOCK_N // 2)) * half
        return tl.where(seg < 2, paired, plain)
    return plain


@device_fn
def _rotate_halves(acc, offs_m, pos_ptr, freq_ptr, dims, M, T, POSITIONS: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N), rows the tokens offs_m, column j < BLOCK_N/2 dim dims[j]
    (< D/2) of a head and column j + BLOCK_N/2 its partner dims[j] + D/2 -> the pairs
    rotated by the angle p * inv_freq[dims[j]], p = positions[m] (default m % T), in the
    accumulator's precision (kernels.rope's formula)."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    BLOCK_N: tl.constexpr = acc.shape[1]
    x1, x2 = column_halves(acc, BLOCK_M, BLOCK_N)
    p = tl.load(pos_ptr + offs_m, mask=offs_m < M, other=0) if POSITIONS else offs_m % T
    angle = p.to(acc.dtype)[:, None] * tl.load(freq_ptr + dims)[None, :]
    sin, cos = sin_cos(angle)
    return column_join(x1 * cos - x2 * sin, x2 * cos + x1 * sin, BLOCK_M, BLOCK_N)


@device_fn
def _store_heads(acc, offs_m, offs_c, seg, q_ptr, k_ptr, v_ptr, M, width, T, D,
                 s_ob, s_oh, s_ot, s_od):
    """Rows m = (b, t) and features c = (h, d) < width of segment seg stored at q, k or
    v[b, h, t, d]."""
    m_ok, c_ok = offs_m < M, offs_c < width
    b = offs_m.to(tl.int64) // T
    t = offs_m.to(tl.int64) % T
    dst = (pick3(seg, q_ptr, k_ptr, v_ptr) + (b * s_ob + t * s_ot)[:, None]
           + ((offs_c // D).to(tl.int64) * s_oh + (offs_c % D) * s_od)[None, :])
    tl.store(dst, acc.to(q_ptr.dtype.element_ty), mask=m_ok[:, None] & c_ok[None, :])


@autotune(gemm_configs(), key=["M", "CQ", "CKV"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _qkv_fwd_kernel(
    x_ptr, w_ptr, b_ptr, pos_ptr, freq_ptr, q_ptr, k_ptr, v_ptr, M, CQ, CKV, T, D,
    s_xb, s_xt, s_xc, s_w0, s_w1, s_qb, s_kb, s_oh, s_ot, s_od,
    HAS_BIAS: tl.constexpr, ROPE: tl.constexpr, POSITIONS: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # CQ = H * D features of q, CKV = HK * D of k and of v; k, v share strides.
    tiles_q, tiles_kv = cdiv(CQ, BLOCK_N), cdiv(CKV, BLOCK_N)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, (tiles_q + 2 * tiles_kv) * BLOCK_N,
                                BLOCK_M, BLOCK_N, GROUP_M)
    seg, j = _segment_of(pid_n, tiles_q, tiles_kv)
    width = tl.where(seg == 0, CQ, CKV)
    row0 = tl.where(seg == 0, 0, CQ + (seg - 1) * CKV)  # the segment's first row of W
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = _tile_features(j, seg, D, ROPE, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    # out[m, c] = sum_j x[b, t, j] * W[row0 + c, j]
    acc = matmul_acc(acc, x_ptr, w_ptr, (offs_m.to(tl.int64) // T) * s_xb
                     + (offs_m.to(tl.int64) % T) * s_xt, (row0 + offs_c).to(tl.int64) * s_w0,
                     offs_m < M, offs_c < width, 1, CQ, 0, s_xc, 0, s_w1, BLOCK_K, PRECISION)
    acc = _add_bias(acc, b_ptr, row0, offs_c, width, HAS_BIAS)
    if ROPE:  # noqa: SIM102 (a constexpr test of its own: no rotation code without ROPE)
        if seg < 2:
            dims = (j * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)) % (D // 2)
            acc = _rotate_halves(acc, offs_m, pos_ptr, freq_ptr, dims, M, T, POSITIONS)
    _store_heads(acc, offs_m, offs_c, seg, q_ptr, k_ptr, v_ptr, M, width, T, D,
                 tl.where(seg == 0, s_qb, s_kb), s_oh, s_ot, s_od)


@autotune(gemm_configs(), key=["M", "C"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _qkv_dx_kernel(
    dq_ptr, dk_ptr, dv_ptr, w_ptr, dx_ptr, M, C, T, H, D,
    s_ob, s_oh, s_ot, s_od, s_w0, s_w1, s_dxb, s_dxt, s_dxc,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, C, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < C
    b = offs_m.to(tl.int64) // T
    t = offs_m.to(tl.int64) % T
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    # dx[m, n] = sum_s sum_(h, d) dseg[b, h, t, d] * W[s*C + h*D + d, n]
    for seg in tl.static_range(3):
        src = pick3(seg, dq_ptr, dk_ptr, dv_ptr)
        w_seg = w_ptr + seg * C * s_w0
        acc = matmul_acc(acc, src, w_seg, b * s_ob + t * s_ot, offs_n.to(tl.int64) * s_w1,
                         m_ok, n_ok, H, D, s_oh, s_od, D * s_w0, s_w0, BLOCK_K, PRECISION)
    dst = dx_ptr + (b * s_dxb + t * s_dxt)[:, None] + offs_n.to(tl.int64)[None, :] * s_dxc
    tl.store(dst, acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@autotune(gemm_configs(), key=["M", "C"], interpret=INTERPRET_GEMM, wide=WIDE_GEMM)
@triton.jit
def _qkv_dw_kernel(
    dq_ptr, dk_ptr, dv_ptr, x_ptr, dw_ptr, M, C, B, T, D,
    s_ob, s_oh, s_ot, s_od, s_xb, s_xt, s_xc, s_dw0, s_dw1,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tiles_per_seg = cdiv(C, BLOCK_M)
    pid_m, pid_n = grouped_tile(tl.program_id(0), 3 * tiles_per_seg * BLOCK_M, C,
                                BLOCK_M, BLOCK_N, GROUP_M)
    seg = pid_m // tiles_per_seg
    offs_r = (pid_m % tiles_per_seg) * BLOCK_M + tl.arange(0, BLOCK_M)  # feature (h, d)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok, n_ok = offs_r < C, offs_n < C
    src = pick3(seg, dq_ptr, dk_ptr, dv_ptr)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    # dW[s*C + r, n] = sum_(b, t) dseg[b, h(r), t, d(r)] * x[b, t, n]
    acc = matmul_acc(acc, src, x_ptr,
                     (offs_r // D).to(tl.int64) * s_oh + (offs_r % D) * s_od,
                     offs_n.to(tl.int64) * s_xc, r_ok, n_ok,
                     B, T, s_ob, s_ot, s_xb, s_xt, BLOCK_K, PRECISION)
    rows = (seg * C + offs_r).to(tl.int64)
    dst = dw_ptr + rows[:, None] * s_dw0 + offs_n.to(tl.int64)[None, :] * s_dw1
    tl.store(dst, acc.to(dw_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------- TMA (Hopper) versions


@device_fn
def _rotated_head(head, off_m, pos_ptr, freq_ptr, M, T, ROTATE: tl.constexpr,
                  POSITIONS: tl.constexpr):
    """One head's (BLOCK_M, D) block for tokens off_m.., rotated if ROTATE (_rotate_halves:
    dims d < D/2 are its first half)."""
    if ROTATE:
        BLOCK_M: tl.constexpr = head.shape[0]
        HALF: tl.constexpr = head.shape[1] // 2
        return _rotate_halves(head, off_m + tl.arange(0, BLOCK_M), pos_ptr, freq_ptr,
                              tl.arange(0, HALF), M, T, POSITIONS)
    return head


@device_fn
def _store_head_blocks(half, off_m, off_c, row0, b_ptr, pos_ptr, freq_ptr, o_desc, M, width,
                       T, H, HAS_BIAS: tl.constexpr, ROTATE: tl.constexpr,
                       POSITIONS: tl.constexpr, HEAD_D: tl.constexpr):
    """The TMA form of _store_heads: half (BLOCK_M, WIDTH), the features [off_c, off_c +
    WIDTH) of the segment whose W rows start at row0 (one or two whole heads: WIDTH =
    HEAD_D or 2 * HEAD_D) for tokens [off_m, off_m + BLOCK_M) of one sequence, + bias, each
    head rotated if ROTATE; each head's block is a box of q, k or v viewed as a (B*H*T, D)
    matrix (o_desc), written by one bulk copy."""
    BLOCK_M: tl.constexpr = half.shape[0]
    WIDTH: tl.constexpr = half.shape[1]
    half = _add_bias(half, b_ptr, row0, off_c + tl.arange(0, WIDTH), width, HAS_BIAS)
    row = ((off_m // T) * H + off_c // HEAD_D) * T + off_m % T  # (b, h, t0)
    if WIDTH == HEAD_D:
        half = _rotated_head(half, off_m, pos_ptr, freq_ptr, M, T, ROTATE, POSITIONS)
        o_desc.store([row, 0], half.to(o_desc.dtype))
    else:
        first, second = column_halves(half, BLOCK_M, WIDTH)
        first = _rotated_head(first, off_m, pos_ptr, freq_ptr, M, T, ROTATE, POSITIONS)
        second = _rotated_head(second, off_m, pos_ptr, freq_ptr, M, T, ROTATE, POSITIONS)
        o_desc.store([row, 0], first.to(o_desc.dtype))
        o_desc.store([row + T, 0], second.to(o_desc.dtype))  # the next head


@device_fn
def _segment_first(before):
    """The first of a segment's tiles this program takes, stepping by the program count,
    when all segments' tiles are dealt as one sequence and `before` tiles precede this
    segment's, so that each program gets what one persistent loop over all of them would
    give it."""
    n_progs = tl.num_programs(0)
    return (tl.program_id(0) + n_progs - before % n_progs) % n_progs


@device_fn
def _segment_tma(x_desc, w_desc, b_ptr, pos_ptr, freq_ptr, o_ptr, row0, before, M, width, C,
                 T, H, HAS_BIAS: tl.constexpr, ROTATE: tl.constexpr, POSITIONS: tl.constexpr,
                 HEAD_D: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """This program's share (_segment_first) of the output tiles of one segment (q, k or v:
    H heads, `width` = H * HEAD_D features, W rows from row0), stored by
    _store_head_blocks."""
    o_desc = matrix_desc(o_ptr, M * H, HEAD_D, HEAD_D, BLOCK_M, HEAD_D)
    tiles = cdiv(M, BLOCK_M) * cdiv(width, BLOCK_N)
    for tile in tl.range(_segment_first(before), tiles, tl.num_programs(0), flatten=True):
        off_m, off_c = tile_origin(tile, M, width, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tma_matmul(x_desc, w_desc, off_m, row0 + off_c, 0, C, ACC, PRECISION,
                         BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS=True)
        left, right = column_halves(acc, BLOCK_M, BLOCK_N)
        _store_head_blocks(left, off_m, off_c, row0, b_ptr, pos_ptr, freq_ptr, o_desc, M,
                           width, T, H, HAS_BIAS, ROTATE, POSITIONS, HEAD_D)
        _store_head_blocks(right, off_m, off_c + BLOCK_N // 2, row0, b_ptr, pos_ptr, freq_ptr,
                           o_desc, M, width, T, H, HAS_BIAS, ROTATE, POSITIONS, HEAD_D)


@fast_launch
@triton.jit
def _qkv_fwd_tma_kernel(
    x_ptr, w_ptr, b_ptr, pos_ptr, freq_ptr, q_ptr, k_ptr, v_ptr, M, CQ, CKV, T, H, HK, D,
    s_xm, s_w0, s_qb, s_kb, s_oh, s_ot, s_od,
    HAS_BIAS: tl.constexpr, ROPE: tl.constexpr, POSITIONS: tl.constexpr, HEAD_D: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # x viewed as (M, CQ) tokens; q has H heads (CQ features), k and v HK (CKV each).
    # HEAD_D = D > 0 (contiguous q, k, v; T % BLOCK_M == 0, CQ and CKV multiples of BLOCK_N,
    # D = BLOCK_N / 2 or / 4): one loop per segment, each head's block leaving through TMA,
    # q's and k's rotated under ROPE. (Per segment, so that the store's descriptor is fixed:
    # a run-time choice among three inside one flattened loop fails Triton 3.6's
    # loop-fusion pass.)
    # HEAD_D = 0 (never with ROPE): one loop over all tiles, masked pointer stores; a tile's
    # W rows may run past its segment's end when its width is no multiple of BLOCK_N, and
    # those columns are masked.
    x_desc = matrix_desc(x_ptr, M, CQ, s_xm, BLOCK_M, BLOCK_K)
    w_desc = matrix_desc(w_ptr, CQ + 2 * CKV, CQ, s_w0, BLOCK_N, BLOCK_K)
    if HEAD_D > 0:
        q_tiles = cdiv(M, BLOCK_M) * cdiv(CQ, BLOCK_N)
        kv_tiles = cdiv(M, BLOCK_M) * cdiv(CKV, BLOCK_N)
        _segment_tma(x_desc, w_desc, b_ptr, pos_ptr, freq_ptr, q_ptr, 0, 0, M, CQ, CQ, T, H,
                     HAS_BIAS, ROPE, POSITIONS, HEAD_D, ACC, PRECISION, BLOCK_M, BLOCK_N,
                     BLOCK_K, GROUP_M)
        _segment_tma(x_desc, w_desc, b_ptr, pos_ptr, freq_ptr, k_ptr, CQ, q_tiles, M, CKV, CQ,
                     T, HK, HAS_BIAS, ROPE, POSITIONS, HEAD_D, ACC, PRECISION, BLOCK_M,
                     BLOCK_N, BLOCK_K, GROUP_M)
        _segment_tma(x_desc, w_desc, b_ptr, pos_ptr, freq_ptr, v_ptr, CQ + CKV,
                     q_tiles + kv_tiles, M, CKV, CQ, T, HK, HAS_BIAS, False, POSITIONS, HEAD_D,
                     ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        tiles_q, tiles_kv = cdiv(CQ, BLOCK_N), cdiv(CKV, BLOCK_N)
        tiles = cdiv(M, BLOCK_M) * (tiles_q + 2 * tiles_kv)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
            pid_m, pid_n = grouped_tile(tile, M, (tiles_q + 2 * tiles_kv) * BLOCK_N, BLOCK_M,
                                        BLOCK_N, GROUP_M)
            seg, j = _segment_of(pid_n, tiles_q, tiles_kv)
            width = tl.where(seg == 0, CQ, CKV)
            row0 = tl.where(seg == 0, 0, CQ + (seg - 1) * CKV)
            off_m, off_c = pid_m * BLOCK_M, j * BLOCK_N
            acc = tma_matmul(x_desc, w_desc, off_m, row0 + off_c, 0, CQ, ACC, PRECISION,
                             BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS=True)
            left, right = column_halves(acc, BLOCK_M, BLOCK_N)
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_c = off_c + tl.arange(0, BLOCK_N // 2)
            s_ob = tl.where(seg == 0, s_qb, s_kb)
            left = _add_bias(left, b_ptr, row0, offs_c, width, HAS_BIAS)
            _store_heads(left, offs_m, offs_c, seg, q_ptr, k_ptr, v_ptr, M, width, T, D,
                         s_ob, s_oh, s_ot, s_od)
            right = _add_bias(right, b_ptr, row0, offs_c + BLOCK_N // 2, width, HAS_BIAS)
            _store_heads(right, offs_m, offs_c + BLOCK_N // 2, seg, q_ptr, k_ptr, v_ptr, M,
                         width, T, D, s_ob, s_oh, s_ot, s_od)


@device_fn
def _head_rows_matmul(acc, g_desc, w_desc, row0, T, D, w_row0, off_n, C,
                      BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """acc += g[b, :, t0:t0 + BLOCK_M, :] (as a (BLOCK_M, C) matrix of heads side by side)
    @ W[w_row0:w_row0 + C, off_n:off_n + BLOCK_N]; g_desc views g (B, H, T, D) as rows
    (b*H + h)*T + t, and row0 is the tile's (b, 0, t0) row."""
    for k in range(0, C, BLOCK_K):
        a = g_desc.load([row0 + (k // D) * T, k % D])
        acc = tl.dot(a, w_desc.load([w_row0 + k, off_n]), acc, input_precision=PRECISION,
                     out_dtype=acc.dtype)
    return acc


@fast_launch
@triton.jit
def _qkv_dx_tma_kernel(
    dq_ptr, dk_ptr, dv_ptr, w_ptr, dx_ptr, M, C, T, H, D, s_w0, s_dxm,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # dx[m, n] = sum_s sum_(h, d) dseg[b, h, t, d] * W[s*C + h*D + d, n]. Needs contiguous
    # dq, dk, dv, T % BLOCK_M == 0 (a row tile stays in one sequence) and D % BLOCK_K == 0
    # (a k tile stays in one head).
    rows = M * H
    dq_desc = matrix_desc(dq_ptr, rows, D, D, BLOCK_M, BLOCK_K)
    dk_desc = matrix_desc(dk_ptr, rows, D, D, BLOCK_M, BLOCK_K)
    dv_desc = matrix_desc(dv_ptr, rows, D, D, BLOCK_M, BLOCK_K)
    w_desc = matrix_desc(w_ptr, 3 * C, C, s_w0, BLOCK_K, BLOCK_N)
    dx_desc = matrix_desc(dx_ptr, M, C, s_dxm, BLOCK_M, BLOCK_N // 2)
    tiles = cdiv(M, BLOCK_M) * cdiv(C, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0)):
        off_m, off_n = tile_origin(tile, M, C, BLOCK_M, BLOCK_N, GROUP_M)
        row0 = (off_m // T) * H * T + off_m % T
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
        acc = _head_rows_matmul(acc, dq_desc, w_desc, row0, T, D, 0, off_n, C,
                                BLOCK_K, PRECISION)
        acc = _head_rows_matmul(acc, dk_desc, w_desc, row0, T, D, C, off_n, C,
                                BLOCK_K, PRECISION)
        acc = _head_rows_matmul(acc, dv_desc, w_desc, row0, T, D, 2 * C, off_n, C,
                                BLOCK_K, PRECISION)
        left, right = column_halves(acc, BLOCK_M, BLOCK_N)
        dx_desc.store([off_m, off_n], left.to(dx_desc.dtype))
        dx_desc.store([off_m, off_n + BLOCK_N // 2], right.to(dx_desc.dtype))


@device_fn
def _segment_dw(g_desc, x_desc, dw_desc, seg: tl.constexpr, M, C, T, H, ACC: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's share of segment seg's output tiles (_segment_first): head h's rows
    seg*C + h*D.. of dW, columns off_n.., over all M tokens."""
    tiles = cdiv(C, BLOCK_M) * cdiv(C, BLOCK_N)
    for tile in tl.range(_segment_first(seg * tiles), tiles, tl.num_programs(0)):
        off_c, off_n = tile_origin(tile, C, C, BLOCK_M, BLOCK_N, GROUP_M)
        h = off_c // BLOCK_M
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
        for k in range(0, M, BLOCK_K):
            a = tl.trans(g_desc.load([((k // T) * H + h) * T + k % T, 0]))
            acc = tl.dot(a, x_desc.load([k, off_n]), acc, input_precision=PRECISION,
                         out_dtype=acc.dtype)
        left, right = column_halves(acc, BLOCK_M, BLOCK_N)
        dw_desc.store([seg * C + off_c, off_n], left.to(dw_desc.dtype))
        dw_desc.store([seg * C + off_c, off_n + BLOCK_N // 2], right.to(dw_desc.dtype))


@fast_launch
@triton.jit
def _qkv_dw_tma_kernel(
    dq_ptr, dk_ptr, dv_ptr, x_ptr, dw_ptr, M, C, T, H, s_xm, s_dw0,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # dW[s*C + h*D + d, n] = sum_m dseg[b, h, t, d] * x[m, n], m = b*T + t, one output
    # tile (one head's D = BLOCK_M rows of dW) at a time: each K step's block of dseg is
    # the box of rows (b*H + h)*T + t0.. of dseg viewed as a (B*H*T, D) matrix, read
    # transposed. Needs contiguous dq, dk, dv and T % BLOCK_K == 0 (a K step stays in one
    # sequence). One loop per segment, as in the forward (a descriptor fixed per loop).
    rows = M * H
    x_desc = matrix_desc(x_ptr, M, C, s_xm, BLOCK_K, BLOCK_N)
    dw_desc = matrix_desc(dw_ptr, 3 * C, C, s_dw0, BLOCK_M, BLOCK_N // 2)
    _segment_dw(matrix_desc(dq_ptr, rows, BLOCK_M, BLOCK_M, BLOCK_K, BLOCK_M), x_desc, dw_desc,
                0, M, C, T, H, ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    _segment_dw(matrix_desc(dk_ptr, rows, BLOCK_M, BLOCK_M, BLOCK_K, BLOCK_M), x_desc, dw_desc,
                1, M, C, T, H, ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    _segment_dw(matrix_desc(dv_ptr, rows, BLOCK_M, BLOCK_M, BLOCK_K, BLOCK_M), x_desc, dw_desc,
                2, M, C, T, H, ACC, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


def qkv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int,
            n_kv_heads: int | None = None, rope_base: float | None = None,
            positions: torch.Tensor | None = None, config: TmaConfig | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: (B, T, C), weight: ((H + 2 HK) D, C), bias: its rows -> q: (B, H, T, D), k, v:
    (B, HK, T, D), contiguous (H = n_heads, HK = n_kv_heads, default H); with rope_base, q
    and k rotated in the epilogue at positions ((B, T) ints, default t; kernels.rope's
    formula). `config` overrides the TMA tile table (for tuning and tests)."""
    B, T, C = x.shape
    H, HK = n_heads, n_kv_heads or n_heads
    D = C // H
    CKV = HK * D
    q = torch.empty((B, H, T, D), device=x.device, dtype=x.dtype)
    k, v = (torch.empty((B, HK, T, D), device=x.device, dtype=x.dtype) for _ in range(2))
    M = B * T
    rope = rope_base is not None
    flags = dict(HAS_BIAS=bias is not None, ROPE=rope, POSITIONS=positions is not None,
                 **gemm_flags(x))
    b_arg = bias if bias is not None else x
    freq = inv_freq(D, rope_base, x.device, stat_dtype(x)) if rope else x
    pos = positions.contiguous() if positions is not None else x  # read only when given
    if tma_ok(x, weight) and (B == 1 or x.stride(0) == T * x.stride(1)):
        # The Gluon kernel where measured faster (see GLUON_EPILOGUE_MAX_K).
        if config is None and C <= GLUON_EPILOGUE_MAX_K and gluon_ok(x, weight):
            from fusedtrain.kernels import qkv_gluon  # Gluon: imported where it compiles
            if qkv_gluon.fits(T, C, CKV, D):
                qkv_gluon.qkv_fwd(x.reshape(M, C), weight, bias, q, k, v,
                                  freq if rope else None,
                                  None if positions is None else pos.reshape(-1))
                return q, k, v
        cfg = config or tma_config(C)
        head_store = (T % cfg.block_m == 0 and C % cfg.block_n == 0 and CKV % cfg.block_n == 0
                      and D in (cfg.block_n // 2, cfg.block_n // 4))
        if head_store or not rope:  # the rotation needs whole heads in a tile here
            tiles = ceil_div(M, cfg.block_m) * (ceil_div(C, cfg.block_n)
                                                + 2 * ceil_div(CKV, cfg.block_n))
            launch(_qkv_fwd_tma_kernel, tiles, x.device, x, weight, b_arg, pos, freq, q, k, v,
                   M, C, CKV, T, H, HK, D, x.stride(1), weight.stride(0), q.stride(0),
                   k.stride(0), *q.stride()[1:], config=cfg, HEAD_D=D if head_store else 0,
                   **flags)
            return q, k, v
    grid = lambda meta: (  # noqa: E731
        ceil_div(M, meta["BLOCK_M"]) * (ceil_div(C, meta["BLOCK_N"])
                                        + 2 * ceil_div(CKV, meta["BLOCK_N"])),)
    _qkv_fwd_kernel[grid](x, weight, b_arg, pos, freq, q, k, v, M, C, CKV, T, D,
                          *x.stride(), *weight.stride(), q.stride(0), k.stride(0),
                          *q.stride()[1:], **flags)
    return q, k, v


def qkv_dx(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, weight: torch.Tensor,
           config: TmaConfig | None = None) -> torch.Tensor:
    """dq, dk, dv: (B, H, T, D) with equal strides, weight: (3C, C) -> dx: (B, T, C)."""
    B, H, T, D = dq.shape
    C = H * D
    dx = torch.empty((B, T, C), device=dq.device, dtype=dq.dtype)
    M = B * T
    flags = gemm_flags(dq)
    cfg = config or tma_config(C)
    if (tma_ok(dq, dk, dv, weight) and dq.is_contiguous() and T % cfg.block_m == 0
            and D % cfg.block_k == 0):
        tiles = ceil_div(M, cfg.block_m) * ceil_div(C, cfg.block_n)
        launch(_qkv_dx_tma_kernel, tiles, dq.device, dq, dk, dv, weight, dx, M, C, T, H, D,
               weight.stride(0), dx.stride(1), config=cfg, **flags)
        return dx
    grid = lambda meta: (  # noqa: E731
        ceil_div(M, meta["BLOCK_M"]) * ceil_div(C, meta["BLOCK_N"]),)
    _qkv_dx_kernel[grid](
        dq, dk, dv, weight, dx, M, C, T, H, D, *dq.stride(), *weight.stride(), *dx.stride(),
        **flags)
    return dx


def qkv_dw(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, x: torch.Tensor,
           out_dtype: torch.dtype | None = None, config: TmaConfig | None = None) -> torch.Tensor:
    """dq, dk, dv: (B, H, T, D) with equal strides, x: (B, T, C) -> dW_qkv: (3C, C) in
    out_dtype (default dq's), from the fp32 (fp64) accumulator. Through TMA where one head
    is a tile's rows (D = the table's BLOCK_M) and whole tiles fill the GPU (k_splits finds
    no split worth making)."""
    B, H, T, D = dq.shape
    C = H * D
    M = B * T
    dw = torch.empty((3 * C, C), device=dq.device, dtype=out_dtype or dq.dtype)
    cfg = config or tma_config(C)
    tiles = 3 * ceil_div(C, cfg.block_m) * ceil_div(C, cfg.block_n)
    if (tma_ok(dq, dk, dv, x) and dq.is_contiguous() and cfg.block_m == D
            and T % cfg.block_k == 0 and (B == 1 or x.stride(0) == T * x.stride(1))
            and k_splits(tiles, M, dq.device, cfg.per_sm) == 1):
        launch(_qkv_dw_tma_kernel, tiles, dq.device, dq, dk, dv, x, dw, M, C, T, H,
               x.stride(1), dw.stride(0), config=cfg, **gemm_flags(dq))
        return dw
    grid = lambda meta: (  # noqa: E731
        3 * ceil_div(C, meta["BLOCK_M"]) * ceil_div(C, meta["BLOCK_N"]),)
    _qkv_dw_kernel[grid](
        dq, dk, dv, x, dw, B * T, C, B, T, D, *dq.stride(), *x.stride(), *dw.stride(),
        **gemm_flags(dq),
    )
    return dw
