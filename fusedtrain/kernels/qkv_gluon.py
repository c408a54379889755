"""The fused QKV projection's forward as a warp-specialised Gluon kernel for Hopper (the
pipeline and ping-pong consumers of kernels.gemm_gluon): one GEMM over W_qkv = [Wq|Wk|Wv]
((H + 2 HK) D, C) whose epilogue adds the bias, rotates q and k (ROPE) and stores each
head's (BM, D) block straight into q (B, H, T, D) or k, v (B, HK, T, D) by TMA, under the
other consumer's MMAs. The same computation as qkv._qkv_fwd_tma_kernel's head-store path,
which it replaces on sm_90 GPUs up to C = 1024 (qkv.qkv_fwd says why) where every output
tile lies inside one segment and one sequence (CQ = H D and CKV = HK D multiples of BN,
T % BM == 0) and covers whole heads (D = BN or BN / 2).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.language.core import _aggregate as aggregate

from fusedtrain.kernels._launch import fast_launch
from fusedtrain.kernels._primitives import sin_cos
from fusedtrain.kernels.gemm_gluon import (
    ACC_LAYOUT,
    BK,
    BM,
    BN,
    launch,
    make_pipe,
    matrix_desc,
    no_prefetch,
    run,
    stage_tile,
    tile_columns,
)


@aggregate
class _HeadArgs:
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    b_ptr: gl.tensor
    pos_ptr: gl.tensor
    freq_ptr: gl.tensor
    CQ: gl.tensor
    CKV: gl.tensor
    T: gl.tensor
    H: gl.tensor
    HK: gl.tensor
    HAS_BIAS: gl.constexpr
    ROPE: gl.constexpr
    POSITIONS: gl.constexpr
    D: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, b_ptr, pos_ptr, freq_ptr, CQ, CKV, T, H, HK,
                 HAS_BIAS, ROPE, POSITIONS, D):
        self.q_desc, self.k_desc, self.v_desc = q_desc, k_desc, v_desc
        self.b_ptr, self.pos_ptr, self.freq_ptr = b_ptr, pos_ptr, freq_ptr
        self.CQ, self.CKV, self.T, self.H, self.HK = CQ, CKV, T, H, HK
        self.HAS_BIAS, self.ROPE = gl.constexpr(HAS_BIAS), gl.constexpr(ROPE)
        self.POSITIONS, self.D = gl.constexpr(POSITIONS), gl.constexpr(D)


@gluon.jit
def _swap_halves(x, D: gl.constexpr):
    """(BM, BN) with each D-wide head's halves [0, D/2) and [D/2, D) exchanged. In the
    wgmma accumulator's layout a thread holds every 8th column pair, so a column and its
    partner D/2 >= 32 away lie in the same thread: the exchange moves no data."""
    R: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    halves = gl.permute(gl.reshape(x, [R, N // D, 2, D // 2]), [0, 1, 3, 2])
    first, second = gl.split(halves)
    swapped = gl.permute(gl.join(second, first), [0, 1, 3, 2])
    return gl.convert_layout(gl.reshape(swapped, [R, N]), ACC_LAYOUT)


@gluon.jit
def _rotated(e, acc, off_m):
    """acc (BM, BN): tokens off_m.. (one sequence), whole heads of q or k -> each head's
    dims d < D/2 and d + D/2 rotated by the angle p * inv_freq[d], p = positions[m] or
    m % T (kernels.rope's formula, in fp32)."""
    HALF: gl.constexpr = e.D // 2
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC_LAYOUT))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, ACC_LAYOUT)) % e.D
    p = gl.load(e.pos_ptr + rows) if e.POSITIONS else rows % e.T
    freq = gl.load(e.freq_ptr + cols % HALF)
    sin, cos = sin_cos(p.to(gl.float32)[:, None] * freq[None, :])
    sin = gl.where((cols < HALF)[None, :], -sin, sin)
    return acc * cos + _swap_halves(acc, e.D) * sin


