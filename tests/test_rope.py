"""ops.rotary and ops.qkv_projection's grouped heads and rotary embeddings, against their
eager twins and transformers' Llama (fp64 gradcheck, layouts, bad input)."""

import pytest
import torch
from conftest import grads_of

from fusedtrain import eager, ops
from fusedtrain.gradcheck import gradcheck

F64 = torch.float64


def test_rotary_gradcheck_and_twin_with_and_without_positions():
    x = torch.randn(2, 2, 5, 4, dtype=F64, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 0, 1], [7, 8, 9, 10, 400]])
    for pos in (None, positions):
        assert gradcheck(lambda t, pos=pos: ops.rotary(t, 500.0, pos), (x,))
        (y,), (g,), dy = grads_of(lambda t, pos=pos: ops.rotary(t, 500.0, pos), (x,))
        (ref,), (ref_g,), _ = grads_of(lambda t, pos=pos: eager.rotary(t, 500.0, pos), (x,), dy)
        torch.testing.assert_close(y, ref)
        torch.testing.assert_close(g, ref_g)
    # a rotation: norms of each (d, d + D/2) pair kept, the angle of position 0 is 0
    y = ops.rotary(x.detach(), 10000.0)
    pairs = (x.detach()[..., :2] ** 2 + x.detach()[..., 2:] ** 2)
    torch.testing.assert_close(y[..., :2] ** 2 + y[..., 2:] ** 2, pairs)
    torch.testing.assert_close(y[:, :, 0], x.detach()[:, :, 0])


def test_rotary_matches_transformers_llama():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    cfg = llama.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0,
                            max_position_embeddings=64)
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 4, 7, 16)
    positions = torch.arange(7)[None].expand(2, 7) + torch.tensor([[0], [20]])
    cos, sin = llama.LlamaRotaryEmbedding(cfg)(q, positions)
    q_ref, k_ref = llama.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(ops.rotary(q, 10000.0, positions), q_ref)
    torch.testing.assert_close(eager.rotary(k, 10000.0, positions), k_ref)


def test_rotary_keeps_a_token_major_layout():
    """On a (B, T, H, D) tensor's (B, H, T, D) view the output is one too: merging heads
    back, or packing tokens, stays a view."""
    x = torch.randn(2, 5, 3, 8).transpose(1, 2)
    y = ops.rotary(x, 10000.0)
    assert y.stride() == x.stride()
    torch.testing.assert_close(y, eager.rotary(x, 10000.0))


@pytest.mark.parametrize("kw", [dict(n_kv_heads=2), dict(n_kv_heads=1, rope_base=10000.0),
                                dict(rope_base=50.0), dict(n_kv_heads=2, rope_base=50.0,
                                                           positions="packed")])
