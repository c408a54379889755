"""LayerNorm family kernels: LayerNorm, residual-add + LayerNorm, LayerNorm -> GELU, and
RMSNorm (with or without the residual add) as the same kernels without the centring.

Forward: each program normalises a tile of BLOCK_M rows x BLOCK_C (C padded to the next
power of two and masked), or, for LayerNorm->GELU where C is 3, 5 or 7 times a power of
two >= 256, the rows in that many unpadded chunks (_row_chunks); statistics in fp32
(fp64 for fp64 data) whatever the input dtype; writes mean and rstd per row when a
backward will read them (not under no_grad: inference writes y alone, as Inductor does).
Tiles (rows per program, warps): autotuned per (C, variant) over a few sizes (_row_tiles),
timed as CUDA-graph replays (GPU time; a launch costs more host time than these kernels).
Backward: a persistent grid of programs, each walking row tiles pid, pid + G, ... keeping
its dW / db partial sums in fp32 registers; the (G, 2, C) partials are summed once at
the end, by bias_grad's column-sum kernel: no atomics on the hot path.
GELU after the affine map is recomputed in backward from x and the saved statistics.
The residual form may also add x_bias, the bias of the layer that made x, as x is read;
its gradient, dx's column sums, is one more partial-sum row of the same backward pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET
from fusedtrain.kernels._device import acc_dtype, ceil_div, next_pow2, sm_count, stat_dtype
from fusedtrain.kernels._launch import plan_once, stand_in
from fusedtrain.kernels._primitives import device_fn, row_sum
from fusedtrain.kernels._tuning import cached_autotune, graph_timed
from fusedtrain.kernels.bias_grad import column_sums
from fusedtrain.kernels.gelu import gelu, gelu_grad, gelu_mode

NO_GELU = -1
MAX_C = 65536


def _row_tiles(configs: list[triton.Config], named_args: dict, BLOCK_C: int, **_):
    """The (BLOCK_M rows, num_warps[, LOOP_STAGES]) candidates for rows of BLOCK_C (C
    padded): on a GPU, tiles of 1K to 16K elements with 4 to 32 elements per thread (one
    row of 16 warps past that); a pipelined row loop only for tiles of up to 8K elements
    (its loads are buffered in shared memory). Under the interpreter, whose cost is per
    program, one tile of up to 64K.
    The backward at 16384 x 768 (padded to 1024) runs fastest on one row a tile, loads
    issued 3 tiles ahead: 51.9 us against 56.9 at 4 rows, the best of the tiles it had
    before (H200, docs/journal.md)."""
    looped = "LOOP_STAGES" in configs[0].kwargs
    if INTERPRET:
        rows = {"BLOCK_M": max(1, min(64, (1 << 16) // BLOCK_C))}
        return [triton.Config({**rows, "LOOP_STAGES": 1} if looped else rows)]
    fit = [c for c in configs
           if 1024 <= c.kwargs["BLOCK_M"] * BLOCK_C <= 16384
           and 4 <= c.kwargs["BLOCK_M"] * BLOCK_C // (32 * c.num_warps) <= 32
           and (c.kwargs.get("LOOP_STAGES", 1) == 1 or c.kwargs["BLOCK_M"] * BLOCK_C <= 8192)]
    one_row = {"BLOCK_M": 1, "LOOP_STAGES": 1} if looped else {"BLOCK_M": 1}
    return fit or [triton.Config(one_row, num_warps=16)]


ROW_CONFIGS = [triton.Config({"BLOCK_M": m}, num_warps=w)
               for m in (1, 2, 4, 8, 16) for w in (4, 8, 16)]
# The forward also on one or two warps (rows of up to 2K, by _row_tiles' 32 elements per
# thread): Inductor launches its LayerNorm at C = 768 on one row and one warp, 12.97 us
# against our best four-warp tile's 13.34 (docs/journal.md).
NARROW_CONFIGS = [triton.Config({"BLOCK_M": m}, num_warps=w) for m in (1, 2) for w in (1, 2)]
# The backward's persistent loop over row tiles, also with its loads issued 3 tiles ahead
# (tl.range's num_stages pipelines loads that feed no dot, which a kernel's num_stages
# does not).
LOOP_CONFIGS = [triton.Config({**c.kwargs, "LOOP_STAGES": s}, num_warps=c.num_warps)
                for c in ROW_CONFIGS for s in (1, 3)]


@device_fn
def _input_tile(x_ptr, xb_ptr, r_ptr, s_ptr, r_off, cols, col_ok, mask, s_x, s_r, s_s,
                HAS_XB: tl.constexpr, HAS_RES: tl.constexpr, STORE_S: tl.constexpr,
                ACC: tl.constexpr, EVICT: tl.constexpr):
    """A (rows, cols) tile of the input, (x + x_bias) + residual with HAS_XB and HAS_RES
    (stored as the new residual stream s if STORE_S). r_off: (rows, 1) row indices; col_ok:
    cols < C; mask: the tile's."""
    x = tl.load(x_ptr + r_off * s_x + cols[None, :], mask=mask, other=0.0,
                eviction_policy=EVICT).to(ACC)
    if HAS_XB:  # the bias of the sublayer that made x, read by every program
        x += tl.load(xb_ptr + cols, mask=col_ok, other=0.0,
                     eviction_policy="evict_last").to(ACC)[None, :]
    if HAS_RES:
        x += tl.load(r_ptr + r_off * s_r + cols[None, :], mask=mask, other=0.0,
                     eviction_policy=EVICT).to(ACC)
        if STORE_S:
            tl.store(s_ptr + r_off * s_s + cols[None, :], x.to(s_ptr.dtype.element_ty),
                     mask=mask)
    return x


