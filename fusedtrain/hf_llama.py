"""Llama weights between fusedtrain's GPT with Llama's block (model=llama-*: RMSNorm,
SwiGLU, rotary positions, no biases) and Hugging Face transformers' LlamaForCausalLM.

Names differ, layouts do not: transformers keeps q, k and v as three (out, in) matrices
where this GPT has one c_attn of rows [Wq | Wk | Wv]; both rotate "half" (dims d and
d + D/2), so no row is permuted. The vocabulary is the tokenizer's, where a fusedtrain
model may pad its tables (see fusedtrain.hf).
"""

from __future__ import annotations

from pathlib import Path

import torch

_BLOCK = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
          "attn.c_proj.weight": "self_attn.o_proj.weight",
          **{f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}}
_QKV = ("q_proj", "k_proj", "v_proj")


def is_llama(config: dict) -> bool:
    """Whether a GPTConfig (as a dict) has Llama's block: the switches transformers'
    LlamaForCausalLM holds."""
    return (config.get("norm") == "rmsnorm" and config.get("mlp") == "swiglu"
            and config.get("pos") == "rope")


def _qkv_rows(config: dict) -> list[int]:
    D = config["n_embd"] // config["n_head"]
    kv = (config.get("n_kv_head") or config["n_head"]) * D
    return [config["n_embd"], kv, kv]


def llama_state(state: dict[str, torch.Tensor], config: dict,
                vocab_size: int) -> dict[str, torch.Tensor]:
    """Our GPT's state_dict -> LlamaForCausalLM's (fp32, contiguous), the tables cut to
    their first vocab_size rows."""
    out = {}
    for name, t in state.items():
        t = t.detach().float()
        if name == "transformer.wte.weight":
            out["model.embed_tokens.weight"] = t[:vocab_size]
        elif name == "lm_head.weight":
            out[name] = t[:vocab_size]
        elif name == "transformer.ln_f.weight":
            out["model.norm.weight"] = t
        else:
            _, _, i, part = name.split(".", 3)  # transformer.h.<i>.<part>
            prefix = f"model.layers.{i}."
            if part == "attn.c_attn.weight":
                for proj, w in zip(_QKV, t.split(_qkv_rows(config))):
                    out[f"{prefix}self_attn.{proj}.weight"] = w
            else:
                out[prefix + _BLOCK[part]] = t
    return {k: v.contiguous() for k, v in out.items()}


def export_llama(state: dict[str, torch.Tensor], config: dict, out_dir: str | Path,
                 vocab_size: int | None = None, eos_token_id: int | None = None) -> None:
    """Write `out_dir` (config.json, model.safetensors) for
    transformers.LlamaForCausalLM.from_pretrained; arguments as fusedtrain.hf.export_hf's."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from fusedtrain.hf import export_vocab

    if config.get("bias"):
        raise ValueError("model.bias=true: this Llama export holds no biases")
    padded, vocab = export_vocab(config, vocab_size)
    hf = LlamaConfig(
        vocab_size=vocab, hidden_size=config["n_embd"], intermediate_size=config["mlp_hidden"],
        num_hidden_layers=config["n_layer"], num_attention_heads=config["n_head"],
        num_key_value_heads=config.get("n_kv_head") or config["n_head"],
        head_dim=config["n_embd"] // config["n_head"],
        max_position_embeddings=config["block_size"], rms_norm_eps=1e-6,
        rope_theta=float(config.get("rope_base", 10000.0)), hidden_act="silu",
        attention_bias=False, mlp_bias=False, attention_dropout=config.get("dropout", 0.0),
        tie_word_embeddings=config.get("tie_head", True), bos_token_id=eos_token_id,
        eos_token_id=eos_token_id, architectures=["LlamaForCausalLM"],
        fusedtrain_padded_vocab_size=padded)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    save_file(llama_state(state, config, vocab), str(out / "model.safetensors"),
              metadata={"format": "pt"})


def from_llama(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """(our GPT's state_dict, GPTConfig fields) from a transformers LlamaForCausalLM."""
    c = model.config
    D = c.hidden_size // c.num_attention_heads
    # transformers 5 keeps rope_theta inside rope_parameters (alias rope_scaling), 4 beside.
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    for name, ok in (("head_dim", getattr(c, "head_dim", D) == D),
                     ("attention_bias", not getattr(c, "attention_bias", False)),
                     ("mlp_bias", not getattr(c, "mlp_bias", False)),
                     ("hidden_act", c.hidden_act == "silu"),
                     ("rope_scaling", rope.get("rope_type", "default") == "default")):
        if not ok:
            raise ValueError(f"from_hf: a Llama with {name}={getattr(c, name, None)!r}: "
                             "fusedtrain's Llama block has no such form")
    if abs(c.rms_norm_eps - 1e-6) > 1e-12:
        raise ValueError(f"from_hf: rms_norm_eps={c.rms_norm_eps}: fusedtrain's RMSNorm "
                         "uses 1e-6")
    config = {"vocab_size": c.vocab_size, "block_size": c.max_position_embeddings,
              "n_layer": c.num_hidden_layers, "n_head": c.num_attention_heads,
              "n_kv_head": c.num_key_value_heads, "n_embd": c.hidden_size,
              "dropout": float(c.attention_dropout), "bias": False, "norm": "rmsnorm",
              "mlp": "swiglu", "mlp_hidden": c.intermediate_size, "pos": "rope",
              "rope_base": theta,
              "tie_head": bool(c.tie_word_embeddings)}
    theirs = {k: v.detach().float() for k, v in model.state_dict().items()}
    state = {"transformer.wte.weight": theirs["model.embed_tokens.weight"],
             "transformer.ln_f.weight": theirs["model.norm.weight"]}
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = theirs["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}."
        state[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(
            [theirs[f"{prefix}self_attn.{proj}.weight"] for proj in _QKV])
        for ours, hf_name in _BLOCK.items():
            state[f"transformer.h.{i}.{ours}"] = theirs[prefix + hf_name]
    return {k: v.contiguous() for k, v in state.items()}, config
