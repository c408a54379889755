import pytest
import torch

from fusedtrain.model import GPT, KERNEL_FAMILIES, GPTConfig

TINY = dict(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32)


def test_gpt2_parameter_count():
    # GPT-2 small with the vocabulary padded to 50304, position embeddings left out.
    assert GPT(GPTConfig()).num_params() == 123_689_472


def test_forward_shapes_and_tied_head():
    model = GPT(GPTConfig(**TINY))
    logits = model(torch.randint(0, 256, (3, 17)))
    assert logits.shape == (3, 17, 256)
    # Tied head: with the token embedding zeroed, every logit is exactly zero.
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        assert torch.count_nonzero(model(torch.randint(0, 256, (1, 5)))) == 0
    wpe = model.transformer.wpe.weight.numel()
    assert model.num_params(non_embedding=False) - model.num_params() == wpe


def test_residual_projection_init_is_scaled():
    model = GPT(GPTConfig(**{**TINY, "n_layer": 8, "n_embd": 128}))
    std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    assert abs(std - 0.02 / (2 * 8) ** 0.5) < 0.002


def test_parameter_count_survives_sharding():
    """FSDP replaces each rank's parameters by flat shards; MFU must still count the model."""
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    full = model.num_params()
    for p in model.parameters():
        p.data = p.data.flatten()[: p.numel() // 2]
    assert model.num_params() == full


def test_flops_per_token():
    model = GPT(GPTConfig(**TINY))
    expected = 6 * model.num_params() + 12 * 2 * 32 * 32
    assert model.flops_per_token() == expected
    windowed = GPT(GPTConfig(**TINY, attention_window=7))  # 8 keys a query at most
    assert windowed.flops_per_token() == 6 * windowed.num_params() + 12 * 2 * 32 * 8


def test_grouped_heads_and_window_in_the_model():
    """n_kv_head=1: c_attn projects to (n_head + 2) * D; attention_window=2: a token's loss
    does not depend on tokens more than 2 (x layers) back; the sdpa and math eager paths
    agree."""
    cfg = dict(TINY, n_head=4, n_kv_head=1, attention_window=2, n_layer=1)
    model = GPT(GPTConfig(**cfg))
    assert model.transformer.h[0].attn.c_attn.weight.shape == (6 * 8, 32)
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 0] = (x[0, 0] + 1) % 256  # beyond the window of positions 3 and later
    torch.testing.assert_close(model(x)[0, 3:], model(y)[0, 3:])
    assert not torch.allclose(model(x)[0, 2], model(y)[0, 2])
    sdpa = GPT(GPTConfig(**cfg, eager_attention="sdpa"))
    sdpa.load_state_dict(model.state_dict())
    torch.testing.assert_close(sdpa(x), model(x), rtol=1e-5, atol=1e-5)


def test_sequence_longer_than_block_size_is_refused():
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(0, 256, (1, 33)))


@pytest.mark.parametrize("bad,match", [
    (dict(n_embd=30, n_head=4), "divisible"), (dict(n_layer=0), "n_layer"),
    (dict(kernels={"mlp": True, "conv": True}), "conv"), (dict(gelu="relu"), "gelu"),
    (dict(n_kv_head=3), "n_kv_head"), (dict(n_kv_head=0), "n_kv_head"),
    (dict(attention_window=-1), "attention_window"),
])
def test_bad_config(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, **bad})


