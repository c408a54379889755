"""The pointer-based GEMM pieces: the main loop (with an optional GELU on B), the grouped
tile order, a tile with its masks, the constexpr flags and the tilings the autotuner tries."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedtrain.kernels._device import acc_dtype, dot_precision
from fusedtrain.kernels._primitives import cdiv, device_fn
from fusedtrain.kernels.gelu import gelu_mode, gelu_operand


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


GEMM_SHAPES = [(128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4),
               (128, 128, 64, 3, 8), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
               (64, 64, 64, 4, 4), (128, 128, 32, 4, 4)]


def gemm_configs(shapes: list[tuple[int, ...]] = GEMM_SHAPES) -> list[triton.Config]:
    """Hopper-leaning GEMM tilings (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) for the
    autotuner (bf16/fp16; the fp32 ones that do not fit in shared memory are skipped by
    the autotuner)."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8},
                          num_stages=s, num_warps=w) for m, n, k, s, w in shapes]


INTERPRET_GEMM = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8})
WIDE_GEMM = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8},
                           num_stages=2, num_warps=4)]
