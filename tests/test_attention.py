import shutil

import pytest
import torch
import triton
import triton.language as tl
from conftest import assert_within_eager_error, check_against_oracle, grads_of

from fusedtrain import eager, ops
from fusedtrain.gradcheck import gradcheck
from fusedtrain.kernels import attention as attention_kernels

F64 = torch.float64


def _qkv(B, H, T, D, dtype=F64, scale=1.0):
    return [(torch.randn(B, H, T, D, dtype=dtype) * scale).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck(causal):
    assert gradcheck(lambda *a: ops.flash_attention(*a, causal=causal), _qkv(2, 2, 13, 16),
                     fast_mode=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,D", [(1, 16), (13, 32), (113, 80), (203, 64), (1023, 128)])
def test_fp32_accuracy(T, D, causal):
    B, H = (1, 1) if T > 500 else (2, 2)
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(B, H, T, D))
    check_against_oracle(lambda *a: ops.flash_attention(*a, causal),
                         lambda *a: eager.flash_attention(*a, causal), (q, k, v), 1e-5)


def test_large_logits_stay_finite():
    q, k, v = (t.detach().float() for t in _qkv(1, 2, 77, 32))
    q, k = q * 30 ** 0.5, k * 30 ** 0.5  # logits 30x the usual scale
    out = ops.flash_attention(q, k, v, causal=True)
    ref = eager.flash_attention(q.double(), k.double(), v.double(), causal=True)
    assert_within_eager_error(out, eager.flash_attention(q, k, v, causal=True), ref, 1e-5, "o")


@pytest.mark.parametrize("causal", [True, False])
def test_every_block_in_head_groups(causal, monkeypatch):
    """Programs walk heads in groups (kernels.attention._schedule); with 5 heads in groups
    of 2, the last group is short, and each head has 3 query and 3 key blocks."""
    monkeypatch.setattr(attention_kernels, "_heads_per_group", lambda *_: 2)
    monkeypatch.setattr(attention_kernels, "_ARGS", {})  # no group size kept from before
    q, k, v = _qkv(5, 1, 300, 16)
    check_against_oracle(lambda *a: ops.flash_attention(*a, causal),
                         lambda *a: eager.flash_attention(*a, causal), (q, k, v), 1e-12)


@triton.jit
def _schedule_map(out_ptr, n_blocks, BH, GROUP, LOW_FIRST: tl.constexpr):
    bh, block = attention_kernels._schedule(n_blocks, BH, GROUP, LOW_FIRST)
    tl.store(out_ptr + 2 * tl.program_id(0), bh)
    tl.store(out_ptr + 2 * tl.program_id(0) + 1, block)


@pytest.mark.parametrize("n_blocks,BH,group", [(3, 5, 2), (1, 4, 4), (7, 3, 1), (4, 6, 4)])
@pytest.mark.parametrize("low_first", [True, False])
def test_schedule_visits_every_block_once_longest_first(n_blocks, BH, group, low_first):
    """Program ids map one to one onto (head, block); within a group of heads, the blocks
    come longest first (block 0 first for key blocks, the last for query blocks)."""
    out = torch.empty(n_blocks * BH, 2, dtype=torch.int32)
    _schedule_map[(n_blocks * BH,)](out, n_blocks, BH, group, LOW_FIRST=low_first)
    assert sorted(map(tuple, out.tolist())) == [(h, b) for h in range(BH) for b in range(n_blocks)]
    for first in range(0, BH, group):
        heads = set(range(first, min(first + group, BH)))
        steps = [b if low_first else n_blocks - 1 - b for h, b in out.tolist() if h in heads]
        assert steps == sorted(steps)


def test_heads_per_group_rule(monkeypatch):
    """Causal: the most heads, a power of two, whose K and V fill a quarter of L2 (on an
    H200's 60 MiB: 32 / 4 / 2 heads at #5's benchmark shapes, the sizes measured fastest),
    never more than B * H; without a mask one head at a time."""
    monkeypatch.setattr(attention_kernels, "l2_cache_bytes", lambda device: 60 * 2**20)
    group = attention_kernels._heads_per_group
    for (B, H, T, D), heads in [((16, 12, 1024, 64), 32), ((4, 16, 4096, 128), 4),
                                ((2, 16, 8192, 128), 2), ((1, 2, 64, 16), 2),
                                ((1, 1, 65536, 128), 1)]:
        q = torch.empty(B, H, T, D, dtype=torch.bfloat16)
        assert group(q, causal=True) == heads
        assert group(q, causal=False) == 1


def test_dkdv_configs_timed_at_head_dim_128():
    """The dk/dv autotuner skips 4-warp 128-key tiles at D=128 (they spill), not at D=64."""
    configs = attention_kernels.BWD_KV_CONFIGS
    kept = [c for c in configs if attention_kernels._dkdv_fits(c, BLOCK_D=128)]
    assert kept and all(c.num_warps == 8 or c.kwargs["BLOCK_N"] == 64 for c in kept)
    assert len(kept) < len(configs)
    assert all(attention_kernels._dkdv_fits(c, BLOCK_D=64) for c in configs)


def test_strided_inputs():
    base = torch.randn(2, 19, 3, 3, 16, dtype=F64)  # (B, T, 3, H, D), as a packed projection
    q, k, v = (base[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D) views
    torch.testing.assert_close(ops.flash_attention(q, k, v), eager.flash_attention(q, k, v))


def test_output_merges_heads_without_a_copy():
    """o is stored (B, T, H, D): the output projection's (B, T, C) input is a view of it,
    and gradients arriving through that view (strided dO) are still right."""
    q, k, v = (t.detach().requires_grad_() for t in _qkv(2, 3, 21, 16))
    o = ops.flash_attention(q, k, v)
    merged = o.transpose(1, 2).reshape(2, 21, 48)
    assert merged.data_ptr() == o.data_ptr() and merged.is_contiguous()
    g = torch.randn_like(merged)
    grads = torch.autograd.grad(merged, (q, k, v), g)
    ref = eager.flash_attention(q, k, v).transpose(1, 2).reshape(2, 21, 48)
    for a, b in zip(grads, torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b)
    # dq, dk, dv come as slices of one (B, T, 3, H, D) buffer: the packed QKV projection's
    # output gradient, which its backward reads as one matrix.
    assert all(t.stride() == (21 * 3 * 48, 16, 3 * 48, 1) for t in grads)
    assert grads[1].data_ptr() - grads[0].data_ptr() == 48 * grads[0].element_size()


def test_softmax_scale():
    q, k, v = (t.detach() for t in _qkv(1, 1, 9, 16))
    torch.testing.assert_close(ops.flash_attention(q, k, v, False, 0.3),
                               eager.flash_attention(q, k, v, False, 0.3))


def test_compile_fullgraph_matches_eager():
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(1, 2, 33, 16))
    compiled = torch.compile(lambda *a: ops.flash_attention(*a), fullgraph=True,
                             backend="aot_eager")
    (o,), grads, g = grads_of(compiled, (q, k, v))
    (r,), ref_g, _ = grads_of(lambda *a: eager.flash_attention(*a), (q, k, v), g)
    for a, b in zip((o, *grads), (r, *ref_g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        shutil.which("g++") is None, reason="inductor on CPU needs a C++ compiler")),
])
def test_compiled_chain_keeps_the_layouts_and_the_packed_qkv_backward(backend, monkeypatch):
    """The compilers take the ops' non-contiguous output and gradient layouts from their
    fake implementations: the QKV -> attention -> head merge chain compiled matches eager
    in fp64, gradients included, and the QKV backward still finds dq, dk, dv as one packed
    matrix at run time (its strided kernels, the other path, are made to fail)."""
    from fusedtrain.kernels import qkv as qkv_kernels

    def refuse(*_):
        raise AssertionError("the strided QKV backward ran: the packed layout was lost")

    B, T, C, H = 2, 9, 24, 3
    x, w, b, wp = (torch.randn(*s, dtype=F64, requires_grad=True)
                   for s in ((B, T, C), (3 * C, C), (3 * C,), (C, C)))

    def chain(x, w, b, wp, fused=True):
        q, k, v = (ops if fused else eager).qkv_projection(x, w, b, H)
        y = (ops if fused else eager).flash_attention(q, k, v, causal=True)
        return (y.transpose(1, 2).reshape(B, T, C) @ wp).sin().sum()

    def value_and_grads(out):
        return (out, *torch.autograd.grad(out, (x, w, b, wp)))

    ref = value_and_grads(chain(x, w, b, wp, fused=False))
    monkeypatch.setattr(qkv_kernels, "qkv_dx", refuse)
    monkeypatch.setattr(qkv_kernels, "qkv_dw", refuse)
    if backend == "inductor":  # as fusedtrain's own compile sites do
        ops.register_inductor_fallbacks()
    got = value_and_grads(torch.compile(chain, fullgraph=True, backend=backend)(x, w, b, wp))
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r)