def test_eager_training_lowers_loss():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 16, (8, 33))  # a small vocabulary: learnable quickly
    losses = []
    for _ in range(40):
        loss = model.loss(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


GROUPED = dict(n_head=4, n_kv_head=2, attention_window=5)


@pytest.mark.parametrize("family,extra", [*[(f, {}) for f in (*KERNEL_FAMILIES, "all")],
                                          ("attention", GROUPED), ("qkv", GROUPED),
                                          ("all", GROUPED)])
def test_fused_and_eager_models_agree(family, extra):
    """Same weights, same batch: loss and every gradient match in fp32, also with grouped
    key/value heads and a sliding window. (Biases made nonzero: the fused model adds the
    output projections' biases in its LayerNorms.)"""
    kernels = {k: family in (k, "all") for k in KERNEL_FAMILIES}
    torch.manual_seed(0)
    eager_model = GPT(GPTConfig(**{**TINY, **extra}))
    with torch.no_grad():
        for name, p in eager_model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    fused_model = GPT(GPTConfig(**{**TINY, **extra}, kernels=kernels))
    fused_model.load_state_dict(eager_model.state_dict())
    x = torch.randint(0, 256, (2, 32))
    losses = []
    for m in (eager_model, fused_model):
        loss = m.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, pe), pf in zip(eager_model.named_parameters(), fused_model.parameters()):
        torch.testing.assert_close(pf.grad, pe.grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("op", ["linear_gelu", "qkv_projection", "flash_attention",
                                "layer_norm"])
def test_ops_name_the_tensor_on_another_device(op):
    from fusedtrain import ops

    x, meta = torch.randn(1, 4, 8), dict(device="meta")
    calls = {
        "linear_gelu": lambda: ops.linear_gelu(x, torch.randn(6, 8, **meta)),
        "qkv_projection": lambda: ops.qkv_projection(x, torch.randn(24, 8, **meta), None, 2),
        "flash_attention": lambda: ops.flash_attention(x[None], x[None].to(**meta), x[None]),
        "layer_norm": lambda: ops.layer_norm(x, torch.randn(8, **meta), None),
    }
    with pytest.raises(ValueError, match="is on meta"):
        calls[op]()


def test_fused_model_runs_on_the_meta_device():
    """Deferred initialisation and shape inference: the fused GPT built on the meta device
    runs its loss and backward without data, every gradient a meta tensor of its
    parameter's shape."""
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16,
                    kernels=dict.fromkeys(KERNEL_FAMILIES, True))
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.randint(0, 64, (2, 16))
    loss = model.loss(idx, idx)
    loss.backward()
    assert loss.is_meta and loss.shape == ()
    assert all(p.grad is not None and p.grad.is_meta and p.grad.shape == p.shape
               for p in model.parameters())


LLAMA_TINY = dict(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                  bias=False, norm="rmsnorm", mlp="swiglu", mlp_hidden=48, pos="rope",
                  tie_head=False)


def test_llama_block_fused_equals_eager_and_has_llamas_parameters():
    """model.norm=rmsnorm, mlp=swiglu, pos=rope, grouped heads, no biases, untied head:
    every fused family against the eager model in fp64, loss and every gradient."""
    eager_model = GPT(GPTConfig(**LLAMA_TINY)).double()
    fused_model = GPT(GPTConfig(**LLAMA_TINY,
                                kernels=dict.fromkeys(KERNEL_FAMILIES, True))).double()
    fused_model.load_state_dict(eager_model.state_dict())
    names = [n for n, _ in eager_model.named_parameters()]
    assert "lm_head.weight" in names and not any("wpe" in n or "bias" in n for n in names)
    assert "transformer.h.0.mlp.gate_proj.weight" in names
    assert eager_model.transformer.h[0].attn.c_attn.weight.shape == ((4 + 2 * 2) * 8, 32)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    losses = []
    for model in (eager_model, fused_model):
        loss = model.loss(idx, targets)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    for (name, p), q in zip(eager_model.named_parameters(), fused_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert eager_model.num_params() == eager_model.num_params(non_embedding=False)
    n = eager_model.num_params() - 64 * 32  # the untied token table only looks rows up
    assert eager_model.flops_per_token(16) == 6 * n + 12 * 2 * 32 * 16


def test_swiglu_hidden_default_and_llama_setting_errors():
    assert GPTConfig(n_embd=768, n_head=12, mlp="swiglu", bias=False).mlp_hidden == 2048
    assert GPTConfig(n_embd=64, n_head=2).mlp_hidden == 256
    for kw, match in ((dict(mlp="swiglu"), "model.bias=false"), (dict(norm="batch"), "norm"),
                      (dict(pos="alibi"), "model.pos"), (dict(mlp_hidden=0), "mlp_hidden"),
                      (dict(rope_base=1.0), "rope_base"),
                      (dict(pos="rope", n_embd=30, n_head=10), "even")):
        with pytest.raises(ValueError, match=match):
            GPTConfig(**kw)
