"""fusedtrain.patch.gpt2: a transformers GPT-2 switched to the fused ops in place gives the
unpatched model's logits, loss and gradients (fp32, through the interpreter on CPU), still
generates, and refuses by name what its kernels cannot do."""

import copy

import pytest
import torch

from fusedtrain import patch

transformers = pytest.importorskip("transformers")


def _gpt2(**overrides):
    torch.manual_seed(0)
    settings = dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = transformers.GPT2Config(**{**settings, **overrides})
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # biases and LayerNorms away from their zeros and ones
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def test_the_patched_model_trains_like_the_unpatched_one(monkeypatch):
    from fusedtrain import ops

    calls = []
    for name in ("layer_norm", "fused_mlp", "flash_attention", "cross_entropy"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name, **k: calls.append(
            name) or real(*a, **k))
    plain = _gpt2()
    fused = patch.gpt2(copy.deepcopy(plain))
    idx = torch.randint(0, 96, (2, 19))
    labels = idx.clone()
    labels[0, :3] = -100
    outs = [m(input_ids=idx, labels=labels) for m in (plain, fused)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=1e-5, atol=1e-6)
    # Two blocks' two LayerNorms and ln_f, their MLPs and attentions, one loss.
    assert sorted(calls) == sorted(["layer_norm"] * 5 + ["fused_mlp"] * 2
                                   + ["flash_attention"] * 2 + ["cross_entropy"])
    for out in outs:
        out.loss.backward()
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert fused.config._attn_implementation == patch.ATTENTION


def test_the_patched_model_generates_what_the_unpatched_one_does():
    plain = _gpt2().eval()
    fused = patch.gpt2(copy.deepcopy(plain)).eval()
    prompt = torch.randint(0, 96, (1, 5))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(fused.generate(prompt, **kw), plain.generate(prompt, **kw))


def test_some_families_only():
    plain = _gpt2()
    fused = patch.gpt2(copy.deepcopy(plain), kernels={"attention": False, "cross_entropy": False})
    assert fused.config._attn_implementation != patch.ATTENTION
    idx = torch.randint(0, 96, (2, 9))
    torch.testing.assert_close(fused(idx).logits, plain(idx).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides, kernels, setting", [
    ({"attn_pdrop": 0.1}, None, "attn_pdrop"),
    ({"add_cross_attention": True}, None, "add_cross_attention"),
    ({"activation_function": "relu"}, None, "activation_function"),
    ({}, {"qkv": True}, "kernels"),
])
def test_what_the_kernels_cannot_do_is_refused_by_name(overrides, kernels, setting):
    with pytest.raises(ValueError, match=setting):
        patch.gpt2(_gpt2(**overrides), kernels=kernels)


def test_a_padded_batch_is_refused_by_the_fused_attention():
    fused = patch.gpt2(_gpt2())
    idx = torch.randint(0, 96, (2, 9))
    mask = torch.ones_like(idx)
    mask[1, -2:] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        fused(input_ids=idx, attention_mask=mask)