def test_bad_inputs():
    q, k, v = (t.detach() for t in _qkv(1, 2, 8, 16))
    with pytest.raises(ValueError, match="q"):
        ops.flash_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="k and v"):
        ops.flash_attention(q, k[:, :, :4], v)
    with pytest.raises(ValueError, match="k and v"):
        ops.flash_attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="multiple"):
        ops.flash_attention(torch.cat([q, q[:, :1]], 1), k, v)
    big = torch.randn(1, 1, 4, 264, dtype=F64)
    with pytest.raises(ValueError, match="head dim"):
        ops.flash_attention(big, big, big)
    for window in [(-2, 0), (1,), (1.5, 2), 3]:
        with pytest.raises(ValueError, match="window"):
            ops.flash_attention(q, k, v, window=window)
    for cap in [0.0, -1.0, float("inf")]:
        with pytest.raises(ValueError, match="softcap"):
            ops.flash_attention(q, k, v, softcap=cap)
    with pytest.raises(TypeError, match="k"):
        ops.flash_attention(q, k.float(), v)
    with pytest.raises(TypeError, match="q"):
        ops.flash_attention(q.int(), k, v)


def _gqa(B, Hq, Hkv, T, S, D, dtype=F64):
    """q (B, Hq, T, D), k, v (B, Hkv, S, D), leaves."""
    return [torch.randn(B, h, n, D, dtype=dtype).requires_grad_()
            for h, n in ((Hq, T), (Hkv, S), (Hkv, S))]