@device_fn
def _inv_sqrt(v):
    """1 / sqrt(v): the hardware's reciprocal square root in fp32 (within 2 ulp, as in
    PyTorch's CUDA LayerNorm), an exact division in fp64 (what the gradient checks use)."""
    return 1.0 / tl.sqrt(v) if v.dtype == tl.float64 else tl.rsqrt(v)


@device_fn
def _affine_store(xhat, w_ptr, b_ptr, y_ptr, r_off, cols, col_ok, mask, s_y,
                  HAS_W: tl.constexpr, HAS_B: tl.constexpr, GELU: tl.constexpr,
                  ACC: tl.constexpr):
    """y = [gelu](xhat * w + b) for a tile of normalised values; w and b are read by every
    program (evict last)."""
    y = xhat
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0,
                        eviction_policy="evict_last").to(ACC)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=col_ok, other=0.0,
                        eviction_policy="evict_last").to(ACC)[None, :]
    if GELU >= 0:
        y = gelu(y, GELU)
    tl.store(y_ptr + r_off * s_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@cached_autotune(ROW_CONFIGS + NARROW_CONFIGS, key=["C", "HAS_RES", "GELU", "STATS", "RMS"],
                 prune=_row_tiles, do_bench=graph_timed)
@triton.jit
def _ln_fwd_kernel(
    x_ptr, xb_ptr, r_ptr, w_ptr, b_ptr, y_ptr, s_ptr, stats_ptr, M, C, eps,
    s_x, s_r, s_y, s_s,
    HAS_XB: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    GELU: tl.constexpr, STATS: tl.constexpr, OFF64: tl.constexpr, EVICT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, N_CHUNKS: tl.constexpr, RMS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    # Row offsets in int32 where every element offset fits (cheaper address arithmetic).
    r_off = rows.to(tl.int64)[:, None] if OFF64 else rows[:, None]
    if N_CHUNKS == 1:  # the row in one tile, C padded to BLOCK_C
        cols = tl.arange(0, BLOCK_C)
        col_ok = cols < C
        mask = row_ok[:, None] & col_ok[None, :]
        x = _input_tile(x_ptr, xb_ptr, r_ptr, s_ptr, r_off, cols, col_ok, mask, s_x, s_r,
                        s_s, HAS_XB, HAS_RES, True, ACC, EVICT)
        if RMS:  # RMSNorm: no centring; the mean stored is 0 for the backward
            mean = tl.full((BLOCK_M,), 0.0, ACC)
            xc = x
        else:
            mean = row_sum(x, 1) / C
            xc = x - mean[:, None]  # -mean in padded columns: kept out of the variance alone
        rstd = _inv_sqrt(row_sum(tl.where(col_ok[None, :], xc * xc, 0.0), 1) / C + eps)
        _affine_store(xc * rstd[:, None], w_ptr, b_ptr, y_ptr, r_off, cols, col_ok, mask, s_y,
                      HAS_W, HAS_B, GELU, ACC)
    elif N_CHUNKS == 3:
        # C = 3 x BLOCK_C exactly (GPT-2's 768 = 3 x 256): no padded lanes, and the three
        # chunks stay in registers between the statistics and the output (H200, LayerNorm->
        # GELU at 16384 x 768: 18.6 us re-reading them from cache, 16.8 held).
        c0 = tl.arange(0, BLOCK_C)
        c1, c2 = c0 + BLOCK_C, c0 + 2 * BLOCK_C
        col_ok = c0 < BLOCK_C  # all true: the helpers take masks, and no column is padded
        mask = row_ok[:, None] & col_ok[None, :]
        x0 = _input_tile(x_ptr, xb_ptr, r_ptr, s_ptr, r_off, c0, col_ok, mask, s_x, s_r,
                         s_s, HAS_XB, HAS_RES, True, ACC, EVICT)
        x1 = _input_tile(x_ptr, xb_ptr, r_ptr, s_ptr, r_off, c1, col_ok, mask, s_x, s_r,
                         s_s, HAS_XB, HAS_RES, True, ACC, EVICT)
        x2 = _input_tile(x_ptr, xb_ptr, r_ptr, s_ptr, r_off, c2, col_ok, mask, s_x, s_r,
                         s_s, HAS_XB, HAS_RES, True, ACC, EVICT)
        # The chunks share one layout: add them lane by lane, then reduce across lanes
        # once (a third of the shuffles and barriers of three reductions).
        mean = row_sum(x0 + x1 + x2, 1) / C
        x0, x1, x2 = x0 - mean[:, None], x1 - mean[:, None], x2 - mean[:, None]
        rstd = _inv_sqrt(row_sum(x0 * x0 + x1 * x1 + x2 * x2, 1) / C + eps)
        _affine_store(x0 * rstd[:, None], w_ptr, b_ptr, y_ptr, r_off, c0, col_ok, mask, s_y,
                      HAS_W, HAS_B, GELU, ACC)
        _affine_store(x1 * rstd[:, None], w_ptr, b_ptr, y_ptr, r_off, c1, col_ok, mask, s_y,
                      HAS_W, HAS_B, GELU, ACC)
        _affine_store(x2 * rstd[:, None], w_ptr, b_ptr, y_ptr, r_off, c2, col_ok, mask, s_y,
                      HAS_W, HAS_B, GELU, ACC)
    else:
        # C = N_CHUNKS x BLOCK_C exactly (5 or 7 chunks). Pass 1 merges each chunk's mean
        # and squared deviations into the row's (Chan et al.'s pairwise update, as stable
        # as the two-pass form); pass 2 reads the chunks again (from cache) to normalise.
        mean = tl.full((BLOCK_M,), 0.0, ACC)
        m2 = tl.full((BLOCK_M,), 0.0, ACC)
        for j in tl.static_range(N_CHUNKS):
            cols = j * BLOCK_C + tl.arange(0, BLOCK_C)
            col_ok = cols < C
            mask = row_ok[:, None] & col_ok[None, :]
            x = _input_tile(x_ptr, xb_ptr, r_ptr, s_ptr, r_off, cols, col_ok, mask, s_x, s_r,
                            s_s, HAS_XB, HAS_RES, True, ACC, EVICT)
            chunk_mean = row_sum(x, 1) / BLOCK_C
            d = x - chunk_mean[:, None]
            delta = chunk_mean - mean
            mean += delta / (j + 1)
            m2 += row_sum(d * d, 1) + delta * delta * (BLOCK_C * j / (j + 1))
        rstd = _inv_sqrt(m2 / C + eps)
        for j in tl.static_range(N_CHUNKS):
            cols = j * BLOCK_C + tl.arange(0, BLOCK_C)
            col_ok = cols < C
            mask = row_ok[:, None] & col_ok[None, :]
            x = _input_tile(x_ptr, xb_ptr, r_ptr, s_ptr, r_off, cols, col_ok, mask, s_x, s_r,
                            s_s, HAS_XB, HAS_RES, False, ACC, EVICT)
            _affine_store((x - mean[:, None]) * rstd[:, None], w_ptr, b_ptr, y_ptr, r_off,
                          cols, col_ok, mask, s_y, HAS_W, HAS_B, GELU, ACC)
    if STATS:  # only when a backward will read them (inference writes y alone)
        tl.store(stats_ptr + rows, mean.to(stats_ptr.dtype.element_ty), mask=row_ok)
        tl.store(stats_ptr + M + rows, rstd.to(stats_ptr.dtype.element_ty), mask=row_ok)


@cached_autotune(LOOP_CONFIGS, key=["C", "HAS_DS", "HAS_DX2", "DX_SUMS", "GELU", "RMS"],
                 prune=_row_tiles, do_bench=graph_timed)
@triton.jit
def _ln_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, b_ptr, stats_ptr, ds_ptr, dx_ptr, dx2_ptr, part_ptr,
    M, C, s_dy, s_x, s_ds, s_dx, s_dx2,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DS: tl.constexpr, HAS_DX2: tl.constexpr,
    DX_SUMS: tl.constexpr, GELU: tl.constexpr,
    ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    LOOP_STAGES: tl.constexpr, RMS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    w = tl.full((BLOCK_C,), 1.0, ACC)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(ACC)
    b = tl.full((BLOCK_C,), 0.0, ACC)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(ACC)
    dw_acc = tl.full((BLOCK_C,), 0.0, ACC)
    db_acc = tl.full((BLOCK_C,), 0.0, ACC)
    dx_acc = tl.full((BLOCK_C,), 0.0, ACC)
    for start in tl.range(pid * BLOCK_M, M, n_progs * BLOCK_M, num_stages=LOOP_STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * s_x + cols[None, :], mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + r64 * s_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
        mean = tl.load(stats_ptr + rows, mask=row_ok, other=0.0).to(ACC)
        rstd = tl.load(stats_ptr + M + rows, mask=row_ok, other=0.0).to(ACC)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if GELU >= 0:  # y = gelu(z), z = xhat * w + b: dz = dy * gelu'(z), z recomputed
            dy = dy * gelu_grad(xhat * w[None, :] + b[None, :], GELU)
        dw_acc += row_sum(dy * xhat, 0)
        db_acc += row_sum(dy, 0)
        wdy = tl.where(mask, dy * w[None, :], 0.0)
        c1 = row_sum(xhat * wdy, 1) / C
        if RMS:  # no mean was subtracted: no mean of the gradient to take out
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = row_sum(wdy, 1) / C
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_DS:  # gradient reaching the residual-stream output s directly
            dx += tl.load(ds_ptr + r64 * s_ds + cols[None, :], mask=mask, other=0.0).to(ACC)
        if DX_SUMS:  # the gradient of add_layer_norm's x_bias: dx's column sums
            dx_acc += row_sum(dx, 0)
        tl.store(dx_ptr + r64 * s_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DX2:  # the same gradient in a second dtype (add_layer_norm's two inputs)
            tl.store(dx2_ptr + r64 * s_dx2 + cols[None, :], dx.to(dx2_ptr.dtype.element_ty),
                     mask=mask)
    # This program's row of the (G, 2 or 3, C) partials: [dW part, db part(, dx part)].
    row = part_ptr + pid * (2 + DX_SUMS) * C + cols
    tl.store(row, dw_acc, mask=col_ok)
    tl.store(row + C, db_acc, mask=col_ok)
    if DX_SUMS:
        tl.store(row + 2 * C, dx_acc, mask=col_ok)


def _row_stride(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The row stride of a (..., C) tensor of this shape and these strides read in place as
    (M, C) rows: a unit column stride and leading dimensions that collapse into one (a
    (B, T, C) activation, or a slice of one); None if it has none (then a copy is read)."""
    if strides[-1] != 1 and shape[-1] > 1:
        return None
    row = expected = None
    for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if expected is not None and stride != expected:
            return None
        row = stride if row is None else row
        expected = stride * size
    return shape[-1] if row is None else row


def _rows_in_place(t: torch.Tensor, row_stride: int | None) -> tuple[torch.Tensor, int]:
    """(t, its row stride), or (t's rows copied, C) where t cannot be read in place."""
    if row_stride is not None:
        return t, row_stride
    return t.reshape(-1, t.shape[-1]).contiguous(), t.shape[-1]


def _dtype(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def _row_chunks(C: int, gelu: bool) -> dict:
    """The forward's BLOCK_C and N_CHUNKS. With a GELU, rows of C = 3, 5 or 7 x a power of
    two of at least 256 (GPT-2's 768 = 3 x 256, 1280, 1536, 3072, 5120, ...) go as that
    many unpadded chunks (three held in registers, five or seven re-read from cache): the
    GELU's arithmetic bounds that kernel, and at C = 768 a quarter of a padded tile's lanes
    would compute it for nothing (H200, 16384 x 768: 28 -> 23 us in chunks re-read, 16.8
    in registers). Otherwise one tile padded to the next power of two: without a GELU the
    forward is bound by memory and chunks were no faster (LayerNorm 13.5-14.1 us in
    chunks against 13.9-14.0 padded over two runs; the residual form 27.9 against 27.0;
    docs/journal.md)."""
    chunk = C & -C  # the largest power of two dividing C
    if gelu and chunk != C and chunk >= 256 and C // chunk <= 7:
        return {"BLOCK_C": chunk, "N_CHUNKS": C // chunk}
    return {"BLOCK_C": next_pow2(C), "N_CHUNKS": 1}


def _gelu_code(approximate: str | None, out: torch.Tensor) -> int:
    """GELU constexpr (gelu_mode: its fast forms only where `out`, what the GELU feeds, is
    16-bit)."""
    return NO_GELU if approximate is None else gelu_mode(approximate, out)


def layer_norm_fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float, approximate: str | None,
                   out_dtype: torch.dtype, stream_dtype: torch.dtype, save_stats: bool = True,
                   x_bias: torch.Tensor | None = None, rms: bool = False):
    """x, residual: (..., C) of one shape, x_bias: (C,). Returns (y, s, stats): y =
    [gelu](LN(x [+ x_bias] [+ residual])) in out_dtype, s = x [+ x_bias] + residual in
    stream_dtype (None without residual), and stats (2, M): the rows' mean and rstd in
    fp32 (fp64 for fp64 x), (2, 0) unless save_stats (only a backward reads them). With
    `rms`, RMSNorm instead: x / sqrt(mean(x^2) + eps), not centred (the mean stored is 0),
    no GELU."""
    has_res = residual is not None
    key = (x.shape, x.stride(), x.dtype,
           (residual.stride(), residual.dtype) if has_res else None, _dtype(weight),
           _dtype(bias), _dtype(x_bias), out_dtype, stream_dtype, approximate, save_stats, rms)

    def plan():  # what follows from the signature: rows' strides, outputs' shapes, dtypes
        if rms and approximate is not None:
            raise ValueError("RMSNorm has no GELU form here")
        C = x.shape[-1]
        s_r = _row_stride(residual.shape, residual.stride()) if has_res else None
        return (x.numel() // max(C, 1), C, _row_stride(x.shape, x.stride()), s_r,
                tuple(x.shape), stat_dtype(x))

    M, C, s_x, s_r, shape, stat = plan_once(("layer_norm_fwd", *key), plan)
    x, s_x = _rows_in_place(x, s_x)
    if has_res:
        residual, s_r = _rows_in_place(residual, s_r)
    device = x.device
    y = torch.empty(*shape, dtype=out_dtype, device=device)
    stats = torch.empty(2, M if save_stats else 0, dtype=stat, device=device)
    s = torch.empty(*shape, dtype=stream_dtype, device=device) if has_res else None
    strides = (s_x, s_r, C, C) if has_res else (s_x, s_x, C, 0)

    def launch():
        return (lambda meta: (ceil_div(M, meta["BLOCK_M"]),)), dict(
            HAS_XB=x_bias is not None, HAS_RES=has_res, HAS_W=weight is not None,
            HAS_B=bias is not None, GELU=_gelu_code(approximate, y), STATS=save_stats,
            OFF64=M * max(strides) + C >= 2**31,
            # Measured on an H200 at 16384 x 768: evicting the rows first helps LayerNorm
            # (14.5 vs 15.7 us) and hurts the residual form, which reads two inputs and
            # writes two outputs (27.3 vs 26.4 us).
            EVICT="" if has_res else "evict_first",
            ACC=acc_dtype(x), RMS=rms, **_row_chunks(C, approximate is not None))

    _ln_fwd_kernel.planned(key, (
        x, x if x_bias is None else x_bias, residual if has_res else x,
        x if weight is None else weight, x if bias is None else bias, y,
        s if has_res else stand_in(y),
        stats, M, C, eps, *strides), launch)
    return y, s, stats


def _num_programs(M: int, block_c: int, device: torch.device) -> int:
    """Persistent grid size, whatever rows a program's tile holds: 4 programs per SM, 2 for
    rows of 4096 and wider (each writes a row of dW / db partials; a sweep over 2, 4 and
    8 on an H200 put these within 5% of the best at every benchmark shape); a
    handful under the interpreter."""
    if INTERPRET:
        return min(M, 4)
    return min(M, min(4, max(2, 8192 // block_c)) * sm_count(device))


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, stats: torch.Tensor, ds: torch.Tensor | None,
                   approximate: str | None, dx_dtype: torch.dtype,
                   dx2_dtype: torch.dtype | None = None, dx_sums: bool = False,
                   sums_dtype: torch.dtype | None = None, rms: bool = False):
    """Gradients of y = [gelu](LN(x)) w.r.t. x (plus ds, the gradient that reached the
    residual stream output, if given), weight and bias; dy, ds: x's shape (..., C), stats
    the forward's (2, M). x is the normalised input (s for add_layer_norm). Returns (dx,
    dx2, sums): dx2 is dx again in dx2_dtype, written by the same pass (None if not
    asked: add_layer_norm's two inputs may differ in dtype, and a separate cast would
    re-read dx); sums (2, C) holds the dW and db sums (each meaningful only if that
    parameter exists), reduced together in one launch, in fp32 (fp64 for fp64 x) or
    sums_dtype (written in it by that launch: no cast kernel for parameters of that dtype),
    and with dx_sums a third row, dx's column sums (add_layer_norm's x_bias gradient).
    With `rms`, RMSNorm's (see layer_norm_fwd)."""
    key = (x.shape, x.stride(), dy.stride(), x.device, dy.dtype, x.dtype,
           (ds.stride(), ds.dtype) if ds is not None else None, _dtype(weight), _dtype(bias),
           dx_dtype, dx2_dtype, dx_sums, sums_dtype, approximate, rms)

    def plan():  # what follows from the signature: rows' strides, the grid, the outputs
        C = x.shape[-1]
        M = x.numel() // max(C, 1)
        block_c = next_pow2(C)
        return (M, C, block_c, _row_stride(x.shape, x.stride()),
                _row_stride(dy.shape, dy.stride()),
                None if ds is None else _row_stride(ds.shape, ds.stride()), tuple(x.shape),
                _num_programs(M, block_c, x.device), 3 if dx_sums else 2, stat_dtype(x))

    M, C, block_c, s_x, s_dy, s_ds, shape, G, n_sums, part_dtype = plan_once(
        ("layer_norm_bwd", *key), plan)
    x, s_x = _rows_in_place(x, s_x)
    dy, s_dy = _rows_in_place(dy, s_dy)
    if ds is not None:
        ds, s_ds = _rows_in_place(ds, s_ds)
    device = x.device
    dx = torch.empty(*shape, dtype=dx_dtype, device=device)
    dx2 = None if dx2_dtype is None else torch.empty(*shape, dtype=dx2_dtype, device=device)
    parts = torch.empty(G, n_sums * C, dtype=part_dtype, device=device)
    sums = torch.empty(n_sums, C, dtype=sums_dtype or part_dtype, device=device)
    _ln_bwd_kernel.planned(key, (
        dy, x, x if weight is None else weight, x if bias is None else bias, stats,
        dy if ds is None else ds, dx, stand_in(dx) if dx2 is None else dx2, parts, M, C,
        s_dy, s_x, s_dy if ds is None else s_ds, C, C), lambda: ((G,), dict(
            HAS_W=weight is not None, HAS_B=bias is not None, HAS_DS=ds is not None,
            HAS_DX2=dx2 is not None, DX_SUMS=dx_sums, GELU=_gelu_code(approximate, dx),
            ACC=acc_dtype(x), BLOCK_C=block_c, RMS=rms)))
    column_sums(parts, sums)
    return dx, dx2, sums
