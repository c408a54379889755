"""fusedtrain's kernels inside a transformers GPT-2, switched on in place.

`gpt2(model, kernels=...)` takes a GPT2LMHeadModel (or a GPT2Model) and makes its
LayerNorms, MLPs, attention and causal-LM loss run the fused ops, so that training it,
with transformers' Trainer or a plain loop, runs the kernels. The parameters stay the
model's own (its Conv1D matrices are read transposed, as views); what a family cannot do
(dropout inside the attention, cross-attention) is refused by name when patching, and
what a call cannot do (a padded batch) when it is made.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

FAMILIES = ("layernorm", "mlp", "attention", "cross_entropy")
ATTENTION = "fusedtrain"  # the name of the attention the patched model's config selects


def gpt2(model: torch.nn.Module, kernels: dict[str, bool] | None = None) -> torch.nn.Module:
    """Switch `model`'s families (FAMILIES; all by default, `kernels` to choose) to the
    fused ops in place; returns the model. Raises ValueError naming the config setting
    that a chosen family cannot honour."""
    chosen = dict.fromkeys(FAMILIES, True)
    unknown = set(kernels or {}) - set(FAMILIES)
    if unknown:
        raise ValueError(f"kernels: unknown families {sorted(unknown)}; known: {list(FAMILIES)}")
    chosen.update(kernels or {})
    config = model.config
    if getattr(config, "model_type", None) != "gpt2":
        raise ValueError(f"fusedtrain.patch.gpt2 needs a GPT-2 model, got model_type "
                         f"{getattr(config, 'model_type', None)!r}")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("config.add_cross_attention=true: the fused blocks have no "
                         "cross-attention")
    if chosen["attention"] and config.attn_pdrop > 0:
        raise ValueError(f"config.attn_pdrop={config.attn_pdrop}: the fused attention has no "
                         "dropout; set it to 0 or pass kernels={'attention': False}")
    from fusedtrain.hf import TANH_FORMS

    if chosen["mlp"] and config.activation_function not in (*TANH_FORMS, "gelu"):
        raise ValueError(f"config.activation_function={config.activation_function!r}: the "
                         "fused MLP has the GELU forms only")
    base = model.transformer if hasattr(model, "transformer") else model
    approximate = "tanh" if config.activation_function in TANH_FORMS else "none"
    for block in base.h:
        if chosen["layernorm"]:
            _fuse_layer_norm(block.ln_1)
            _fuse_layer_norm(block.ln_2)
        if chosen["mlp"]:
            block.mlp.forward = types.MethodType(_mlp_forward, block.mlp)
            block.mlp.approximate = approximate
    if chosen["layernorm"]:
        _fuse_layer_norm(base.ln_f)
    if chosen["attention"]:
        _register_attention()
        model.set_attn_implementation(ATTENTION)
    if chosen["cross_entropy"] and hasattr(model, "lm_head"):
        model.loss_function = causal_lm_loss
    return model


def _fuse_layer_norm(ln: torch.nn.LayerNorm) -> None:
    from fusedtrain import ops

    ln.forward = lambda x: ops.layer_norm(x, ln.weight, ln.bias, ln.eps)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """GPT2MLP.forward through ops.fused_mlp: x (B, T, C) -> (B, T, C); Conv1D weights are
    (in, out), the fused op's are (out, in): transposed views."""
    from fusedtrain import ops

    y = ops.fused_mlp(x, self.c_fc.weight.t(), self.c_fc.bias, self.c_proj.weight.t(),
                      self.c_proj.bias, self.approximate)
    return self.dropout(y)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               **kwargs):
    """transformers' attention interface: q (B, H, Tq, D), k, v (B, H, Tk, D) -> ((B, Tq, H,
    D), None), through ops.flash_attention: over a whole sequence, or a decoding step
    (Tq < Tk, keys from the cache) with the causal mask aligned to the last key."""
    if attention_mask is not None:
        raise ValueError("attention_mask with padding: the fused attention takes unpadded "
                         "batches (pass no attention_mask, or patch without 'attention')")
    if dropout:
        raise ValueError(f"attention dropout {dropout}: the fused attention has none")
    from fusedtrain import ops

    out = ops.flash_attention(query, key, value, causal=True, softmax_scale=scaling)
    return out.transpose(1, 2), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTENTION, _attention)
    # No mask for causal batches without padding (the kernel masks itself); the 2-D
    # padding mask otherwise, which _attention refuses.
    AttentionMaskInterface.register(ATTENTION, flash_attention_mask)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None,
                   ignore_index: int = -100, shift_labels: torch.Tensor | None = None,
                   **kwargs) -> torch.Tensor:
    """transformers' ForCausalLMLoss through ops.cross_entropy: logits (B, T, V) read in
    their own dtype (fp32 inside the kernel), labels (B, T) shifted by one; the mean over
    the counted targets, or their sum over num_items_in_batch when that is given."""
    from fusedtrain import ops

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    loss = ops.cross_entropy(logits.reshape(-1, vocab_size), targets, ignore_index=ignore_index)
    if num_items_in_batch is not None:
        loss = loss * (targets != ignore_index).sum() / num_items_in_batch
    return loss
