"""Flash attention backward: the dq kernel (which also writes delta = rowsum(dO * O) and,
on request, the sums of a QKV bias's gradient), then the dk/dv kernel, and their launcher.
Tiles, schedule and loads as in the forward (kernels.attention, whose docstring has the
whole design)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels._device import ceil_div, dot_precision, stat_dtype
from fusedtrain.kernels._launch import stand_in
from fusedtrain.kernels._primitives import cdiv, device_fn, row_sum, tanh
from fusedtrain.kernels._tuning import autotune
from fusedtrain.kernels.attention import (
    BIAS_GRAIN,
    BWD_KV_CONFIGS,
    BWD_KV_HEAD_256,
    BWD_Q_CONFIGS,
    BWD_Q_HEAD_256,
    INTERPRET_CONFIG,
    WIDE_CONFIGS,
    _bounds,
    _clamped_ranges,
    _dkdv_fits,
    _for_head_dim,
    _grid,
    _key_blocks,
    _load_rows,
    _load_tile,
    _loads_through_tma,
    _row_source,
    _rows_of,
    _schedule,
    _sequence,
    _slice_base,
    _store_rows,
    _visible,
    acc_dtype,
    dense_dims,
    grad_buffer,
    head_block,
    kernel_args,
    output_buffer,
    packed_strides,
)
from fusedtrain.kernels.bias_grad import bias_grad

_KEY = ["T_BUCKET", "S_BUCKET", "BLOCK_D", "MASK", "SOFTCAP", "GROUPED", "VARLEN", "TMA"]


@device_fn
def _scores_bwd(s, qk_scale, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """Raw scores s = q k^T -> (the base-2 scores the forward exponentiated, the factor
    their gradient takes on its way back to s * scale: 1 - tanh^2 with a softcap, else 1;
    see attention.softcapped)."""
    if SOFTCAP:
        t = tanh(s * cap_in)
        return cap_out * t, 1.0 - t * t
    else:
        return s * qk_scale, 1.0


@device_fn
def _dkdv_blocks(dk, dv, k, v, q_src, do_src, lse_base, delta_base, offs_n, offs_d, d_ok, T,
                 S, LO, HI, qk_scale, cap_in, cap_out, s_qt, s_qd, s_gt, s_gd, blk_lo, blk_hi,
                 MASKED: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                 ACC: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Accumulate dK, dV of one key block over query blocks [blk_lo, blk_hi); works on
    transposed scores sT = k q^T so that dv += pT @ dO and dk += dsT @ q need no transposes
    of the accumulators."""
    for blk in range(blk_lo, blk_hi):
        offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < T
        q = _load_tile(q_src, blk * BLOCK_M, offs_m, offs_d, s_qt, s_qd, m_ok, d_ok, TMA)
        do = _load_tile(do_src, blk * BLOCK_M, offs_m, offs_d, s_gt, s_gd, m_ok, d_ok, TMA)
        lse = tl.load(lse_base + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        sT, slope = _scores_bwd(tl.dot(k, tl.trans(q), input_precision=PRECISION,
                                       out_dtype=ACC), qk_scale, cap_in, cap_out, SOFTCAP)
        # Both score-shaped products before the exponentials (here and in _dq_blocks): the
        # second is then issued while the first is still running, not after the softmax.
        # H200, gpt2's causal shape: dk/dv alone 3-5% faster, the whole backward 283 ->
        # 279 us, bit-identical.
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION, out_dtype=ACC)
        pT = tl.exp2(sT - lse[None, :])
        if MASKED:
            pT = tl.where(tl.trans(_visible(offs_m, offs_n, T, S, LO, HI)), pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION, out_dtype=ACC)
        dsT = pT * (dpT - delta[None, :]) * slope
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION, out_dtype=ACC)
    return dk, dv


