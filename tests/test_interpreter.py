"""Triton's CPU interpreter as the project runs it: bfloat16 tl.dot widened to fp32, fp32 ->
bfloat16 rounded to nearest even."""

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


@triton.jit
def _to_bf16_kernel(x_ptr, cast_ptr, stored_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(cast_ptr + offs, x.to(tl.bfloat16))
    tl.store(stored_ptr + offs, x)  # fp32 values into bf16 memory: the same cast


def test_fp32_to_bf16_rounds_as_torch_does():
    """Round to nearest, ties to even, as the GPU and PyTorch do (the interpreter alone
    truncated): ties both ways, the largest finite values, infinities, NaN, subnormals."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0xBF94C5BC, 0x7F7FFFFF,
                         0x7F7F7FFF, 0x00008000, 0x00018000, 0x80000001, 0x3EAAAAAB],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([bits, torch.tensor([float("inf"), -float("inf"), 0.0, -0.0]),
                   torch.randn(2034) * 10.0 ** torch.randint(-30, 30, (2034,))])
    cast, stored = (torch.empty(x.shape, dtype=torch.bfloat16) for _ in range(2))
    _to_bf16_kernel[(1,)](x, cast, stored, N=x.numel())
    expected = x.to(torch.bfloat16)
    assert torch.equal(cast.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(stored.view(torch.int16), expected.view(torch.int16))
    nan, out = torch.full((2048,), float("nan")), torch.empty(2048, dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](nan, out, out, N=2048)
    assert out.float().isnan().all()


def test_triton_kernels_call_no_jit_helper_of_triton_language():
    """The Triton kernels (not the Gluon ones, which never run on the interpreter) call
    only Triton's builtins: triton.language's own @jit helpers (tl.sum, tl.zeros, ...)
    fail under the interpreter once triton was imported before TRITON_INTERPRET was set,
    which only a whole test run shows (kernels._primitives restates the few needed)."""
    import inspect
    import re
    from pathlib import Path

    import triton.language.standard

    # Read from the source: once a kernel ran under the interpreter in this process,
    # triton.language's attributes may be its patched stand-ins, not JITFunctions.
    source = inspect.getsource(triton.language.standard)
    helpers = sorted(name for decorators, name in re.findall(r"((?:^@[^\n]*\n)+)def (\w+)",
                                                            source, re.M)
                     if re.search(r"^@jit\b", decorators, re.M))
    assert "sum" in helpers and "zeros" in helpers
    call = re.compile(r"\btl\.(" + "|".join(helpers) + r")\(")
    kernels = Path(__file__).parents[1] / "fusedtrain" / "kernels"
    found = [f"{path.name}:{n}: {line.strip()}"
             for path in sorted(kernels.glob("*.py"))
             if path.name != "_primitives.py" and "from triton.experimental import gluon"
             not in path.read_text()
             for n, line in enumerate(path.read_text().splitlines(), 1) if call.search(line)]
    assert not found, "\n".join(found)
