"""The public fused ops (see docs/design.md): each a differentiable op over Triton kernels,
with a twin of the same name and semantics in `fusedtrain.eager`."""

from fusedtrain.kernels._launch import describe
from fusedtrain.ops import published_cast as _published_cast  # noqa: F401 (registers the op)
from fusedtrain.ops._registry import register_inductor_fallbacks, trace_kernels
from fusedtrain.ops.attention import flash_attention, flash_attention_varlen
from fusedtrain.ops.cross_entropy import cross_entropy, linear_cross_entropy
from fusedtrain.ops.embedding import embedding, gpt_embedding
from fusedtrain.ops.layernorm import (
    add_layer_norm,
    add_rms_norm,
    layer_norm,
    layer_norm_gelu,
    layer_norm_stream,
    rms_norm,
)
from fusedtrain.ops.linear import linear
from fusedtrain.ops.linear_gelu import fused_mlp, linear_gelu
from fusedtrain.ops.qkv import qkv_projection
from fusedtrain.ops.qkv_attention import qkv_attention
from fusedtrain.ops.qkv_attention_varlen import qkv_attention_varlen
from fusedtrain.ops.rope import rotary
from fusedtrain.ops.swiglu import swiglu_mlp

__all__ = [
    "add_layer_norm", "add_rms_norm", "cross_entropy", "describe", "embedding",
    "flash_attention", "flash_attention_varlen", "fused_mlp", "gpt_embedding", "layer_norm",
    "layer_norm_gelu", "layer_norm_stream", "linear", "linear_cross_entropy", "linear_gelu",
    "qkv_attention", "qkv_attention_varlen", "qkv_projection", "register_inductor_fallbacks",
    "rms_norm", "rotary", "swiglu_mlp", "trace_kernels",
]