@device_fn
def _query_blocks(start_n, T, LO, HI, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks for key rows [start_n, start_n + BLOCK_N), as attention._key_blocks
    for key blocks: (lo, u_lo, u_hi, hi), [u_lo, u_hi) needing no mask (every row there
    sees every key of the block, and lies before T)."""
    lo = tl.maximum(start_n - HI, 0) // BLOCK_M
    hi = cdiv(tl.maximum(tl.minimum(start_n + BLOCK_N - LO, T), 0), BLOCK_M)
    u_lo = cdiv(tl.maximum(start_n + BLOCK_N - 1 - HI, 0), BLOCK_M)
    u_hi = tl.minimum(tl.maximum(start_n - LO + 1, 0) // BLOCK_M, T // BLOCK_M)
    return _clamped_ranges(lo, u_lo, u_hi, hi)


@device_fn
def _dkdv_head(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, bh, q0, offs_n, offs_d, d_ok,
               H, T, T_b, S_b, D, LO, HI, qk_scale, cap_in, cap_out, s_qb, s_qh, s_qt, s_qd,
               s_gb, s_gh, s_gt, s_gd, q_lo, u_lo, u_hi, q_hi,
               SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               ACC: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    """dK, dV of one key block accumulated over the query blocks of query head bh (of
    B * H), whose T_b rows start at row q0: [q_lo, u_lo) and [u_hi, q_hi) masked,
    [u_lo, u_hi) clear. lse2 and delta are (B, H, T)."""
    q_src = _row_source(_slice_base(q_ptr, bh, H, 1, s_qb, s_qh, q0, s_qt), T_b, D, s_qt, TMA,
                        BLOCK_M, BLOCK_D)
    do_src = _row_source(_slice_base(do_ptr, bh, H, 1, s_gb, s_gh, q0, s_gt), T_b, D, s_gt,
                         TMA, BLOCK_M, BLOCK_D)
    lse_base = lse_ptr + bh.to(tl.int64) * T
    delta_base = delta_ptr + bh.to(tl.int64) * T
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, lse_base, delta_base, offs_n, offs_d,
                          d_ok, T_b, S_b, LO, HI, qk_scale, cap_in, cap_out, s_qt, s_qd, s_gt,
                          s_gd, q_lo, u_lo, True, SOFTCAP, BLOCK_M, ACC, PRECISION, TMA)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, lse_base, delta_base, offs_n, offs_d,
                          d_ok, T_b, S_b, LO, HI, qk_scale, cap_in, cap_out, s_qt, s_qd, s_gt,
                          s_gd, u_lo, u_hi, False, SOFTCAP, BLOCK_M, ACC, PRECISION, TMA)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, lse_base, delta_base, offs_n, offs_d,
                          d_ok, T_b, S_b, LO, HI, qk_scale, cap_in, cap_out, s_qt, s_qd, s_gt,
                          s_gd, u_hi, q_hi, True, SOFTCAP, BLOCK_M, ACC, PRECISION, TMA)
    return dk, dv


@device_fn
def _dkdv_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, bhk,
                  start_n, q0, T_b, k0, S_b, sm_scale, qk_scale, cap_in, cap_out, H, G, T, D,
                  WL, WR, s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt,
                  s_vd, s_gb, s_gh, s_gt, s_gd, s_db, s_dh, s_dt, s_dd,
                  SOFTCAP: tl.constexpr, GROUPED: tl.constexpr, ACC: tl.constexpr,
                  PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV of key rows [start_n, start_n + BLOCK_N) of key/value head bhk (of B * HK):
    a sequence of S_b keys from row k0, seen by T_b queries from row q0. GROUPED: G query
    heads read each key/value head, and this program sums their gradients in turn (no
    atomics)."""
    HK = H // G
    offs_n, offs_d, n_ok, d_ok = _rows_of(start_n, S_b, D, BLOCK_N, BLOCK_D)
    LO, HI = _bounds(T_b, S_b, WL, WR)
    k = _load_rows(_slice_base(k_ptr, bhk, HK, 1, s_kb, s_kh, k0, s_kt), offs_n, offs_d, s_kt,
                   s_kd, n_ok, d_ok)
    v = _load_rows(_slice_base(v_ptr, bhk, HK, 1, s_vb, s_vh, k0, s_vt), offs_n, offs_d, s_vt,
                   s_vd, n_ok, d_ok)
    dk = tl.full((BLOCK_N, BLOCK_D), 0.0, ACC)
    dv = tl.full((BLOCK_N, BLOCK_D), 0.0, ACC)
    q_lo, u_lo, u_hi, q_hi = _query_blocks(start_n, T_b, LO, HI, BLOCK_M, BLOCK_N)
    first = (bhk // HK) * H + (bhk % HK) * G  # the first query head reading this one
    if GROUPED:
        for g in range(G):
            dk, dv = _dkdv_head(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, first + g, q0,
                                offs_n, offs_d, d_ok, H, T, T_b, S_b, D, LO, HI, qk_scale,
                                cap_in, cap_out, s_qb, s_qh, s_qt, s_qd, s_gb, s_gh, s_gt, s_gd,
                                q_lo, u_lo, u_hi, q_hi, SOFTCAP, BLOCK_M, BLOCK_D, ACC,
                                PRECISION, TMA)
    else:
        dk, dv = _dkdv_head(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, first, q0, offs_n,
                            offs_d, d_ok, H, T, T_b, S_b, D, LO, HI, qk_scale, cap_in, cap_out,
                            s_qb, s_qh, s_qt, s_qd, s_gb, s_gh, s_gt, s_gd, q_lo, u_lo, u_hi,
                            q_hi, SOFTCAP, BLOCK_M, BLOCK_D, ACC, PRECISION, TMA)
    _store_rows(_slice_base(dk_ptr, bhk, HK, 1, s_db, s_dh, k0, s_dt), dk * sm_scale, offs_n,
                offs_d, s_dt, s_dd, n_ok, d_ok)
    _store_rows(_slice_base(dv_ptr, bhk, HK, 1, s_db, s_dh, k0, s_dt), dv, offs_n, offs_d, s_dt,
                s_dd, n_ok, d_ok)


@autotune(BWD_KV_CONFIGS + BWD_KV_HEAD_256, key=_KEY, interpret=INTERPRET_CONFIG,
          wide=WIDE_CONFIGS, keep=_dkdv_fits)
@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr,
    sm_scale, qk_scale, cap_in, cap_out, H, G, T, S, D, WL, WR, MASK, T_BUCKET, S_BUCKET, BH,
    GROUP, s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt, s_vd,
    s_gb, s_gh, s_gt, s_gd, s_db, s_dh, s_dt, s_dd,
    VARLEN: tl.constexpr, SOFTCAP: tl.constexpr, GROUPED: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (key block, batch * key/value head).
    bhk, block = _schedule(cdiv(S, BLOCK_N), BH // G, GROUP, True)
    q0, T_b, k0, S_b = _sequence(bhk // (H // G), cu_q_ptr, cu_k_ptr, T, S, VARLEN)
    start_n = block * BLOCK_N
    if VARLEN:
        if start_n < S_b:
            _dkdv_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, bhk,
                          start_n, q0, T_b, k0, S_b, sm_scale, qk_scale, cap_in, cap_out, H, G,
                          T, D, WL, WR, s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb,
                          s_vh, s_vt, s_vd, s_gb, s_gh, s_gt, s_gd, s_db, s_dh, s_dt, s_dd,
                          SOFTCAP, GROUPED, ACC, PRECISION, BLOCK_D, TMA, BLOCK_M, BLOCK_N)
    else:
        _dkdv_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, bhk,
                      start_n, q0, T_b, k0, S_b, sm_scale, qk_scale, cap_in, cap_out, H, G, T,
                      D, WL, WR, s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh,
                      s_vt, s_vd, s_gb, s_gh, s_gt, s_gd, s_db, s_dh, s_dt, s_dd, SOFTCAP,
                      GROUPED, ACC, PRECISION, BLOCK_D, TMA, BLOCK_M, BLOCK_N)


@device_fn
def _dq_blocks(dq, q, do, lse, delta, k_src, v_src, offs_m, offs_d, d_ok, T, S, LO, HI,
               qk_scale, cap_in, cap_out, s_kt, s_kd, s_vt, s_vd, blk_lo, blk_hi,
               MASKED: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
               ACC: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    for blk in range(blk_lo, blk_hi):
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < S
        k = _load_tile(k_src, blk * BLOCK_N, offs_n, offs_d, s_kt, s_kd, n_ok, d_ok, TMA)
        v = _load_tile(v_src, blk * BLOCK_N, offs_n, offs_d, s_vt, s_vd, n_ok, d_ok, TMA)
        s, slope = _scores_bwd(tl.dot(q, tl.trans(k), input_precision=PRECISION,
                                      out_dtype=ACC), qk_scale, cap_in, cap_out, SOFTCAP)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, offs_n, T, S, LO, HI), p, 0.0)
        ds = p * (dp - delta[:, None]) * slope
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION, out_dtype=ACC)
    return dq


