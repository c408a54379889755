"""Unfused PyTorch twins of every fused op: the eager path and the test oracle.

Each function has the same name, signature and semantics as its counterpart in
`fusedtrain.ops`; masked_attention, their math with any mask, is the packed model's eager
attention. Nothing here imports from the rest of the package.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def embedding(idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[idx] (ops.embedding's twin: nn.Embedding's own computation)."""
    return F.embedding(idx, weight)


def gpt_embedding(idx: torch.Tensor, token_weight: torch.Tensor,
                  position_weight: torch.Tensor, *, positions: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_weight[idx] + position_weight[positions], token_weight), positions 0..T-1
    along each row unless given (ops.gpt_embedding's twin: nanoGPT's input embedding, and
    the table its tied head reads)."""
    pos = torch.arange(idx.shape[-1], device=idx.device) if positions is None else positions
    return F.embedding(idx, token_weight) + F.embedding(pos, position_weight), token_weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias (ops.linear's twin: nn.Linear's own computation)."""
    return F.linear(x, weight, bias)


def linear_gelu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    approximate: str = "none",
) -> torch.Tensor:
    """y = gelu(x @ weight.T + bias).  x: (..., K), weight: (N, K), bias: (N,) -> y: (..., N)."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def fused_mlp(
    x: torch.Tensor, fc_weight: torch.Tensor, fc_bias: torch.Tensor | None,
    proj_weight: torch.Tensor, proj_bias: torch.Tensor | None, approximate: str = "none",
) -> torch.Tensor:
    """y = gelu(x @ fc_weight.T + fc_bias) @ proj_weight.T + proj_bias.

    x: (..., C), fc_weight: (H, C), proj_weight: (C_out, H) -> y: (..., C_out).
    Autograd keeps x, h and gelu(h) alive for backward: the cost the fused op removes.
    """
    return F.linear(linear_gelu(x, fc_weight, fc_bias, approximate), proj_weight, proj_bias)


def swiglu_mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
               down_weight: torch.Tensor) -> torch.Tensor:
    """y = (silu(x @ gate_weight.T) * (x @ up_weight.T)) @ down_weight.T.

    x: (..., C), gate_weight, up_weight: (H, C), down_weight: (C_out, H) -> y: (..., C_out).
    Autograd keeps x, g, silu(g), u and silu(g) * u alive for backward.
    """
    return F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)


def qkv_projection(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int,
    n_kv_heads: int | None = None, rope_base: float | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three projections from slices of one weight [Wq | Wk | Wv], each split into heads,
    q and k then rotated (rotary) with a rope_base.

    x: (B, T, C), weight: ((n_heads + 2 n_kv_heads) D, C), D = C // n_heads, bias: its rows
    -> q: (B, n_heads, T, D), k, v: (B, n_kv_heads, T, D). positions: (B, T), see rotary.
    """
    B, T, C = x.shape
    D = C // n_heads
    sizes = _qkv_sizes(C, n_heads, n_kv_heads)
    outs, start = [], 0
    for size in sizes:
        w = weight[start:start + size]
        b = None if bias is None else bias[start:start + size]
        outs.append(F.linear(x, w, b).view(B, T, -1, D).transpose(1, 2))
        start += size
    return _rotated(*outs, rope_base, positions)


def _qkv_sizes(C: int, n_heads: int, n_kv_heads: int | None) -> list[int]:
    """The row counts of Wq, Wk and Wv."""
    kv = (n_kv_heads or n_heads) * (C // n_heads)
    return [C, kv, kv]


def _rotated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope_base: float | None,
             positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if rope_base is None:
        return q, k, v
    return rotary(q, rope_base, positions), rotary(k, rope_base, positions), v


def rotary(x: torch.Tensor, base: float, positions: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x: (B, H, T, D) with dims d and d + D/2 of each head rotated by the angle
    p * base ** (-2d / D), p = positions[b, t] (default t): transformers' Llama "rotate half"
    form, the frequencies computed as it computes them, the rotation in fp32 (fp64 for
    fp64 x), rounded once."""
    T, D = x.shape[-2:]
    acc = torch.promote_types(x.dtype, torch.float32)
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2, device=x.device, dtype=acc) / D)
    p = torch.arange(T, device=x.device) if positions is None else positions[:, None]
    angle = p.to(acc)[..., None] * inv_freq  # (T, D/2), or (B, 1, T, D/2)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x.to(acc).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention_mask(T: int, S: int, causal: bool, window: tuple[int, int] | None,
                   device: torch.device) -> torch.Tensor | None:
    """(T, S) bool: which keys each query sees, aligned to the bottom right (query i's
    diagonal is key i + S - T); causal sets the window's right side to 0, -1 is unbounded.
    None where every query sees every key."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    rel = (torch.arange(S, device=device)[None, :] - torch.arange(T, device=device)[:, None]
           - (S - T))  # j - (i + S - T)
    seen = torch.ones(T, S, dtype=torch.bool, device=device)
    if left >= 0:
        seen &= rel >= -left
    if right >= 0:
        seen &= rel <= right
    return seen


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    softmax_scale: float | None = None, window: tuple[int, int] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain math attention: softmax(mask(softcap(q k^T * scale))) v.

    q: (B, Hq, T, D), k, v: (B, Hkv, S, D) -> o: (B, Hq, T, D); query head h reads
    key/value head h // (Hq // Hkv). Masks as attention_mask; softcap=c makes the scores
    c * tanh(scores / c). The (T, S) matrix is materialised; the softmax runs in at least
    fp32. Rows that see no key give zeros.
    """
    seen = attention_mask(q.shape[-2], k.shape[-2], causal, window, q.device)
    return masked_attention(q, k, v, seen, softmax_scale, softcap)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None,
    softmax_scale: float | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """flash_attention's math with the mask given: seen, bool, broadcast to (B, Hq, T, S),
    which keys each query sees (None: all); e.g. documents.Documents.seen."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if seen is not None:
        # Rows that see nothing keep finite scores (a softmax of -inf alone is NaN, also
        # in its gradient) and get zero probabilities after it.
        sees_some = seen.any(-1, keepdim=True)
        scores = scores.masked_fill(~seen & sees_some, float("-inf"))
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)
    if seen is not None:
        probs = probs.masked_fill(~sees_some, 0.0)
    return torch.matmul(probs, v)


