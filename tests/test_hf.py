"""Hugging Face interop (fusedtrain.hf): a transformers GPT-2 loads into a fused or eager
GPT with the same logits, and scripts/export.py format=hf writes a directory that
transformers loads without a warning, with the padded vocabulary rows dropped."""

import json
import logging
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from fusedtrain.model import GPT, KERNEL_FAMILIES, GPTConfig
from fusedtrain.training.checkpoint import save_checkpoint

transformers = pytest.importorskip("transformers")


def _hf_gpt2(**overrides):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, **overrides)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # biases and LayerNorms away from their zeros and ones
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.mark.parametrize("fused", [False, True])
def test_a_transformers_gpt2_loads_with_its_logits(tmp_path, fused):
    hf = _hf_gpt2()
    hf.save_pretrained(tmp_path)
    kernels = dict.fromkeys(KERNEL_FAMILIES, fused)
    idx = torch.randint(0, 100, (2, 17))
    with torch.no_grad():
        want = hf(idx).logits
        for source in (str(tmp_path), hf):
            ours = GPT.from_hf(source, kernels=kernels).eval()
            assert ours.config.vocab_size == 100 and ours.config.gelu == "tanh"
            torch.testing.assert_close(ours(idx), want, rtol=0, atol=1e-4 if fused else 1e-5)


def test_from_hf_refuses_what_it_cannot_hold_by_name():
    with pytest.raises(ValueError, match="n_inner"):
        GPT.from_hf(_hf_gpt2(n_inner=40))
    with pytest.raises(ValueError, match="activation_function"):
        GPT.from_hf(_hf_gpt2(activation_function="relu"))


def _checkpoint(tmp_path, **config):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2, n_embd=32, **config)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = tmp_path / "checkpoints" / "last.ckpt"
    save_checkpoint({"hyper_parameters": {"model": cfg.to_dict()},
                     "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}},
                    path)
    return model, path


def _export(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), *args],
                          capture_output=True, text=True, timeout=300)


def _loads_without_a_warning(model_class, directory, caplog):
    """model_class.from_pretrained(directory) in eval mode, asserting that transformers
    logged no warning (such as a load report of missing or unexpected weights)."""
    transformers.logging.enable_propagation()  # its warnings to caplog
    try:
        with caplog.at_level(logging.WARNING):
            model = model_class.from_pretrained(directory).eval()
    finally:
        transformers.logging.disable_propagation()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    return model


def test_export_format_hf_loads_in_transformers_without_a_warning(tmp_path, caplog):
    ours, ckpt = _checkpoint(tmp_path)
    out = tmp_path / "hf"
    r = _export(f"ckpt={ckpt}", f"out={out}", "format=hf", "vocab=100")
    assert r.returncode == 0, r.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 100 and config["fusedtrain_padded_vocab_size"] == 128
    hf = _loads_without_a_warning(transformers.GPT2LMHeadModel, out, caplog)
    idx = torch.randint(0, 100, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx)[..., :100], rtol=0, atol=1e-5)


def test_export_format_hf_refuses_a_model_without_biases(tmp_path):
    _, ckpt = _checkpoint(tmp_path, bias=False)
    r = _export(f"ckpt={ckpt}", f"out={tmp_path / 'hf'}", "format=hf")
    assert r.returncode == 2 and "model.bias" in r.stderr


def test_from_pretrained_builds_the_eager_model_unless_told(tmp_path):
    _, ckpt = _checkpoint(tmp_path, kernels=dict.fromkeys(KERNEL_FAMILIES, True))
    out = tmp_path / "model.safetensors"
    assert _export(f"ckpt={ckpt}", f"out={out}").returncode == 0
    assert not any(GPT.from_pretrained(str(out)).config.kernels.values())
    assert all(GPT.from_pretrained(str(out), kernels={"mlp": True, "qkv": True, "attention": True,
                                                       "layernorm": True, "cross_entropy": True,
                                                       "embedding": True}).config.kernels.values())


LLAMA = dict(n_kv_head=1, bias=False, norm="rmsnorm", mlp="swiglu", mlp_hidden=48, pos="rope",
             rope_base=500.0)


@pytest.mark.parametrize("tie_head", [False, True])
def test_export_format_hf_of_a_llama_block_loads_as_llama(tmp_path, caplog, tie_head):
    """model=llama-*: the directory LlamaForCausalLM loads with no warning, its logits ours
    within 1e-5 in fp32 (grouped heads, rotary positions, untied or tied head)."""
    ours, ckpt = _checkpoint(tmp_path, **LLAMA, tie_head=tie_head)
    out = tmp_path / "hf"
    r = _export(f"ckpt={ckpt}", f"out={out}", "format=hf", "vocab=100")
    assert r.returncode == 0, r.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 100
    hf = _loads_without_a_warning(transformers.LlamaForCausalLM, out, caplog)
    idx = torch.randint(0, 100, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx)[..., :100], rtol=0, atol=1e-5)
        back = GPT.from_hf(str(out), kernels=dict.fromkeys(KERNEL_FAMILIES, True)).eval()
        assert back.config.n_kv_head == 1 and back.config.tie_head == tie_head
        torch.testing.assert_close(back(idx), hf(idx).logits, rtol=0, atol=1e-4)


def test_from_hf_refuses_a_llama_it_cannot_hold_and_export_a_half_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      rms_norm_eps=1e-6, attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias"):
        GPT.from_hf(transformers.LlamaForCausalLM(config))
    from fusedtrain.hf import export_hf

    half = GPTConfig(vocab_size=64, n_embd=32, n_head=2, n_layer=1, norm="rmsnorm", bias=False)
    with pytest.raises(ValueError, match="neither"):
        export_hf(GPT(half).state_dict(), half.to_dict(), "unused")
