"""nn.Modules of the GPT block, each choosing its fused op or its eager twin.

Parameter names and shapes are the same on both paths (GPT-2's), so a checkpoint
trained one way loads the other way.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fusedtrain import eager
from fusedtrain.documents import Documents


def _fused_ops():
    # Imported on first use: importing the kernels picks Triton's interpreter on
    # a machine without CUDA, which an all-eager run never needs.
    from fusedtrain import ops

    return ops


class ResidualLayerNorm(nn.Module):
    """LayerNorm (or RMSNorm) of the residual stream, with the pending sublayer output added
    first.

    forward(stream, delta, delta_bias) -> (norm(s), s) with s = stream + (delta
    [+ delta_bias]); with delta=None it is a plain norm and the stream passes through.
    stream, delta: (B, T, C); delta_bias: (C,), the bias of the layer that made delta when
    that layer left it out (see CausalSelfAttention.forward; LayerNorm only).
    kind: "layernorm" (eps 1e-5, GPT-2's) or "rmsnorm" (eps 1e-6, Llama's; no bias).
    """

    def __init__(self, n_embd: int, fused: bool, bias: bool = True, kind: str = "layernorm"):
        super().__init__()
        self.rms = kind == "rmsnorm"
        self.weight = nn.Parameter(torch.ones(n_embd))
        self.bias = nn.Parameter(torch.zeros(n_embd)) if bias and not self.rms else None
        self.eps = 1e-6 if self.rms else 1e-5
        self.fused = fused

    def forward(
        self, stream: torch.Tensor, delta: torch.Tensor | None = None,
        delta_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        impl = _fused_ops() if self.fused else eager
        if delta_bias is not None and (delta is None or self.rms):
            raise ValueError("delta_bias is added only with delta, before a LayerNorm")
        if self.rms:
            if delta is None:
                return impl.rms_norm(stream, self.weight, self.eps), stream
            return impl.add_rms_norm(delta, stream, self.weight, self.eps)
        if delta is None:
            return impl.layer_norm_stream(stream, self.weight, self.bias, self.eps)
        return impl.add_layer_norm(delta, stream, self.weight, self.bias, self.eps, delta_bias)


class MLP(nn.Module):
    """x: (B, T, C) -> gelu(x W_fc^T + b_fc) W_proj^T + b_proj: (B, T, C); hidden width
    4C unless given."""

    def __init__(self, n_embd: int, fused: bool, bias: bool = True, approximate: str = "tanh",
                 hidden: int | None = None):
        super().__init__()
        hidden = hidden or 4 * n_embd
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)
        self.fused = fused
        self.approximate = approximate

    def forward(self, x: torch.Tensor, out_bias: bool = True) -> torch.Tensor:
        """out_bias=False leaves c_proj's bias out, for the caller to add (see
        CausalSelfAttention.forward)."""
        impl = _fused_ops() if self.fused else eager
        return impl.fused_mlp(
            x, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
            self.c_proj.bias if out_bias else None, self.approximate,
        )


class SwiGLU(nn.Module):
    """x: (B, T, C) -> (silu(x W_gate^T) * (x W_up^T)) W_down^T: (B, T, C), no biases
    (Llama's MLP, its parameter names)."""

    def __init__(self, n_embd: int, hidden: int, fused: bool):
        super().__init__()
        self.gate_proj = nn.Linear(n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, n_embd, bias=False)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        impl = _fused_ops() if self.fused else eager
        return impl.swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight,
                               self.down_proj.weight)


