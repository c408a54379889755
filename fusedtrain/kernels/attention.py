"""Flash attention (FlashAttention-2 style): its design, the tiles and schedule both passes
share, and the forward kernel with its launchers (the backward's are in attention_bwd.py).

Shapes: q, o: (B, H, T, D), k, v: (B, HK, S, D), H a multiple of HK (grouped heads: query
head h reads key/value head h // (H // HK)), any strides; or a packed batch, q: (Nq, H, D),
k, v: (Nk, HK, D) with cu_seqlens (VARLEN). D <= 256, padded to BLOCK_D (the next power of
two, at least 16). Softmax runs in base 2 with the scale folded in (qk_scale =
softmax_scale * log2(e); with a softcap, inside the tanh), in fp32 (fp64 for fp64 inputs).
Loads: the tiles each loop iteration reads (K and V in the forward and dq loops, Q and dO
in the dk/dv loop) come through TMA descriptors made on the device, one per (rows, D)
slice (rows past the sequence and columns past D read as zero), where the operands allow
it (16-bit on Hopper, unit stride in d, 16-byte aligned: _tma.tma_ok); masked pointer
loads otherwise. H200, bf16: forward+backward 4-7% faster than with pointer loads,
forward up to 12%.

forward    one program per (query block, batch*head): online softmax over key blocks,
           o = acc / l written once; saves lse2 = m + log2(l) per row (base-2 log-sum-exp).
backward   two kernels, neither using atomics:
           dq:    one program per query block, looping over key blocks; it first
                  computes delta = rowsum(dO * O) for its rows and stores it; on request
                  it also sums the gradients of biases added to q, k, v (see
                  attention_bwd.py);
           dk/dv: one program per key block of a key/value head, looping over query
                  blocks of each query head that reads it (reads delta: launched after dq).
Masks (_bounds): query i of a sequence sees key j iff i + LO <= j <= i + HI, the causal
mask and the window aligned to the bottom right. Blocks outside are skipped; only blocks
cut by the mask or the sequence end run the masked loop body, the rest run unmasked.
Programs start longest first within groups of heads that share L2 (_schedule), so the
short ones fill the GPU's tail. Rows that see no key produce zeros, not NaN.
Block sizes: triton.autotune keyed on (T and S buckets, BLOCK_D, the mask's kind, softcap,
grouping, packing, TMA) and the dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusedtrain.kernels._device import (
    ceil_div,
    dot_precision,
    l2_cache_bytes,
    next_pow2,
    stat_dtype,
)
from fusedtrain.kernels._launch import stand_in
from fusedtrain.kernels._primitives import cdiv, device_fn, row_max, row_sum, tanh
from fusedtrain.kernels._tma import enable_device_descriptors, matrix_desc, tma_ok
from fusedtrain.kernels._tuning import autotune

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


def _configs(shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in shapes]


# (64, 64, 4, 2): 98 us against 104 for the next best at gpt2's causal (16, 12, 1024, 64) on
# an H200 (docs/journal.md).
FWD_CONFIGS = _configs([(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3),
                        (64, 64, 4, 2), (128, 32, 4, 3), (64, 32, 4, 4)])
# Backward: deeper pipelines over narrow loop blocks (32 query rows per step of the dk/dv
# loop, 32 keys per step of the dq loop) suit D=64, whose dots are short.
BWD_KV_CONFIGS = _configs([(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3),
                           (32, 128, 4, 5), (64, 128, 8, 3), (16, 128, 4, 5)])
BWD_Q_CONFIGS = _configs([(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3),
                          (128, 32, 4, 5), (128, 64, 8, 3), (64, 32, 4, 5)])
# Head dims past 128 (BLOCK_D = 256) take their own candidates, of at most 64 rows a tile
# and two stages: one 128 x 256 fp32 accumulator is 128 KiB of registers, and three stages
# of 64 x 256 16-bit K and V tiles are 192 KiB of shared memory.
FWD_HEAD_256 = _configs([(64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2)])
BWD_KV_HEAD_256 = _configs([(32, 64, 8, 1), (64, 64, 8, 1), (32, 32, 4, 1), (16, 64, 4, 1),
                            (32, 32, 8, 1), (64, 32, 8, 1)])
BWD_Q_HEAD_256 = _configs([(64, 32, 8, 2), (64, 64, 8, 1), (64, 32, 4, 2)])


def _for_head_dim(wide_heads: list[triton.Config]) -> Callable[..., bool]:
    """A `keep` for autotune: the configs of `wide_heads` exactly when BLOCK_D > 128."""
    def keep(config: triton.Config, BLOCK_D: int, **_) -> bool:
        return any(config is c for c in wide_heads) == (BLOCK_D > 128)

    return keep


def _dkdv_fits(config: triton.Config, BLOCK_D: int, **_) -> bool:
    """Whether a dk/dv config is worth timing: at D=128, 128 keys over 4 warps hold two
    128 x 128 fp32 accumulators in 128 threads and spill (H200: 2.2-7x the best config at
    every benchmark and test shape, where they are among the best at D=64)."""
    spills = BLOCK_D == 128 and config.num_warps == 4 and config.kwargs["BLOCK_N"] == 128
    return not spills and _for_head_dim(BWD_KV_HEAD_256)(config, BLOCK_D)


INTERPRET_CONFIG = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128})
# fp32 / fp64 data: the second for head dims past 128 (its tiles fit shared memory there).
WIDE_CONFIGS = _configs([(64, 32, 4, 2), (64, 32, 4, 1)])
# The bias gradients' partial sums are kept per BIAS_GRAIN query rows, which divides every
# dq config's BLOCK_M: the buffer's layout does not depend on the autotuner's choice.
BIAS_GRAIN = 64
assert all(c.kwargs["BLOCK_M"] % BIAS_GRAIN == 0
           for c in [*BWD_Q_CONFIGS, *BWD_Q_HEAD_256, *WIDE_CONFIGS, INTERPRET_CONFIG])


@device_fn
def _load_rows(base, offs_t, offs_d, s_t, s_d, t_ok, d_ok):
    """Tile [len(offs_t), BLOCK_D] of a (T, D) slice; rows past T and padded d read 0."""
    ptrs = base + offs_t.to(tl.int64)[:, None] * s_t + offs_d[None, :] * s_d
    return tl.load(ptrs, mask=t_ok[:, None] & d_ok[None, :], other=0.0)


@device_fn
def _store_rows(base, val, offs_t, offs_d, s_t, s_d, t_ok, d_ok):
    ptrs = base + offs_t.to(tl.int64)[:, None] * s_t + offs_d[None, :] * s_d
    tl.store(ptrs, val.to(base.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


@device_fn
def _row_source(base, T, D, s_t, TMA: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """What a loop reads [BLOCK_R, BLOCK_D] tiles of a (T, D) slice from: a TMA descriptor
    (unit stride in d; rows past T and columns past D read as zero), or the slice's
    pointer. A packed batch's empty sequence (T = 0) gets a one-row descriptor that no
    loop reads (a descriptor has no empty dimension)."""
    if TMA:
        return matrix_desc(base, tl.maximum(T, 1), D, s_t, BLOCK_R, BLOCK_D)
    else:
        return base


@device_fn
def _load_tile(src, start, offs_t, offs_d, s_t, s_d, t_ok, d_ok, TMA: tl.constexpr):
    """Rows [start, start + BLOCK_R) of a _row_source; offs_t = start + arange(BLOCK_R)."""
    if TMA:
        return src.load([start, 0])
    else:
        return _load_rows(src, offs_t, offs_d, s_t, s_d, t_ok, d_ok)


@device_fn
def _visible(offs_m, offs_n, T, S, LO, HI):
    """[BLOCK_M, BLOCK_N] mask of (query, key) pairs that may attend: i < T, j < S and
    i + LO <= j <= i + HI (see _bounds)."""
    rel = offs_n[None, :] - offs_m[:, None]
    return (offs_m[:, None] < T) & (offs_n[None, :] < S) & (rel >= LO) & (rel <= HI)


@device_fn
def _slice_base(ptr, bh, H, G, s_b, s_h, row0, s_t):
    """Pointer to the (rows, D) slice that batch*query-head index bh reads: query head
    bh % H of batch entry bh // H, from row row0 on (a packed batch's sequence start, else
    0); with G query heads to a key/value head (G = 1 for q itself), key/value head
    (bh % H) // G."""
    return (ptr + (bh // H).to(tl.int64) * s_b + ((bh % H) // G).to(tl.int64) * s_h
            + row0.to(tl.int64) * s_t)


@device_fn
def _sequence(b, cu_q_ptr, cu_k_ptr, T, S, VARLEN: tl.constexpr):
    """(first query row, queries, first key row, keys) of batch entry b: its whole (T, S)
    slice, or with VARLEN sequence b of a packed batch (cu_seqlens of queries and keys)."""
    if VARLEN:
        q0 = tl.load(cu_q_ptr + b)
        k0 = tl.load(cu_k_ptr + b)
        return q0, tl.load(cu_q_ptr + b + 1) - q0, k0, tl.load(cu_k_ptr + b + 1) - k0
    else:
        return b * 0, T, b * 0, S


@device_fn
def _rows_of(start, n, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """(row offsets, column offsets, row mask, column mask) of rows [start, start + BLOCK_R)
    of n, BLOCK_D columns of D."""
    offs, offs_d = start + tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
    return offs, offs_d, offs < n, offs_d < D


@device_fn
def _bounds(T, S, WL, WR):
    """(LO, HI): query i of T sees key j of S iff i + LO <= j <= i + HI, for the window
    (WL, WR) aligned to the bottom right (query i's diagonal is key i + S - T; causal is
    WR = 0); an unbounded side (-1) becomes an offset past every key."""
    diag, far = S - T, T + S
    return tl.where(WL >= 0, diag - WL, -far), tl.where(WR >= 0, diag + WR, far)


@device_fn
def softcapped(s, cap_in, cap_out):
    """Scores s (q k^T, unscaled) -> cap_out * tanh(s * cap_in): with cap_in = scale / c and
    cap_out = c * log2(e), the softcapped scores c tanh(s scale / c) in base 2."""
    return cap_out * tanh(s * cap_in)


@device_fn
def _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_d, d_ok, T, S, LO, HI,
                qk_scale, cap_in, cap_out, s_kt, s_kd, s_vt, s_vd, blk_lo, blk_hi,
                MASKED: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
                ACC: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Online-softmax accumulation over key blocks [blk_lo, blk_hi)."""
    for blk in range(blk_lo, blk_hi):
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < S
        k = _load_tile(k_src, blk * BLOCK_N, offs_n, offs_d, s_kt, s_kd, n_ok, d_ok, TMA)
        v = _load_tile(v_src, blk * BLOCK_N, offs_n, offs_d, s_vt, s_vd, n_ok, d_ok, TMA)
        # Raw scores: the scale (> 0, checked by the op) goes on the row maxima, and onto
        # s inside the exponent's argument, one fused multiply-add per score (with a
        # softcap the scores come scaled, and qk_scale is 1).
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC)
        if SOFTCAP:
            s = softcapped(s, cap_in, cap_out)
        if MASKED:
            s = tl.where(_visible(offs_m, offs_n, T, S, LO, HI), s, float("-inf"))
        m_new = tl.maximum(m_i, row_max(s, 1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked rows stay finite
        p = tl.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + row_sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION,
                                            out_dtype=ACC)
        m_i = m_new
    return acc, l_i, m_i


@device_fn
def _clamped_ranges(lo, u_lo, u_hi, hi):
    """Block ranges [lo, u_lo) masked, [u_lo, u_hi) clear, [u_hi, hi) masked, from bounds
    that may cross: the clear range shrinks to fit inside [lo, hi)."""
    hi = tl.maximum(hi, lo)
    u_lo = tl.minimum(tl.maximum(u_lo, lo), hi)
    u_hi = tl.minimum(tl.maximum(u_hi, u_lo), hi)
    return lo, u_lo, u_hi, hi


@device_fn
def _key_blocks(start_m, S, LO, HI, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks for query rows [start_m, start_m + BLOCK_M): (lo, u_lo, u_hi, hi), blocks
    [u_lo, u_hi) seen whole by every row (no mask), [lo, u_lo) and [u_hi, hi) in part, the
    rest not at all. Divisions only of non-negative numbers (Triton's // truncates, the
    interpreter's floors)."""
    lo = tl.maximum(start_m + LO, 0) // BLOCK_N
    hi = cdiv(tl.maximum(tl.minimum(start_m + BLOCK_M + HI, S), 0), BLOCK_N)
    u_lo = cdiv(tl.maximum(start_m + BLOCK_M - 1 + LO, 0), BLOCK_N)
    u_hi = tl.minimum(tl.maximum(start_m + HI + 1, 0) // BLOCK_N, S // BLOCK_N)
    return _clamped_ranges(lo, u_lo, u_hi, hi)


@device_fn
def _schedule(n_blocks, BH, GROUP, LOW_FIRST: tl.constexpr):
    """Program id -> (batch*head, block). Blocks start in program-id order, and under a
    causal mask they differ in work (query block m sees m + 1 key blocks, key block n is
    seen by n_blocks - n query blocks), so each group of GROUP heads runs its blocks
    longest first, the group's heads side by side: the last programs to start are short
    and the GPU's tail stays short. GROUP heads' operands fit in L2 together, so the
    programs of one head, which read the same rows, still run at the same time.
    LOW_FIRST: block 0 is the longest (key blocks), else the last one is (query blocks)."""
    pid = tl.program_id(0)
    group = pid // (GROUP * n_blocks)
    rank = pid - group * GROUP * n_blocks
    heads = tl.minimum(GROUP, BH - group * GROUP)
    step = rank // heads
    bh = group * GROUP + rank - step * heads
    block = step if LOW_FIRST else n_blocks - 1 - step
    return bh, block


@device_fn
def _fwd_program(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bh, start_m, q0, T_b, k0, S_b, qk_scale,
                 cap_in, cap_out, H, G, T, D, WL, WR,
                 s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt, s_vd,
                 s_ob, s_oh, s_ot, s_od,
                 SOFTCAP: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_D: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """One query block of one head: rows [start_m, start_m + BLOCK_M) of a sequence of T_b
    queries from row q0 against its S_b keys from row k0."""
    offs_m, offs_d, m_ok, d_ok = _rows_of(start_m, T_b, D, BLOCK_M, BLOCK_D)
    LO, HI = _bounds(T_b, S_b, WL, WR)
    q = _load_rows(_slice_base(q_ptr, bh, H, 1, s_qb, s_qh, q0, s_qt), offs_m, offs_d, s_qt,
                   s_qd, m_ok, d_ok)
    k_src = _row_source(_slice_base(k_ptr, bh, H, G, s_kb, s_kh, k0, s_kt), S_b, D, s_kt, TMA,
                        BLOCK_N, BLOCK_D)
    v_src = _row_source(_slice_base(v_ptr, bh, H, G, s_vb, s_vh, k0, s_vt), S_b, D, s_vt, TMA,
                        BLOCK_N, BLOCK_D)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, ACC)
    l_i = tl.full((BLOCK_M,), 0.0, ACC)
    m_i = tl.full((BLOCK_M,), float("-inf"), ACC)
    lo, u_lo, u_hi, hi = _key_blocks(start_m, S_b, LO, HI, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_d, d_ok, T_b, S_b,
                                LO, HI, qk_scale, cap_in, cap_out, s_kt, s_kd, s_vt, s_vd, lo,
                                u_lo, True, SOFTCAP, BLOCK_N, ACC, PRECISION, TMA)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_d, d_ok, T_b, S_b,
                                LO, HI, qk_scale, cap_in, cap_out, s_kt, s_kd, s_vt, s_vd,
                                u_lo, u_hi, False, SOFTCAP, BLOCK_N, ACC, PRECISION, TMA)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_d, d_ok, T_b, S_b,
                                LO, HI, qk_scale, cap_in, cap_out, s_kt, s_kd, s_vt, s_vd,
                                u_hi, hi, True, SOFTCAP, BLOCK_N, ACC, PRECISION, TMA)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o_base = _slice_base(o_ptr, bh, H, 1, s_ob, s_oh, q0, s_ot)
    _store_rows(o_base, acc / l_safe[:, None], offs_m, offs_d, s_ot, s_od, m_ok, d_ok)
    # lse2 as (B, H, T): T is the longest sequence's length in a packed batch.
    tl.store(lse_ptr + bh.to(tl.int64) * T + offs_m, m_i + tl.log2(l_safe), mask=m_ok)


@autotune(FWD_CONFIGS + FWD_HEAD_256,
          key=["T_BUCKET", "S_BUCKET", "BLOCK_D", "MASK", "SOFTCAP", "VARLEN", "TMA"],
          interpret=INTERPRET_CONFIG, wide=WIDE_CONFIGS, keep=_for_head_dim(FWD_HEAD_256))
@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, qk_scale, cap_in, cap_out,
    H, G, T, S, D, WL, WR, MASK, T_BUCKET, S_BUCKET, BH, GROUP,
    s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt, s_vd,
    s_ob, s_oh, s_ot, s_od,
    VARLEN: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (query block, batch * head); in a packed batch T is the longest
    # sequence, and a shorter one's programs past its end do nothing.
    bh, block = _schedule(cdiv(T, BLOCK_M), BH, GROUP, False)
    q0, T_b, k0, S_b = _sequence(bh // H, cu_q_ptr, cu_k_ptr, T, S, VARLEN)
    start_m = block * BLOCK_M
    if VARLEN:
        if start_m < T_b:
            _fwd_program(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bh, start_m, q0, T_b, k0, S_b,
                         qk_scale, cap_in, cap_out, H, G, T, D, WL, WR, s_qb, s_qh, s_qt,
                         s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt, s_vd, s_ob, s_oh,
                         s_ot, s_od, SOFTCAP, ACC, PRECISION, BLOCK_D, TMA, BLOCK_M, BLOCK_N)
    else:
        _fwd_program(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bh, start_m, q0, T_b, k0, S_b,
                     qk_scale, cap_in, cap_out, H, G, T, D, WL, WR, s_qb, s_qh, s_qt, s_qd,
                     s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt, s_vd, s_ob, s_oh, s_ot, s_od,
                     SOFTCAP, ACC, PRECISION, BLOCK_D, TMA, BLOCK_M, BLOCK_N)


def _loads_through_tma(*operands: torch.Tensor) -> bool:
    """Whether the kernels' loops read their (T, D) tiles through TMA descriptors (16-bit
    data on Hopper, unit stride in d, 16-byte aligned slices: see _tma.tma_ok); if so,
    the scratch allocator the device-made descriptors need is set."""
    use = tma_ok(*operands)
    if use:
        enable_device_descriptors()
    return use


def _heads_per_group(q: torch.Tensor, causal: bool, T: int | None = None) -> int:
    """The GROUP of _schedule. Under a causal mask: the most heads, a power of two, whose
    two streamed (T, D) operands fill at most a quarter of the L2 cache together. On the
    H200 (60 MiB of L2), causal forward+backward timed against the group size ran fastest
    at 4 heads for T=4096 D=128, 2 for T=8192 and 32 for T=1024 D=64, which this gives:
    2-3% faster than one head at a time (a tail of long blocks), 4-7% faster than all
    heads at once (rows fall out of L2). Without a mask all blocks take the same time and
    one head at a time keeps its rows in L2 best. q: (B, H, T, D), or a packed batch's
    (N, H, D) with T its longest sequence (then B * H counts N's heads, an upper bound)."""
    if not causal:
        return 1
    H, D = q.shape[-3], q.shape[-1]
    T = q.shape[2] if T is None else T
    BH = q.shape[0] * H
    fit = max(1, l2_cache_bytes(q.device) // 4 // (2 * max(T, 1) * D * q.element_size()))
    return min(BH, 1 << (fit.bit_length() - 1))


def mask_kind(causal: bool, window: tuple[int, int]) -> int:
    """The autotuner's key for the mask: 0 none, 1 causal, 2 a window (with or without)."""
    return 2 if window[0] >= 0 or (window[1] >= 0 and not causal) else int(causal)


# kernel_args' results by (dims, causal, window, scale, softcap, device, dtype): the forward
# and backward of one call signature share them, and a training step repeats its signatures.
_ARGS: dict[tuple, tuple] = {}


def kernel_args(q: torch.Tensor, dims: tuple[int, int, int, int, int, int], causal: bool,
                window: tuple[int, int], softmax_scale: float, softcap: float) -> tuple:
    """The arguments the three kernels share after their pointers: (qk_scale, cap_in,
    cap_out, H, G, T, S, D, WL, WR, MASK, T_BUCKET, S_BUCKET, B * H, GROUP), for dims =
    (B, H, HK, T, S, D) (T, S: a packed batch's longest sequences). The window's right
    side is 0 under a causal mask; with a softcap the scale moves into the tanh's argument
    (see softcapped) and qk_scale is 1."""
    key = (dims, causal, window, softmax_scale, softcap, q.device, q.dtype)
    args = _ARGS.get(key)
    if args is None:
        B, H, HK, T, S, D = dims
        if softcap > 0:
            scales = (1.0, softmax_scale / softcap, softcap * LOG2E)
        else:
            scales = (softmax_scale * LOG2E, 0.0, 0.0)
        args = _ARGS[key] = (
            *scales, H, H // HK, T, S, D, window[0], 0 if causal else window[1],
            mask_kind(causal, window), next_pow2(T), next_pow2(S), B * H,
            min(B * H, _heads_per_group(q, causal, T)))
    return args


def dense_dims(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """kernel_args' dims of q: (B, H, T, D), k: (B, HK, S, D)."""
    B, H, T, D = q.shape
    return B, H, k.shape[1], T, k.shape[2], D


def head_block(D: int) -> int:
    """BLOCK_D: the head dim padded to a power of two, at least 16."""
    return max(16, next_pow2(D))


def _grid(blocks_of: str, T: int, BH: int):
    """One program per (block, batch*head), in one grid dimension (see _schedule)."""
    return lambda meta: (ceil_div(T, meta[blocks_of]) * BH,)


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  softmax_scale: float, window: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (B, H, T, D), k, v: (B, HK, S, D), H a multiple of HK -> o: (B, H, T, D), lse2:
    (B, H, T) fp32 (fp64). o is laid out as (B, T, H, D) (see output_buffer)."""
    o = output_buffer(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=stat_dtype(q))
    _launch_fwd(q, k, v, o, lse, None, dense_dims(q, k), q.stride(), k.stride(), v.stride(),
                o.stride(), causal, softmax_scale, window, softcap)
    return o, lse


def attention_fwd_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens: tuple[torch.Tensor, torch.Tensor],
                         max_seqlens: tuple[int, int], causal: bool, softmax_scale: float,
                         window: tuple[int, int] = (-1, -1), softcap: float = 0.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed batch: q: (Nq, H, D), k, v: (Nk, HK, D), sequence b being rows
    cu_seqlens[0][b]:[b + 1] of q and cu_seqlens[1][b]:[b + 1] of k and v (int32), none
    longer than max_seqlens -> o: (Nq, H, D), lse2: (batch, H, max_seqlens[0]), 0 past each
    sequence's end (written: an output's every value is defined)."""
    B = cu_seqlens[0].shape[0] - 1
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.zeros((B, q.shape[1], max_seqlens[0]), device=q.device, dtype=stat_dtype(q))
    dims = (B, q.shape[1], k.shape[1], *max_seqlens, q.shape[2])
    _launch_fwd(q, k, v, o, lse, cu_seqlens, dims, packed_strides(q), packed_strides(k),
                packed_strides(v), packed_strides(o), causal, softmax_scale, window, softcap)
    return o, lse


def packed_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """A packed (N, H, D) tensor's strides as the kernels' (batch, head, row, d): no batch
    stride (each sequence starts at its own row)."""
    return 0, t.stride(1), t.stride(0), t.stride(2)


def _launch_fwd(q, k, v, o, lse, cu_seqlens, dims, q_strides, k_strides, v_strides,
                o_strides, causal, softmax_scale, window, softcap) -> None:
    """The forward kernel over dense (cu_seqlens None) or packed tensors, their strides as
    (batch, head, row, d)."""
    B, H = dims[:2]
    varlen = cu_seqlens is not None
    # not read without VARLEN
    cu_q, cu_k = cu_seqlens if varlen else (stand_in(lse), stand_in(lse))
    key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, dims, causal, window,
           softcap > 0)
    _attn_fwd_kernel.planned(key, (
        q, k, v, o, lse, cu_q, cu_k, *kernel_args(q, dims, causal, window, softmax_scale, softcap),
        *q_strides, *k_strides, *v_strides, *o_strides), lambda: (
            _grid("BLOCK_M", dims[3], B * H), dict(
                VARLEN=varlen, SOFTCAP=softcap > 0, ACC=acc_dtype(q), PRECISION=dot_precision(q),
                BLOCK_D=head_block(dims[5]), TMA=_loads_through_tma(k, v))))


def acc_dtype(q: torch.Tensor):
    """The kernels' accumulator dtype: fp64 for fp64 data, else fp32."""
    return tl.float64 if q.dtype == torch.float64 else tl.float32


def output_buffer(q: torch.Tensor) -> torch.Tensor:
    """An uninitialised (B, H, T, D) output stored as (B, T, H, D): heads merged back into
    (B, T, C) by o.transpose(1, 2).reshape(B, T, C), what the output projection reads, is
    then a view instead of a copy."""
    B, H, T, D = q.shape
    return torch.empty((B, T, H, D), device=q.device, dtype=q.dtype).transpose(1, 2)


def grad_buffer(q: torch.Tensor) -> torch.Tensor:
    """An uninitialised (3, B, H, T, D) buffer for [dq, dk, dv], stored as (B, T, 3, H, D):
    what a packed QKV projection's backward reads, the (B*T, 3C) gradient of its output,
    is then this buffer itself (ops.qkv reads it as one matrix: no concatenation)."""
    B, H, T, D = q.shape
    return torch.empty((B, T, 3, H, D), device=q.device, dtype=q.dtype).permute(2, 0, 3, 1, 4)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
