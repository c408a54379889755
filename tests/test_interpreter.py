"""Triton's CPU interpreter as the project runs it: bfloat16 tl.dot widened to fp32."""

import pytest
import torch
import triton
import triton.language as tl

from fusedtrain.kernels import INTERPRET


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's tl.dot")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_dot_is_fp32_sums_of_exact_products(dtype):
    a, b = torch.randn(16, 32).to(dtype), torch.randn(32, 16).to(dtype)
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, M=16, N=16, K=32)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)