class CausalSelfAttention(nn.Module):
    """x: (B, T, C) -> causal multi-head self-attention: (B, T, C).

    n_kv_head key/value heads (default n_head; fewer: grouped-query attention, query head h
    reading key/value head h // (n_head // n_kv_head)); c_attn's weight is
    ((n_head + 2 n_kv_head) * D, C). window: each token sees itself and the `window`
    tokens before it (default: all before it). rope_base: rotary embeddings on q and k
    (ops.rotary), at the tokens' positions (restarting per document with `docs`).
    fused_qkv: `ops.qkv_projection` (one Triton GEMM writing q, k, v as (B, H, T, D), q
    and k rotated in its epilogue), and the output projection is `ops.linear` (grouped
    casts, the column-sum kernel's bias gradient); else one linear + split, and nn.Linear.
    fused_attention: Triton flash attention; else `eager_attention`, "math" (the
    (T, T) matrix in memory) or "sdpa" (PyTorch's scaled_dot_product_attention).
    Both fused: one op (`ops.qkv_attention`), whose attention backward also sums the
    projection's bias gradient with equal head counts and no rope.
    With `docs` (packed rows, documents.Documents) no token sees another document's:
    `ops.flash_attention_varlen` over the batch's flattened tokens (both fused: one op,
    `ops.qkv_attention_varlen`, its attention gradients written into the projection's);
    else the eager attention with docs.seen as its mask.
    """

    def __init__(
        self, n_embd: int, n_head: int, fused_qkv: bool, fused_attention: bool,
        eager_attention: str = "math", bias: bool = True, n_kv_head: int | None = None,
        window: int | None = None, rope_base: float | None = None,
    ):
        super().__init__()
        if eager_attention not in ("math", "sdpa"):
            raise ValueError(f"eager_attention must be 'math' or 'sdpa', got {eager_attention!r}")
        self.n_head, self.n_kv_head = n_head, n_kv_head or n_head
        head_dim = n_embd // n_head
        self.c_attn = nn.Linear(n_embd, (n_head + 2 * self.n_kv_head) * head_dim, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.fused_qkv = fused_qkv
        self.fused_attention = fused_attention
        self.eager_attention = eager_attention
        self.window = None if window is None else (window, 0)
        self.rope_base = rope_base

    def forward(self, x: torch.Tensor, out_bias: bool = True, docs: Documents | None = None
                ) -> torch.Tensor:
        """out_bias=False leaves c_proj's bias out, for the caller to add (the fused
        add_layer_norm adds it, and its backward sums its gradient from the pass it makes
        anyway)."""
        B, T, C = x.shape
        w, b = self.c_attn.weight, self.c_attn.bias
        if docs is not None:
            y = self._document_attention(x, w, b, docs)
        elif self.fused_qkv and self.fused_attention:  # one op: one op's host cost
            y = _fused_ops().qkv_attention(x, w, b, self.n_head, causal=True, window=self.window,
                                           n_kv_heads=self.n_kv_head, rope_base=self.rope_base)
            y = y.transpose(1, 2).reshape(B, T, C)
        else:
            y = self._attention(x, w, b).transpose(1, 2).reshape(B, T, C)
        bias = self.c_proj.bias if out_bias else None
        if self.fused_qkv:  # the projections' family: casts grouped, bias gradient fused
            return _fused_ops().linear(y, self.c_proj.weight, bias)
        return F.linear(y, self.c_proj.weight, bias)

    def _project(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """x (B, T, C) -> q (B, n_head, T, D), k, v (B, n_kv_head, T, D), q and k rotated
        at `positions` (default t) with a rope_base. The eager projection's are views of
        one (B, T, ...) tensor (packing the tokens is then a view too)."""
        positions = None if self.rope_base is None else positions
        project = (_fused_ops().qkv_projection if self.fused_qkv
                   else eager.qkv_projection_packed)
        return project(x, w, b, self.n_head, self.n_kv_head, self.rope_base, positions)

    def _attention(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The projection and attention as separate ops: x (B, T, C) -> (B, H, T, D)."""
        q, k, v = self._project(x, w, b)
        if self.fused_attention:
            return _fused_ops().flash_attention(q, k, v, causal=True, window=self.window)
        seen = (None if self.window is None
                else eager.attention_mask(q.shape[2], k.shape[2], True, self.window, q.device))
        return self._eager_attention(q, k, v, seen)

    def _eager_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         seen: torch.Tensor | None) -> torch.Tensor:
        """q (B, H, T, D), k, v (B, HK, T, D), seen: which keys each query sees, (T, T) or
        (B, 1, T, T), None for the plain causal mask -> (B, H, T, D)."""
        if self.eager_attention == "sdpa":
            grouped = self.n_kv_head != self.n_head
            if seen is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                      enable_gqa=grouped)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=grouped)
        if seen is None:
            return eager.flash_attention(q, k, v, causal=True)
        return eager.masked_attention(q, k, v, seen)

    def _document_attention(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                            docs: Documents) -> torch.Tensor:
        """x (B, T, C) -> each document's attention on its own: (B, T, C)."""
        B, T, C = x.shape
        if self.fused_qkv and self.fused_attention:  # one op: dq, dk, dv in one buffer
            rope = self.rope_base is not None
            return _fused_ops().qkv_attention_varlen(
                x, w, b, self.n_head, docs.cu_seqlens, T, causal=True, window=self.window,
                n_kv_heads=self.n_kv_head, rope_base=self.rope_base,
                positions=docs.positions if rope else None).view(B, T, C)
        q, k, v = self._project(x, w, b, docs.positions)
        if self.fused_attention:
            cu = docs.cu_seqlens
            o = _fused_ops().flash_attention_varlen(
                *(t.transpose(1, 2).reshape(B * T, t.shape[1], t.shape[3]) for t in (q, k, v)),
                cu, cu, T, T, causal=True, window=self.window)
            return o.view(B, T, C)
        return self._eager_attention(q, k, v, docs.seen).transpose(1, 2).reshape(B, T, C)