# (B, Hq, Hkv, T, S, D, causal, window, softcap): each new argument alone, then together.
FEATURES = {
    "gqa": (1, 4, 2, 11, 11, 16, True, None, None),
    "mqa": (2, 3, 1, 9, 9, 16, False, None, None),
    "longer_keys_causal": (1, 2, 2, 7, 13, 16, True, None, None),
    "fewer_keys_causal": (1, 2, 2, 13, 7, 16, True, None, None),  # rows that see nothing
    "window": (1, 2, 2, 15, 15, 16, False, (3, 2), None),
    "window_causal": (1, 2, 2, 15, 12, 16, True, (4, -1), None),
    "window_left_open": (1, 2, 1, 12, 15, 16, False, (-1, 1), None),
    "softcap": (1, 2, 2, 10, 10, 16, True, None, 1.5),
    "head_dim_200": (1, 1, 1, 6, 6, 200, False, None, None),
    "together": (1, 4, 2, 9, 14, 24, True, (5, 3), 2.0),
}


@pytest.mark.parametrize("case", FEATURES)
def test_gradcheck_of_every_argument(case):
    B, Hq, Hkv, T, S, D, causal, window, softcap = FEATURES[case]
    assert gradcheck(lambda *a: ops.flash_attention(*a, causal=causal, window=window,
                                                    softcap=softcap),
                     _gqa(B, Hq, Hkv, T, S, D), fast_mode=True)


@pytest.mark.parametrize("case", FEATURES)
def test_arguments_match_the_twin(case):
    B, Hq, Hkv, T, S, D, causal, window, softcap = FEATURES[case]
    args = _gqa(B, Hq, Hkv, T, S, D)
    check_against_oracle(
        lambda *a: ops.flash_attention(*a, causal, window=window, softcap=softcap),
        lambda *a: eager.flash_attention(*a, causal, window=window, softcap=softcap), args,
        1e-12)