@device_fn
def _grain_sums(tile, m_ok, GRAIN: tl.constexpr):
    """tile: (BLOCK_M, BLOCK_D) -> its column sums per GRAIN rows, (BLOCK_M // GRAIN,
    BLOCK_D), rows past the sequence end (not m_ok) left out."""
    BLOCK_M: tl.constexpr = tile.shape[0]
    BLOCK_D: tl.constexpr = tile.shape[1]
    tile = tl.where(m_ok[:, None], tile, 0.0)
    return row_sum(tl.reshape(tile, (BLOCK_M // GRAIN, GRAIN, BLOCK_D)), 1)


@device_fn
def _store_grain_rows(ptr, sums, row_stride, rows_left, offs_d, d_ok):
    """sums (n, BLOCK_D) as n consecutive rows of a partial-sum buffer from ptr (the first
    row's first column); only the first rows_left hold data (the sequence end)."""
    rows = tl.arange(0, sums.shape[0])
    ptrs = ptr + rows.to(tl.int64)[:, None] * row_stride + offs_d[None, :]
    tl.store(ptrs, sums.to(ptr.dtype.element_ty), mask=(rows < rows_left)[:, None] & d_ok[None, :])


@device_fn
def _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, part_ptr, o_ptr, bh,
                start_m, q0, T_b, k0, S_b, sm_scale, qk_scale, cap_in, cap_out, H, G, T, D,
                WL, WR, s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt,
                s_vd, s_gb, s_gh, s_gt, s_gd, s_db, s_dh, s_dt, s_dd, s_ob, s_oh, s_ot, s_od,
                SOFTCAP: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_D: tl.constexpr, TMA: tl.constexpr, BIAS_SUMS: tl.constexpr,
                GRAIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ (and delta) of query rows [start_m, start_m + BLOCK_M) of head bh: a sequence of
    T_b queries from row q0 against its S_b keys from row k0."""
    offs_m, offs_d, m_ok, d_ok = _rows_of(start_m, T_b, D, BLOCK_M, BLOCK_D)
    LO, HI = _bounds(T_b, S_b, WL, WR)
    q = _load_rows(_slice_base(q_ptr, bh, H, 1, s_qb, s_qh, q0, s_qt), offs_m, offs_d, s_qt,
                   s_qd, m_ok, d_ok)
    do = _load_rows(_slice_base(do_ptr, bh, H, 1, s_gb, s_gh, q0, s_gt), offs_m, offs_d, s_gt,
                    s_gd, m_ok, d_ok)
    if BIAS_SUMS:
        # Row (batch, query grain) of the (B * T / GRAIN, 3, H, D) partial sums, at head h:
        # [dq's column sums | 0 | dO's] (the bias gradients, see attention_bwd). dO's and
        # the zeros are stored before the loop, so that nothing of them stays live in it.
        C = H * D
        grain_row = (bh // H).to(tl.int64) * cdiv(T, GRAIN) + start_m // GRAIN
        rows_left = cdiv(T - start_m, GRAIN)
        do_sums = _grain_sums(do.to(ACC), m_ok, GRAIN)
        base = part_ptr + grain_row * 3 * C + (bh % H) * D
        _store_grain_rows(base + C, tl.full(do_sums.shape, 0.0, ACC), 3 * C, rows_left, offs_d,
                          d_ok)
        _store_grain_rows(base + 2 * C, do_sums, 3 * C, rows_left, offs_d, d_ok)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * T + offs_m, mask=m_ok, other=0.0)
    o = _load_rows(_slice_base(o_ptr, bh, H, 1, s_ob, s_oh, q0, s_ot), offs_m, offs_d, s_ot,
                   s_od, m_ok, d_ok)
    delta = row_sum(o.to(ACC) * do.to(ACC), 1)
    tl.store(delta_ptr + bh.to(tl.int64) * T + offs_m, delta, mask=m_ok)  # for dk/dv
    k_src = _row_source(_slice_base(k_ptr, bh, H, G, s_kb, s_kh, k0, s_kt), S_b, D, s_kt, TMA,
                        BLOCK_N, BLOCK_D)
    v_src = _row_source(_slice_base(v_ptr, bh, H, G, s_vb, s_vh, k0, s_vt), S_b, D, s_vt, TMA,
                        BLOCK_N, BLOCK_D)
    dq = tl.full((BLOCK_M, BLOCK_D), 0.0, ACC)
    lo, u_lo, u_hi, hi = _key_blocks(start_m, S_b, LO, HI, BLOCK_M, BLOCK_N)
    dq = _dq_blocks(dq, q, do, lse, delta, k_src, v_src, offs_m, offs_d, d_ok, T_b, S_b, LO, HI,
                    qk_scale, cap_in, cap_out, s_kt, s_kd, s_vt, s_vd, lo, u_lo, True, SOFTCAP,
                    BLOCK_N, ACC, PRECISION, TMA)
    dq = _dq_blocks(dq, q, do, lse, delta, k_src, v_src, offs_m, offs_d, d_ok, T_b, S_b, LO, HI,
                    qk_scale, cap_in, cap_out, s_kt, s_kd, s_vt, s_vd, u_lo, u_hi, False,
                    SOFTCAP, BLOCK_N, ACC, PRECISION, TMA)
    dq = _dq_blocks(dq, q, do, lse, delta, k_src, v_src, offs_m, offs_d, d_ok, T_b, S_b, LO, HI,
                    qk_scale, cap_in, cap_out, s_kt, s_kd, s_vt, s_vd, u_hi, hi, True, SOFTCAP,
                    BLOCK_N, ACC, PRECISION, TMA)
    dq = dq * sm_scale
    _store_rows(_slice_base(dq_ptr, bh, H, 1, s_db, s_dh, q0, s_dt), dq, offs_m, offs_d, s_dt,
                s_dd, m_ok, d_ok)
    if BIAS_SUMS:  # dq's column sums; the row recomputed, not kept live through the loop
        C = H * D
        grain_row = (bh // H).to(tl.int64) * cdiv(T, GRAIN) + start_m // GRAIN
        _store_grain_rows(part_ptr + grain_row * 3 * C + (bh % H) * D,
                          _grain_sums(dq, m_ok, GRAIN), 3 * C, cdiv(T - start_m, GRAIN), offs_d,
                          d_ok)


@autotune(BWD_Q_CONFIGS + BWD_Q_HEAD_256, key=[*_KEY, "BIAS_SUMS"], interpret=INTERPRET_CONFIG,
          wide=WIDE_CONFIGS, keep=_for_head_dim(BWD_Q_HEAD_256))
@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, part_ptr, cu_q_ptr, cu_k_ptr,
    sm_scale, qk_scale, cap_in, cap_out, H, G, T, S, D, WL, WR, MASK, T_BUCKET, S_BUCKET, BH,
    GROUP, s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt, s_vd,
    s_gb, s_gh, s_gt, s_gd, s_db, s_dh, s_dt, s_dd,
    o_ptr, s_ob, s_oh, s_ot, s_od,
    VARLEN: tl.constexpr, SOFTCAP: tl.constexpr, GROUPED: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr, BIAS_SUMS: tl.constexpr,
    GRAIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (query block, batch * head), as the forward's.
    bh, block = _schedule(cdiv(T, BLOCK_M), BH, GROUP, False)
    q0, T_b, k0, S_b = _sequence(bh // H, cu_q_ptr, cu_k_ptr, T, S, VARLEN)
    start_m = block * BLOCK_M
    if VARLEN:
        if start_m < T_b:
            _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, part_ptr, o_ptr,
                        bh, start_m, q0, T_b, k0, S_b, sm_scale, qk_scale, cap_in, cap_out, H,
                        G, T, D, WL, WR, s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb,
                        s_vh, s_vt, s_vd, s_gb, s_gh, s_gt, s_gd, s_db, s_dh, s_dt, s_dd, s_ob,
                        s_oh, s_ot, s_od, SOFTCAP, ACC, PRECISION, BLOCK_D, TMA, BIAS_SUMS,
                        GRAIN, BLOCK_M, BLOCK_N)
    else:
        _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, part_ptr, o_ptr, bh,
                    start_m, q0, T_b, k0, S_b, sm_scale, qk_scale, cap_in, cap_out, H, G, T, D,
                    WL, WR, s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt,
                    s_vd, s_gb, s_gh, s_gt, s_gd, s_db, s_dh, s_dt, s_dd, s_ob, s_oh, s_ot, s_od,
                    SOFTCAP, ACC, PRECISION, BLOCK_D, TMA, BIAS_SUMS, GRAIN, BLOCK_M, BLOCK_N)


def packed_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the gradients come as one grad_buffer (q, k, v of one shape), which a packed
    QKV projection's backward reads whole; else as three tensors (gradient_buffers)."""
    return k.shape == q.shape and v.shape == q.shape


def gradient_buffers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised dq, dk, dv for attention_bwd: views of one grad_buffer where
    packed_grads holds, else each laid out as output_buffer (heads inside tokens)."""
    if packed_grads(q, k, v):
        return tuple(grad_buffer(q).unbind(0))
    return output_buffer(q), output_buffer(k), output_buffer(v)


def attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  o: torch.Tensor, lse: torch.Tensor, grads: tuple[torch.Tensor, ...],
                  causal: bool, softmax_scale: float, window: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, bias_grad_dtype: torch.dtype | None = None,
                  cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None,
                  max_seqlens: tuple[int, int] | None = None) -> torch.Tensor | None:
    """Writes the gradients of q: (B, H, T, D) and k, v: (B, HK, S, D) into grads = (dq,
    dk, dv) (see gradient_buffers; dk and dv of one layout). Grouped heads (HK < H): each
    key/value head's gradient sums over the H // HK query heads that read it. With
    cu_seqlens, a packed batch as attention.attention_fwd_varlen's: q, dq: (Nq, H, D),
    k, v, dk, dv: (Nk, HK, D).

    Returns, for a bias_grad_dtype (q, k, v of one shape, not packed), the gradient
    (3 * H * D,) in that dtype of a bias b = [b_q | b_k | b_v] added to q, k, v before the
    attention (by the projection that made them), else None. Its sums come from the dq
    kernel, without reading dq, dk, dv again: b_q's gradient is dq's column sums; b_k's is
    zero (it adds q_i . b_k to every score of row i, which the softmax cancels); b_v's is
    dO's column sums (every row of probabilities sums to one, so b_v passes to the output
    unchanged). With S = T each query row sees at least its own key under any mask here,
    so the last two hold exactly."""
    varlen = cu_seqlens is not None
    if varlen:
        dims = (cu_seqlens[0].shape[0] - 1, q.shape[1], k.shape[1], *max_seqlens, q.shape[2])
        layout = packed_strides
        cu_q, cu_k = cu_seqlens
    else:
        dims, layout = dense_dims(q, k), torch.Tensor.stride
    B, H, HK, T, S, D = dims
    delta = torch.empty_like(lse)  # rowsum(dO * O): written by the dq kernel
    if not varlen:
        cu_q, cu_k = stand_in(delta), stand_in(delta)  # not read without VARLEN
    dq, dk, dv = grads
    bias_sums = bias_grad_dtype is not None
    if bias_sums and (varlen or not packed_grads(q, k, v)):
        raise ValueError("a QKV bias gradient needs q, k and v of one (B, H, T, D) shape")
    parts = (torch.empty((B * ceil_div(T, BIAS_GRAIN), 3 * H * D), device=q.device,
                         dtype=stat_dtype(q)) if bias_sums else stand_in(delta))  # not written
    shared = kernel_args(q, dims, causal, window, softmax_scale, softcap)
    strides = (*layout(q), *layout(k), *layout(v), *layout(do))
    key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), do.stride(), o.stride(),
           q.dtype, dims, causal, window, softcap > 0, bias_sums)

    def meta():
        return dict(VARLEN=varlen, SOFTCAP=softcap > 0, GROUPED=HK != H, ACC=acc_dtype(q),
                    PRECISION=dot_precision(q), BLOCK_D=head_block(D),
                    TMA=_loads_through_tma(q, k, v, do))

    _attn_bwd_dq_kernel.planned(
        key, (q, k, v, do, lse, delta, dq, parts, cu_q, cu_k, softmax_scale, *shared, *strides,
              *layout(dq), o, *layout(o)),
        lambda: (_grid("BLOCK_M", T, B * H), dict(BIAS_SUMS=bias_sums, GRAIN=BIAS_GRAIN, **meta())))
    _attn_bwd_dkdv_kernel.planned(
        key, (q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, softmax_scale, *shared, *strides,
              *layout(dk)),
        lambda: (_grid("BLOCK_N", S, B * HK), meta()))
    return bias_grad(parts, bias_grad_dtype) if bias_sums else None
