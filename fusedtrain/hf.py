"""GPT-2 weights between fusedtrain's GPT and Hugging Face transformers' GPT2LMHeadModel.

The two share parameter names (`transformer.h.0.attn.c_attn.weight`, ...) but not every
layout: transformers' GPT-2 keeps the four projection matrices of a block as Conv1D
weights, (in, out), the transpose of the (out, in) nn.Linear weights used here; it always
has biases; and its vocabulary is the tokenizer's, where a fusedtrain model pads the token
table to a multiple of 64 rows (50304 for GPT-2's 50257 tokens). Both tie the head to the
token table. Models with Llama's block go to and come from LlamaForCausalLM
(fusedtrain.hf_llama). transformers is an optional extra (`pip install -e ".[hf]"`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# The block matrices transformers stores transposed (Conv1D), by their name in a block.
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# GELU forms by name on each side (fusedtrain's `gelu` <-> GPT2Config.activation_function).
ACTIVATIONS = {"tanh": "gelu_new", "none": "gelu"}
TANH_FORMS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _transposed(name: str) -> bool:
    return name.startswith("transformer.h.") and name.split(".", 3)[3] in CONV1D


def hf_state(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Our GPT's state_dict -> GPT2LMHeadModel's (fp32, contiguous): Conv1D matrices
    transposed, the token table cut to its first vocab_size rows, no separate head."""
    out = {}
    for name, t in state.items():
        t = t.detach().float()
        if _transposed(name):
            t = t.t()
        elif name == "transformer.wte.weight":
            t = t[:vocab_size]
        out[name] = t.contiguous()
    return out


def export_vocab(config: dict, vocab_size: int | None) -> tuple[int, int]:
    """(the model's padded vocabulary, the exported one: vocab_size, default the model's),
    ValueError unless 0 < vocab_size <= the model's."""
    padded = config["vocab_size"]
    vocab = padded if vocab_size is None else vocab_size
    if not 0 < vocab <= padded:
        raise ValueError(f"vocab={vocab} must be in 1..{padded} (the model's vocab_size)")
    return padded, vocab


def export_hf(state: dict[str, torch.Tensor], config: dict, out_dir: str | Path,
              vocab_size: int | None = None, eos_token_id: int | None = None) -> None:
    """Write `out_dir` (config.json, model.safetensors) for
    transformers.GPT2LMHeadModel.from_pretrained. config: our GPTConfig as a dict;
    vocab_size: the tokenizer's (default: the model's, nothing cut); the config records
    the padded size as `fusedtrain_padded_vocab_size`. A model with Llama's block is
    written for LlamaForCausalLM instead (fusedtrain.hf_llama)."""
    from safetensors.torch import save_file
    from transformers import GPT2Config

    from fusedtrain import hf_llama

    if hf_llama.is_llama(config):
        return hf_llama.export_llama(state, config, out_dir, vocab_size, eos_token_id)
    gpt2_form = {"norm": "layernorm", "mlp": "gelu", "pos": "learned", "tie_head": True,
                 "n_kv_head": config["n_head"]}
    other = {k: config[k] for k, v in gpt2_form.items() if config.get(k) not in (None, v)}
    if other:
        raise ValueError(f"model settings {other}: neither transformers' GPT-2 nor its Llama "
                         "(model.norm=rmsnorm, mlp=swiglu, pos=rope) holds this model")
    if not config.get("bias", True):
        raise ValueError("model.bias=false: transformers' GPT-2 always has biases; export "
                         "a model trained with model.bias=true")
    padded, vocab = export_vocab(config, vocab_size)
    hf = GPT2Config(
        vocab_size=vocab, n_positions=config["block_size"], n_embd=config["n_embd"],
        n_layer=config["n_layer"], n_head=config["n_head"],
        activation_function=ACTIVATIONS[config.get("gelu", "tanh")],
        resid_pdrop=config.get("dropout", 0.0), embd_pdrop=config.get("dropout", 0.0),
        attn_pdrop=config.get("dropout", 0.0), layer_norm_epsilon=1e-5,
        tie_word_embeddings=True, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
        architectures=["GPT2LMHeadModel"], fusedtrain_padded_vocab_size=padded)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    save_file(hf_state(state, vocab), str(out / "model.safetensors"), metadata={"format": "pt"})


def from_hf(source: str | os.PathLike | torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """(our GPT's state_dict, GPTConfig fields) from a GPT2LMHeadModel or LlamaForCausalLM,
    or a local directory that AutoModelForCausalLM.from_pretrained loads as one (no hub
    access)."""
    from transformers import AutoModelForCausalLM

    from fusedtrain.hf_llama import from_llama

    model = source if isinstance(source, torch.nn.Module) else \
        AutoModelForCausalLM.from_pretrained(str(source), local_files_only=True)
    c = model.config
    if getattr(c, "model_type", None) == "llama":
        return from_llama(model)
    if getattr(c, "model_type", None) != "gpt2":
        raise ValueError(f"from_hf: a GPT-2 or Llama model is needed, got model_type "
                         f"{getattr(c, 'model_type', None)!r}")
    if c.n_inner not in (None, 4 * c.n_embd):
        raise ValueError(f"from_hf: n_inner={c.n_inner}: fusedtrain's MLP is 4 x n_embd wide")
    if c.activation_function not in (*TANH_FORMS, "gelu"):
        raise ValueError(f"from_hf: activation_function={c.activation_function!r} is not a "
                         "GELU form fusedtrain has")
    if getattr(c, "add_cross_attention", False):
        raise ValueError("from_hf: add_cross_attention=true: fusedtrain's GPT has none")
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the head is the token table; causal-mask buffers of old versions
        t = t.detach().float()
        state[name] = (t.t() if _transposed(name) else t).contiguous()
    config = {"vocab_size": c.vocab_size, "block_size": c.n_positions, "n_layer": c.n_layer,
              "n_head": c.n_head, "n_embd": c.n_embd, "dropout": float(c.resid_pdrop),
              "bias": True,
              "gelu": "tanh" if c.activation_function in TANH_FORMS else "none"}
    return state, config


def tokenizer_vocab(run_dir: Path) -> tuple[int, int] | None:
    """(vocab size, end-of-text id) of the tokenizer a training run used, from its run dir's
    .hydra/config.yaml; None if that is not there."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    tokenizer = OmegaConf.load(path).get("data", {}).get("tokenizer", "byte")
    from fusedtrain.data import ByteTokenizer, GPT2Tokenizer

    tok = GPT2Tokenizer if tokenizer == "gpt2" else ByteTokenizer
    return tok.vocab_size, tok.eot