def _mask_by_loops(T, S, causal, window):
    left, right = window or (-1, -1)
    right = 0 if causal else right
    seen = torch.zeros(T, S, dtype=torch.bool)
    for i in range(T):
        for j in range(S):
            d = j - (i + S - T)
            seen[i, j] = (left < 0 or d >= -left) and (right < 0 or d <= right)
    return seen


@pytest.mark.parametrize("T,S,causal,window", [
    (6, 6, True, None), (5, 9, True, None), (9, 5, True, None), (8, 8, False, (2, 1)),
    (7, 10, True, (3, 5)), (10, 7, False, (-1, 0)), (6, 6, False, None)])
def test_twin_against_sdpa_with_its_mask(T, S, causal, window):
    """The eager twin, the oracle of the fused op, against PyTorch's SDPA given the mask
    written out by loops (bottom-right aligned), grouped heads expanded by SDPA itself;
    rows that see no key are zeros in the twin and are left out of the comparison."""
    seen = _mask_by_loops(T, S, causal, window)
    q, k, v = (t.detach() for t in _gqa(2, 4, 2, T, S, 16))
    got = eager.flash_attention(q, k, v, causal, window=window)
    bias = torch.zeros(T, S, dtype=F64).masked_fill(~seen, float("-inf"))
    rows = seen.any(-1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, rows], k, v, attn_mask=bias[rows], enable_gqa=True)
    torch.testing.assert_close(got[:, :, rows], want)
    assert (got[:, :, ~rows] == 0).all()


def test_softcap_twin_is_tanh_of_the_scaled_scores():
    q, k, v = (t.detach() for t in _qkv(1, 2, 7, 16))
    scores = q @ k.transpose(-2, -1) / 4.0
    want = torch.softmax(3.0 * torch.tanh(scores / 3.0), -1) @ v
    torch.testing.assert_close(eager.flash_attention(q, k, v, False, softcap=3.0), want)


@pytest.mark.parametrize("window", [(200, 200), (40, 20), (150, -1)])
def test_windows_over_many_blocks(window):
    """Rows of 600 under the interpreter's 128-row tiles: blocks wholly inside the window
    (unmasked), cut by its edges on either side, and skipped."""
    args = _gqa(1, 2, 1, 600, 600, 16, dtype=torch.float32)
    check_against_oracle(lambda *a: ops.flash_attention(*a, False, window=window),
                         lambda *a: eager.flash_attention(*a, False, window=window), args, 1e-5)


@pytest.mark.parametrize("T,S", [(113, 300), (300, 113)])
def test_causal_cross_lengths_over_many_blocks(T, S):
    args = _gqa(1, 4, 2, T, S, 32, dtype=torch.float32)
    check_against_oracle(lambda *a: ops.flash_attention(*a, True),
                         lambda *a: eager.flash_attention(*a, True), args, 1e-5)


@pytest.mark.parametrize("D", [96, 192])
def test_fp32_accuracy_at_odd_head_dims(D):
    args = _gqa(1, 2, 2, 113, 113, D, dtype=torch.float32)
    check_against_oracle(lambda *a: ops.flash_attention(*a, True, softcap=30.0),
                         lambda *a: eager.flash_attention(*a, True, softcap=30.0), args, 1e-5)


def test_grouped_gradients_come_in_the_output_layout():
    """With grouped heads dq is laid out as o (B, T, Hq, D) and dk, dv as (B, S, Hkv, D)."""
    q, k, v = _gqa(2, 4, 2, 5, 7, 16)
    dq, dk, dv = torch.autograd.grad(ops.flash_attention(q, k, v).sum(), (q, k, v))
    assert all(g.transpose(1, 2).is_contiguous() for g in (dq, dk, dv))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,H,T,D", [(16, 12, 1024, 64), (4, 16, 4096, 128), (2, 3, 1000, 80)])