def flash_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
    softmax_scale: float | None = None, window: tuple[int, int] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """flash_attention of each packed sequence on its own: q: (Nq, Hq, D), k, v:
    (Nk, Hkv, D), sequence b rows cu_seqlens_q[b]:[b + 1] of q and cu_seqlens_k[b]:[b + 1]
    of k and v -> o: (Nq, Hq, D). max_seqlen_* are not needed here (the fused op's grid)."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for b in range(len(starts_q) - 1):
        qs, ks = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        if qs.start == qs.stop:
            continue
        if ks.start == ks.stop:  # no key to see: zeros, as for a fully masked row
            outs.append(q[qs] * 0)
            continue
        o = flash_attention(*(t[s].transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks))),
                            causal, softmax_scale, window, softcap)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs) if outs else q * 0


def qkv_attention(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int,
    causal: bool = True, softmax_scale: float | None = None,
    window: tuple[int, int] | None = None, n_kv_heads: int | None = None,
    rope_base: float | None = None, positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash_attention(*qkv_projection(x, weight, bias, n_heads, n_kv_heads, rope_base,
    positions), causal, softmax_scale, window).

    x: (B, T, C), weight: ((n_heads + 2 n_kv_heads) D, C), bias: its rows -> o:
    (B, n_heads, T, D), D = C // n_heads.
    """
    return flash_attention(*qkv_projection(x, weight, bias, n_heads, n_kv_heads, rope_base,
                                           positions), causal, softmax_scale, window)


def qkv_attention_varlen(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int,
    cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool = True,
    softmax_scale: float | None = None, window: tuple[int, int] | None = None,
    n_kv_heads: int | None = None, rope_base: float | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash_attention_varlen of the projection x @ weight.T + bias of packed tokens: x:
    (B, T, C), cu_seqlens over its B * T tokens, q and k rotated with a rope_base at
    positions (B, T) (default each token's place in its sequence) -> o: (B * T, n_heads, D).
    """
    B, T, C = x.shape
    D = C // n_heads
    q, k, v = (t.reshape(B * T, -1, D) for t in F.linear(x, weight, bias).split(
        _qkv_sizes(C, n_heads, n_kv_heads), dim=-1))
    if rope_base is not None:
        if positions is None:
            positions = torch.cat([torch.arange(n, device=x.device)
                                   for n in cu_seqlens.diff().tolist()])
        q, k = (rotary(t.transpose(0, 1)[None], rope_base, positions.reshape(1, B * T))[0]
                .transpose(0, 1) for t in (q, k))
    return flash_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  causal, softmax_scale, window)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """x: (..., C), weight, bias: (C,) -> y: (..., C)."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def layer_norm_stream(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x), x): x passes through as the residual stream.  x: (..., C)."""
    return layer_norm(x, weight, bias, eps), x


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
    bias: torch.Tensor | None, eps: float = 1e-5, x_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = (x [+ x_bias]) + residual; returns (layer_norm(s), s).  x, residual: (..., C),
    x_bias: (C,)."""
    s = (x if x_bias is None else x + x_bias) + residual
    return layer_norm(s, weight, bias, eps), s


def layer_norm_gelu(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float = 1e-5, approximate: str = "none",
) -> torch.Tensor:
    """y = gelu(layer_norm(x)).  x: (..., C)."""
    return F.gelu(layer_norm(x, weight, bias, eps), approximate=approximate)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """x: (..., C), weight: (C,) -> y = x / sqrt(mean(x^2) + eps) * weight: (..., C) in x's
    dtype, computed in fp32 (fp64 for fp64 x), then rounded once."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.to(acc)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual; returns (rms_norm(s), s).  x, residual: (..., C)."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  inplace_backward: bool = False) -> torch.Tensor:
    """Mean cross-entropy of logits (..., V) upcast to at least fp32, against targets (...).
    inplace_backward is accepted for signature parity and changes nothing here."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of the logits x @ weight.T against targets (ops.linear_cross_entropy's
    twin: the head projection, then the loss on its materialised logits)."""
    return cross_entropy(F.linear(x, weight), targets, ignore_index)


def qkv_projection_packed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int,
    n_kv_heads: int | None = None, rope_base: float | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same result as `qkv_projection` the way nanoGPT computes it: one linear, then
    split, view and transpose (q, k, v views of one (B, T, ...) tensor), q and k rotated
    with a rope_base. The model's eager path uses this form (the stronger eager baseline);
    `qkv_projection` is the three-projection twin."""
    B, T, C = x.shape
    D = C // n_heads
    parts = F.linear(x, weight, bias).split(_qkv_sizes(C, n_heads, n_kv_heads), dim=-1)
    return _rotated(*(t.view(B, T, -1, D).transpose(1, 2) for t in parts), rope_base,
                    positions)