def test_qkv_projection_grouped_and_rotary_gradcheck_and_twin(kw):
    """Every Jacobian entry for the case with every argument (packed positions); the
    others through gradcheck's fast mode (random projections of the Jacobian, a fraction
    of the interpreter's time), all against both eager twins."""
    B, T, C, H = 2, 3, 8, 4
    kv = kw.get("n_kv_heads", H) * (C // H)
    packed = kw.get("positions") == "packed"
    if packed:
        kw = {**kw, "positions": torch.tensor([[0, 1, 0], [3, 0, 1]])}
    x, w, b = (torch.randn(*s, dtype=F64, requires_grad=True)
               for s in ((B, T, C), (C + 2 * kv, C), (C + 2 * kv,)))
    assert gradcheck(lambda *a: ops.qkv_projection(*a, H, **kw), (x, w, b),
                     fast_mode=not packed)
    fused, grads, g = grads_of(lambda *a: ops.qkv_projection(*a, H, **kw), (x, w, b))
    for twin in (eager.qkv_projection, eager.qkv_projection_packed):
        ref, ref_grads, _ = grads_of(lambda *a, twin=twin: twin(*a, H, **kw), (x, w, b), g)
        for a, r in zip((*fused, *grads), (*ref, *ref_grads)):
            torch.testing.assert_close(a, r)
    assert fused[1].shape == (B, kw.get("n_kv_heads", H), T, C // H)


def test_qkv_projection_grouped_and_rotary_under_compile():
    """fullgraph torch.compile through the one op (positions and the base pass its fake
    and backward), equal to the eager twin."""
    B, T, C, H, HK = 2, 6, 16, 4, 2
    rows = C + 2 * HK * (C // H)
    x, w = torch.randn(B, T, C, requires_grad=True), torch.randn(rows, C, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [4, 5, 0, 1, 2, 3]])
    fn = lambda x, w, pos: ops.qkv_projection(x, w, None, H, HK, 500.0, pos)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    outs, grads, g = grads_of(lambda x, w: compiled(x, w, positions), (x, w))
    refs, ref_grads, _ = grads_of(
        lambda x, w: eager.qkv_projection(x, w, None, H, HK, 500.0, positions), (x, w), g)
    for a, r in zip((*outs, *grads), (*refs, *ref_grads)):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)


def test_bad_inputs():
    x, w = torch.randn(2, 5, 24, dtype=F64), torch.randn(48, 24, dtype=F64)
    with pytest.raises(ValueError, match="weight"):
        ops.qkv_projection(x, w, None, 4)  # 72 rows for 4 query and 4 key/value heads
    with pytest.raises(ValueError, match="n_kv_heads"):
        ops.qkv_projection(x, w, None, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="rope_base"):
        ops.qkv_projection(x, w, None, 4, n_kv_heads=2, rope_base=1.0)
    with pytest.raises(ValueError, match="positions"):
        ops.qkv_projection(x, w, None, 4, n_kv_heads=2, positions=torch.zeros(2, 5).long())
    with pytest.raises(ValueError, match="positions"):
        ops.rotary(x.view(2, 5, 4, 6), 100.0, torch.zeros(2, 5).long())  # (B, H), not (B, T)
    with pytest.raises(ValueError, match="even"):
        ops.rotary(torch.randn(1, 1, 2, 5), 100.0)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T,D", [(16, 12, 1024, 64), (2, 32, 4096, 128), (3, 5, 113, 80)])
def test_gpu_bf16_rotary_within_eager_error(B, H, T, D):
    """bf16 on the GPU against the fp64 oracle, positions restarting mid-row, the 2x rule;
    a token-major layout kept."""
    from conftest import check_against_oracle

    x = torch.randn(B, T, H, D, device="cuda").bfloat16().transpose(1, 2).requires_grad_()
    positions = (torch.arange(T, device="cuda") % (T // 2 + 1)).expand(B, T).contiguous()
    check_against_oracle(lambda t: ops.rotary(t, 10000.0, positions),
                         lambda t: eager.rotary(t, 10000.0, positions), [x], atol=1e-3)
    assert ops.rotary(x.detach(), 10000.0).stride() == x.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,H,HK", [(16, 1024, 768, 12, 4), (16, 1024, 768, 12, 12),
                                        (3, 113, 400, 5, 1)])
def test_gpu_bf16_qkv_projection_rotated_within_eager_error(B, T, C, H, HK):
    """bf16 on the GPU, q and k rotated in the GEMM's epilogue (llama-124m's shape through
    the TMA kernel; D = 80, T = 113 through the pointer kernel), positions restarting
    mid-row, against the fp64 oracle: the 2x rule for outputs and gradients."""
    from conftest import check_against_oracle

    rows = C + 2 * HK * (C // H)
    x = torch.randn(B, T, C, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(rows, C, device="cuda") / C ** 0.5).bfloat16().requires_grad_()
    positions = (torch.arange(T, device="cuda") % (T // 2 + 1)).expand(B, T).contiguous()
    check_against_oracle(lambda *a: ops.qkv_projection(*a, None, H, HK, 10000.0, positions),
                         lambda *a: eager.qkv_projection(*a, None, H, HK, 10000.0, positions),
                         [x, w], 1e-2, 1e-2, "rotated qkv")


def test_frequencies_cached_except_while_traced(monkeypatch):
    """The (D/2,) frequency table is built once per (D, base, device, dtype); while traced
    for torch.compile it is built anew (a cached traced tensor would outlive its graph as
    a fake constant, as the llama model's compile on the H200 showed)."""
    from fusedtrain.kernels import rope

    args = (64, 10000.0, torch.device("cpu"), torch.float32)
    assert rope.inv_freq(*args) is rope.inv_freq(*args)
    monkeypatch.setattr(rope, "tracing", lambda: True)
    assert rope.inv_freq(*args) is not rope.inv_freq(*args)
    torch.testing.assert_close(rope.inv_freq(*args), 10000.0 ** (-torch.arange(32) / 32))