def test_gpu_bf16_accuracy_and_determinism(B, H, T, D, causal):
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_()
               for t in _qkv(B, H, T, D, dtype=torch.float32))
    check_against_oracle(lambda *a: ops.flash_attention(*a, causal),
                         lambda *a: eager.flash_attention(*a, causal), (q, k, v), 1e-3)
    # The same inputs twice give bit-identical outputs and gradients (no races).
    (o1,), g1, g = grads_of(lambda *a: ops.flash_attention(*a, causal), (q, k, v))
    (o2,), g2, _ = grads_of(lambda *a: ops.flash_attention(*a, causal), (q, k, v), g)
    assert torch.equal(o1, o2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spread", [0.3, 3.0])
def test_gpu_16bit_accuracy_with_concentrated_and_spread_scores(dtype, spread):
    """Both 16-bit dtypes within docs/design.md's rule, causal and not, at an odd length, with
    scores concentrated near zero (spread 0.3) and spread wide (3: rows dominated by a few
    keys)."""
    q, k, v = (t.detach().cuda() for t in _qkv(4, 6, 1023, 64, dtype=torch.float32))
    q, k, v = ((t * s).to(dtype).requires_grad_() for t, s in ((q, spread), (k, spread), (v, 1)))
    for causal in (True, False):
        check_against_oracle(lambda *a, c=causal: ops.flash_attention(*a, c),
                             lambda *a, c=causal: eager.flash_attention(*a, c), (q, k, v), 1e-3)


# (B, Hq, Hkv, T, S, D, causal, window, softcap) at GPU sizes: every tile path of the new
# arguments, odd lengths and head dims included.
GPU_FEATURES = {
    "gqa": (2, 8, 2, 1024, 1024, 128, True, None, None),
    "window": (1, 4, 4, 2047, 2047, 64, True, (256, 0), None),
    "window_both_sides": (1, 4, 2, 1500, 1500, 80, False, (300, 100), None),
    "softcap": (2, 4, 4, 1023, 1023, 96, True, None, 30.0),
    "head_dim_256": (1, 4, 4, 1023, 1023, 256, True, None, None),
    "head_dim_192": (1, 4, 1, 700, 700, 192, False, None, None),
    "more_keys": (1, 4, 2, 500, 1500, 64, True, None, None),
    "fewer_keys": (1, 4, 4, 1500, 500, 64, True, None, None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_FEATURES)
def test_gpu_bf16_arguments_accuracy_and_determinism(case):
    B, Hq, Hkv, T, S, D, causal, window, softcap = GPU_FEATURES[case]
    args = [t.detach().cuda().bfloat16().requires_grad_()
            for t in _gqa(B, Hq, Hkv, T, S, D, dtype=torch.float32)]

    def fused(*a):
        return ops.flash_attention(*a, causal, window=window, softcap=softcap)

    check_against_oracle(fused, lambda *a: eager.flash_attention(
        *a, causal, window=window, softcap=softcap), args, 1e-3)
    (o1,), g1, g = grads_of(fused, args)
    (o2,), g2, _ = grads_of(fused, args, g)
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


def _packed(lengths_q, lengths_k, Hq, Hkv, D, dtype=F64):
    """q (Nq, Hq, D), k, v (Nk, Hkv, D) leaves and their int32 cu_seqlens."""
    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    q = torch.randn(sum(lengths_q), Hq, D, dtype=dtype).requires_grad_()
    k, v = (torch.randn(sum(lengths_k), Hkv, D, dtype=dtype).requires_grad_() for _ in range(2))
    return q, k, v, cu(lengths_q), cu(lengths_k)


# (query lengths, key lengths, Hq, Hkv, causal, window, softcap): lengths 0 and 1, queries
# without keys, more or fewer keys than queries.
VARLEN = {
    "self": ([5, 1, 0, 9], [5, 1, 0, 9], 2, 2, True, None, None),
    "cross_gqa": ([3, 7, 2], [6, 4, 0], 4, 2, True, None, None),
    "window_softcap": ([8, 11], [8, 11], 2, 1, False, (2, 3), 2.0),
}


@pytest.mark.parametrize("case", VARLEN)
def test_varlen_gradcheck(case):
    lq, lk, Hq, Hkv, causal, window, softcap = VARLEN[case]
    q, k, v, cu_q, cu_k = _packed(lq, lk, Hq, Hkv, 16)
    assert gradcheck(lambda *a: ops.flash_attention_varlen(
        *a, cu_q, cu_k, max(lq), max(lk), causal, window=window, softcap=softcap), (q, k, v),
        fast_mode=True)


@pytest.mark.parametrize("case", VARLEN)
def test_varlen_matches_each_sequence_alone(case):
    """The packed op against its twin, which runs flash_attention's twin on each sequence
    alone: no attention crosses a boundary, each mask aligns to its sequence's end."""
    lq, lk, Hq, Hkv, causal, window, softcap = VARLEN[case]
    q, k, v, cu_q, cu_k = _packed(lq, lk, Hq, Hkv, 16)
    args = (cu_q, cu_k, max(lq), max(lk), causal)
    check_against_oracle(
        lambda *a: ops.flash_attention_varlen(*a, *args, window=window, softcap=softcap),
        lambda *a: eager.flash_attention_varlen(*a, *args, window=window, softcap=softcap),
        (q, k, v), 1e-12)


def test_varlen_over_many_blocks():
    """Sequences longer than the interpreter's 128-row tiles, packed unevenly."""
    q, k, v, cu_q, cu_k = _packed([300, 7, 140], [300, 7, 140], 2, 1, 32, dtype=torch.float32)
    args = (cu_q, cu_k, 300, 300, True)
    check_against_oracle(lambda *a: ops.flash_attention_varlen(*a, *args),
                         lambda *a: eager.flash_attention_varlen(*a, *args), (q, k, v), 1e-5)


def test_varlen_bad_inputs():
    q, k, v, cu, _ = _packed([3, 4], [3, 4], 2, 2, 16)
    q, k, v = q.detach(), k.detach(), v.detach()
    good = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        ops.flash_attention_varlen(q, k, v, **{**good, "cu_seqlens_q": cu.long()})
    for bad in ([1, 3, 7], [0, 4, 3], [0, 3, 6]):
        with pytest.raises(ValueError, match="cu_seqlens_k"):
            ops.flash_attention_varlen(
                q, k, v, **{**good, "cu_seqlens_k": torch.tensor(bad, dtype=torch.int32)})
    with pytest.raises(ValueError, match="cu_seqlens_q"):  # a sequence past max_seqlen_q
        ops.flash_attention_varlen(q, k, v, **{**good, "max_seqlen_q": 3})
    with pytest.raises(ValueError, match="one length"):
        ops.flash_attention_varlen(q, k, v, **{**good, "cu_seqlens_k": cu[:2]})
    with pytest.raises(ValueError, match="multiple"):
        ops.flash_attention_varlen(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1),
                                   **good)
    with pytest.raises(ValueError, match="q"):
        ops.flash_attention_varlen(q[None], k, v, **good)


def test_varlen_reads_a_cu_seqlens_pair_once_until_it_is_written(monkeypatch):
    """A model's layers pass one batch's cu_seqlens: its values are read from the device
    once; after an in-place write (or for other sizes) they are checked again."""
    q, k, v, cu, _ = _packed([3, 4], [3, 4], 2, 2, 16)
    q, k, v = q.detach(), k.detach(), v.detach()
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    for _ in range(3):
        ops.flash_attention_varlen(q, k, v, cu, cu, 4, 4)
    assert len(reads) == 1
    ops.flash_attention_varlen(q, k, v, cu, cu, 5, 5)  # other sizes: checked again
    assert len(reads) == 2
    cu[1] = 9  # past the end: a write the next call must see
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ops.flash_attention_varlen(q, k, v, cu, cu, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q"):  # a failed check marks nothing
        ops.flash_attention_varlen(q, k, v, cu, cu, 4, 4)


@pytest.mark.gpu
def test_gpu_bf16_varlen_accuracy_and_determinism():
    """Lengths 0 and 1 beside long ones (the benchmark's tile choice: the same buckets)."""
    lengths = [2600, 1, 0, 900, 333]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 4, 4, 128, dtype=torch.float32)
    args = [t.detach().cuda().bfloat16().requires_grad_() for t in (q, k, v)]
    extra = (cu_q.cuda(), cu_k.cuda(), 3000, 3000, True)
    check_against_oracle(lambda *a: ops.flash_attention_varlen(*a, *extra),
                         lambda *a: eager.flash_attention_varlen(*a, *extra), args, 1e-3)
    (o1,), g1, g = grads_of(lambda *a: ops.flash_attention_varlen(*a, *extra), args)
    (o2,), g2, _ = grads_of(lambda *a: ops.flash_attention_varlen(*a, *extra), args, g)
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