@gluon.jit
def _head_epilogue(e, acc, buf, bar, off_m, off_n, j):
    # Output column off_n of the CQ + 2 CKV is column off_c of segment seg (q, k, v);
    # rows off_m.. are tokens t0.. of sequence b; head h's block is rows (b, h, t0..) of q,
    # k or v viewed as a (B*heads*T, D) matrix, the next head's T rows further on. (Every
    # column of the tile exists and lies in one segment: fits.)
    if e.HAS_BIAS:
        acc = acc + gl.load(e.b_ptr + tile_columns(off_n)).to(gl.float32)[None, :]
    seg = gl.where(off_n < e.CQ, 0, 1 + (off_n - e.CQ) // e.CKV)
    if e.ROPE:  # noqa: SIM102 (a constexpr test of its own: no rotation code without ROPE)
        if seg < 2:
            acc = _rotated(e, acc, off_m)
    stage_tile(buf, acc)
    off_c = gl.where(seg == 0, off_n, (off_n - e.CQ) % e.CKV)
    heads = gl.where(seg == 0, e.H, e.HK)
    row = ((off_m // e.T) * heads + off_c // e.D) * e.T + off_m % e.T
    for i in gl.static_range(BN // e.D):
        head = buf.slice(i * e.D, e.D, dim=1)
        if seg == 0:
            tma.async_copy_shared_to_global(e.q_desc, [row + i * e.T, 0], head)
        elif seg == 1:
            tma.async_copy_shared_to_global(e.k_desc, [row + i * e.T, 0], head)
        else:
            tma.async_copy_shared_to_global(e.v_desc, [row + i * e.T, 0], head)


@fast_launch
@gluon.jit
def _qkv_fwd_ws_kernel(x_ptr, w_ptr, b_ptr, pos_ptr, freq_ptr, q_ptr, k_ptr, v_ptr, M, CQ, CKV,
                       T, H, HK, s_xm, s_wn, HAS_BIAS: gl.constexpr, ROPE: gl.constexpr,
                       POSITIONS: gl.constexpr, HEAD_D: gl.constexpr):
    N = CQ + 2 * CKV
    p = make_pipe(matrix_desc(x_ptr, M, CQ, s_xm, BM, BK),
                  matrix_desc(w_ptr, N, CQ, s_wn, BN, BK), M, N, CQ, True)
    D: gl.constexpr = HEAD_D
    args = _HeadArgs(matrix_desc(q_ptr, M * H, D, D, BM, D),
                     matrix_desc(k_ptr, M * HK, D, D, BM, D),
                     matrix_desc(v_ptr, M * HK, D, D, BM, D), b_ptr, pos_ptr, freq_ptr,
                     gl.to_tensor(CQ), gl.to_tensor(CKV), gl.to_tensor(T), gl.to_tensor(H),
                     gl.to_tensor(HK), HAS_BIAS, ROPE, POSITIONS, D)
    run(p, args, q_ptr.dtype.element_ty, no_prefetch, _head_epilogue)


def fits(T: int, CQ: int, CKV: int, D: int) -> bool:
    """Whether every (BM, BN) output tile lies in one sequence and one of q, k, v and
    covers one or two whole heads (CQ = H D features of q, CKV = HK D of k and of v)."""
    return (T % BM.value == 0 and CQ % BN.value == 0 and CKV % BN.value == 0
            and D in (BN.value, BN.value // 2))


def qkv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, q: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor, freq: torch.Tensor | None = None,
            positions: torch.Tensor | None = None) -> None:
    """x: (B*T, C) tokens, weight: ((H + 2 HK) D, C), bias: its rows -> q: (B, H, T, D),
    k, v: (B, HK, T, D), contiguous, written in place (see fits); with freq (kernels.rope's
    (D/2,) fp32 inv_freq), q and k rotated at positions ((B*T,) contiguous ints, default t)."""
    M, C = x.shape
    _, H, T, D = q.shape
    HK = k.shape[1]
    launch(_qkv_fwd_ws_kernel, M, C + 2 * HK * D, x.device, x, weight,
           q if bias is None else bias, q if positions is None else positions,
           q if freq is None else freq, q, k, v, M, C, HK * D, T, H, HK, x.stride(0),
           weight.stride(0), HAS_BIAS=bias is not None, ROPE=freq is not None,
           POSITIONS=positions is not None, HEAD_D=D)
