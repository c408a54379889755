"""Differentiable flash attention: q (B, Hq, T, D), k, v (B, Hkv, S, D) -> o (B, Hq, T, D)."""

from __future__ import annotations

import math
import weakref

import torch
from torch.utils.flop_counter import register_flop_formula

from fusedtrain.kernels import attention as K
from fusedtrain.kernels import attention_bwd as KB
from fusedtrain.kernels import rope as KR
from fusedtrain.kernels._device import stat_dtype
from fusedtrain.kernels._launch import tracing
from fusedtrain.ops._registry import function_apply, launcher
from fusedtrain.ops._validate import autocast_cast, check_same, check_tensor

Tensor = torch.Tensor


@launcher("attention_fwd", traceable=True)
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                  window_left: int = -1, window_right: int = -1,
                  softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    return K.attention_fwd(q, k, v, causal, softmax_scale, (window_left, window_right), softcap)


@attention_fwd.register_fake
def _(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0):
    return K.output_buffer(q), q.new_empty(q.shape[:3], dtype=stat_dtype(q))


@launcher("attention_bwd", traceable=True)
def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                  causal: bool, softmax_scale: float, window_left: int = -1,
                  window_right: int = -1, softcap: float = 0.0,
                  bias_grad_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """q, k, v of one shape (B, H, T, D) -> (3, B, H, T, D): dq, dk, dv in one buffer laid
    out as K.grad_buffer (a custom op's outputs may not alias, so the three views are taken
    by the caller); and the gradient (3C,) of a bias added to q, k, v before the attention,
    in bias_grad_dtype, or an empty tensor without one (see KB.attention_bwd)."""
    if tracing():
        # dq, dk, dv as three buffers, stacked into grad_buffer's layout after (one copy):
        # written views of one buffer do not survive functionalization (see
        # scripts/traced_graphs.py, _aliased_writes, which refuses them).
        parts = tuple(K.output_buffer(q) for _ in range(3))
        db = KB.attention_bwd(do, q, k, v, o, lse, parts, causal, softmax_scale,
                              (window_left, window_right), softcap, bias_grad_dtype)
        grads = torch.stack([g.transpose(1, 2) for g in parts], dim=2).permute(2, 0, 3, 1, 4)
    else:
        grads = K.grad_buffer(q)
        db = KB.attention_bwd(do, q, k, v, o, lse, grads.unbind(0), causal, softmax_scale,
                              (window_left, window_right), softcap, bias_grad_dtype)
    return grads, db if db is not None else q.new_empty(0)


@attention_bwd.register_fake
def _(do, q, k, v, o, lse, causal, softmax_scale, window_left=-1, window_right=-1,
      softcap=0.0, bias_grad_dtype=None):
    B, H, T, D = q.shape
    db = (q.new_empty(3 * H * D, dtype=bias_grad_dtype) if bias_grad_dtype is not None
          else q.new_empty(0))
    return K.grad_buffer(q), db


@launcher("attention_bwd_grouped", traceable=True)
def attention_bwd_grouped(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                          causal: bool, softmax_scale: float, window_left: int,
                          window_right: int, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """q: (B, H, T, D), k, v: (B, HK, S, D) of another shape (grouped heads, or S != T) ->
    dq, dk, dv, each laid out as K.output_buffer."""
    grads = KB.gradient_buffers(q, k, v)
    KB.attention_bwd(do, q, k, v, o, lse, grads, causal, softmax_scale,
                     (window_left, window_right), softcap)
    return grads


@attention_bwd_grouped.register_fake
def _(do, q, k, v, o, lse, causal, softmax_scale, window_left, window_right, softcap):
    return K.output_buffer(q), K.output_buffer(k), K.output_buffer(v)


@launcher("attention_fwd_varlen", traceable=True)
def attention_fwd_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                         softmax_scale: float, window_left: int, window_right: int,
                         softcap: float) -> tuple[Tensor, Tensor]:
    return K.attention_fwd_varlen(q, k, v, (cu_seqlens_q, cu_seqlens_k),
                                  (max_seqlen_q, max_seqlen_k), causal, softmax_scale,
                                  (window_left, window_right), softcap)


@attention_fwd_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q),
                        dtype=stat_dtype(q)))


@launcher("attention_bwd_varlen", traceable=True)
def attention_bwd_varlen(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                         cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, causal: bool, softmax_scale: float,
                         window_left: int, window_right: int,
                         softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """A packed batch's dq: (Nq, H, D), dk, dv: (Nk, HK, D), contiguous."""
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    KB.attention_bwd(do, q, k, v, o, lse, grads, causal, softmax_scale,
                     (window_left, window_right), softcap, None, (cu_seqlens_q, cu_seqlens_k),
                     (max_seqlen_q, max_seqlen_k))
    return grads


@attention_bwd_varlen.register_fake
def _(do, q, k, v, *args):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


@launcher("attention_bwd_varlen_packed", traceable=True)
def attention_bwd_varlen_packed(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor,
                                lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                                softmax_scale: float, window_left: int, window_right: int,
                                softcap: float, rope_base: float | None,
                                positions: Tensor | None) -> Tensor:
    """attention_bwd_varlen's gradients side by side in one (N, H + 2 HK, D) buffer, [dq |
    dk | dv] along the heads (q: (N, H, D), k, v: (N, HK, D)): a packed QKV projection's
    output gradient, (N, (H + 2 HK) D), with no concatenation after the kernels. With a
    rope_base, dq and dk are rotated back in place (q and k were rotated at positions:
    (1, N) ints), the gradient of the projection before its rotation."""
    N, H, D = q.shape
    HK = k.shape[1]
    args = (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k)
    traced = tracing()  # written views of one buffer do not survive functionalization
    if traced:
        parts = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    else:
        grads = q.new_empty((N, H + 2 * HK, D))
        parts = grads.split([H, HK, HK], dim=1)
    KB.attention_bwd(do, q, k, v, o, lse, parts, causal, softmax_scale,
                     (window_left, window_right), softcap, None, *args)
    if rope_base is not None and traced:
        parts[:2] = [KR.rope(head_major(t), rope_base, positions, True).squeeze(0)
                     .transpose(0, 1) for t in parts[:2]]
    elif rope_base is not None:
        # dq and dk adjacent: one launch, in place (a program reads its rows before writing)
        dqk = head_major(grads[:, :H + HK])
        KR.rope(dqk, rope_base, positions, True, dqk)
    return torch.cat(parts, dim=1) if traced else grads


def head_major(t: Tensor) -> Tensor:
    """Packed (N, H, D) -> the (1, H, N, D) view the rotary kernel reads (one row of N
    tokens)."""
    return t.transpose(0, 1).unsqueeze(0)


@attention_bwd_varlen_packed.register_fake
def _(do, q, k, v, *args):
    return q.new_empty((q.shape[0], q.shape[1] + 2 * k.shape[1], q.shape[2]))


def _attention_flops(q_shape, k_shape, causal: bool, matmuls: int) -> int:
    """matmuls (T, S)-shaped products of D: all of them without a mask, half under a
    causal one with T = S (masked blocks are skipped), counted whole otherwise."""
    B, H, T, D = q_shape
    flops = matmuls * 2 * B * H * T * k_shape[2] * D
    return flops // 2 if causal and k_shape[2] == T else flops


@register_flop_formula(torch.ops.fusedtrain.attention_fwd)
def _(q_shape, k_shape, v_shape, causal, *args, **kwargs) -> int:
    return _attention_flops(q_shape, k_shape, causal, matmuls=2)


def _varlen_flops(q_shape, max_seqlen_k: int, causal: bool, matmuls: int) -> int:
    """An upper bound from the shapes alone: every query against max_seqlen_k keys (half
    of them under a causal mask); the true count needs cu_seqlens' values."""
    N, H, D = q_shape
    flops = matmuls * 2 * N * H * max_seqlen_k * D
    return flops // 2 if causal else flops


@register_flop_formula(torch.ops.fusedtrain.attention_fwd_varlen)
def _(q_shape, k_shape, v_shape, cu_q, cu_k, max_q, max_k, causal, *args, **kwargs) -> int:
    return _varlen_flops(q_shape, max_k, causal, matmuls=2)


@register_flop_formula([torch.ops.fusedtrain.attention_bwd_varlen,
                        torch.ops.fusedtrain.attention_bwd_varlen_packed])
def _(do_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, cu_q, cu_k, max_q, max_k, causal,
      *args, **kwargs) -> int:
    return _varlen_flops(q_shape, max_k, causal, matmuls=5)


@register_flop_formula([torch.ops.fusedtrain.attention_bwd,
                        torch.ops.fusedtrain.attention_bwd_grouped])
def _(do_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, causal, *args, **kwargs) -> int:
    return _attention_flops(q_shape, k_shape, causal, matmuls=5)  # s recomputed, dv, dp, dq, dk


class FlashAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, o and the fp32 row log-sum-exp; never the (T, S) matrix."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                window: tuple[int, int], softcap: float):
        o, lse = attention_fwd(q, k, v, causal, softmax_scale, *window, softcap)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, softmax_scale, *window, softcap)
        ctx.packed = KB.packed_grads(q, k, v)
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        if ctx.packed:
            dq, dk, dv = attention_bwd(do, q, k, v, o, lse, *ctx.args)[0].unbind(0)
        else:
            dq, dk, dv = attention_bwd_grouped(do, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


_apply_flash_attention = function_apply(FlashAttentionFunction)


def checked_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The softmax scale for a head dim the kernels take (ValueError otherwise);
    softmax_scale defaults to 1 / sqrt(head_dim)."""
    if not 1 <= head_dim <= K.MAX_HEAD_DIM:
        raise ValueError(f"head dim D={head_dim} is not supported: the kernel takes 1 <= D <= "
                         f"{K.MAX_HEAD_DIM}")
    scale = K.default_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    if not scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    return scale


def checked_window(window) -> tuple[int, int]:
    """window=(left, right) as two ints >= -1 (-1: unbounded); None: (-1, -1)."""
    if window is None:
        return -1, -1
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise ValueError(f"window must be None or a pair of ints (left, right), got {window!r}")
    if min(window) < -1:
        raise ValueError(f"window values must be >= 0, or -1 for unbounded; got {window!r}")
    return int(window[0]), int(window[1])


def checked_softcap(softcap) -> float:
    """softcap as a positive finite float; None (no softcap): 0.0."""
    if softcap is None:
        return 0.0
    cap = float(softcap)
    if not 0 < cap < math.inf:
        raise ValueError(f"softcap must be positive and finite, or None; got {softcap!r}")
    return cap


def _checked_args(q: Tensor, k: Tensor, v: Tensor, ndim: int, softmax_scale, window, softcap
                  ) -> tuple[Tensor, Tensor, Tensor, float, tuple[int, int], float]:
    """Both attention ops' checks, errors naming the argument: q, k, v of rank ndim (4: (B,
    H, T, D); 3: packed (N, H, D)), k and v of one shape with q's head dim (and batch),
    q's heads a multiple of theirs; the scale, window and softcap (checked_*). Returns q,
    k, v after autocast's casts (one device and dtype) and the checked scalars."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=ndim)
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or (ndim == 4 and k.shape[0] != q.shape[0]):
        form = "(B, Hkv, S, D) with q's B and D" if ndim == 4 else "(Nk, Hkv, D) with q's D"
        raise ValueError(f"k and v must have one shape {form}; got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's heads (Hq={Hq}) must be a multiple of k's and v's (Hkv={Hkv})")
    scale = checked_scale(q.shape[-1], softmax_scale)
    window, softcap = checked_window(window), checked_softcap(softcap)
    q, k, v = autocast_cast(q, k, v)
    check_same("q", q, k=k, v=v)
    return q, k, v, scale, window, softcap


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                    softmax_scale: float | None = None, window: tuple[int, int] | None = None,
                    softcap: float | None = None) -> Tensor:
    """softmax(mask(softcap(q k^T * scale))) v without the (T, S) matrix in memory.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D) with Hq % Hkv == 0: query head h reads
    key/value head h // (Hq // Hkv) (Hkv == 1: multi-query). D <= 256, any strides.
    Masks align to the bottom right: with causal, query i sees keys j <= i + S - T;
    window=(left, right) shows key j to query i only if i + S - T - left <= j <=
    i + S - T + right (-1: unbounded on that side), and causal sets right to 0.
    softcap=c: scores become c * tanh(scores / c) after the scale, before the mask.
    softmax_scale defaults to 1 / sqrt(D). Rows that see no key give zeros.
    -> o: (B, Hq, T, D), stored as (B, T, Hq, D) so that merging the heads back,
    o.transpose(1, 2).reshape(B, T, Hq * D), is a view.
    """
    q, k, v, scale, window, softcap = _checked_args(q, k, v, 4, softmax_scale, window, softcap)
    if q.numel() == 0 or k.shape[2] == 0:  # no rows, or no key to see: zeros
        return q.new_zeros(q.shape)
    return _apply_flash_attention(q, k, v, bool(causal), scale, window, softcap)


class FlashAttentionVarlenFunction(torch.autograd.Function):
    """flash_attention_varlen's: saves q, k, v, o, the row log-sum-exp and cu_seqlens."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                cu_seqlens_k: Tensor, max_seqlens: tuple[int, int], causal: bool,
                softmax_scale: float, window: tuple[int, int], softcap: float):
        o, lse = attention_fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *max_seqlens, causal,
                                      softmax_scale, *window, softcap)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (*max_seqlens, causal, softmax_scale, *window, softcap)
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = attention_bwd_varlen(do, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


_apply_flash_attention_varlen = function_apply(FlashAttentionVarlenFunction)


def _check_cu_seqlens(name: str, cu: Tensor, ref: Tensor) -> None:
    """cu_seqlens' form as documented (an int32 1-D tensor on ref's device): ValueError or
    TypeError naming it."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D of batch + 1 entries, got shape {tuple(cu.shape)}")
    check_same("q", ref, same_dtype=False, **{name: cu})


def _breaks_rules(cu: Tensor, rows: int, max_seqlen: int) -> Tensor:
    """A flag tensor, true where cu_seqlens' values break the rules (start at 0,
    non-decreasing, end at `rows`, no sequence past max_seqlen)."""
    lengths = cu.diff()
    return ((cu[0] != 0) | (cu[-1] != rows) | (lengths < 0).any()
            | (lengths > max_seqlen).any())


def _value_check_mark(cu_q: Tensor, cu_k: Tensor, sizes: tuple[int, ...]) -> tuple:
    """What a passed value check of this cu_seqlens pair records on cu_q, beside a weak
    reference to cu_k: their versions (bumped by any write) and the sizes checked."""
    return cu_k._version, cu_q._version, sizes


def _passed_before(cu_q: Tensor, cu_k: Tensor, sizes: tuple[int, ...]) -> bool:
    """Whether this pair passed the value check for these sizes and neither was written
    since: a model's layers pass one batch's cu_seqlens each, read once for all."""
    seen = getattr(cu_q, "_fusedtrain_checked", None)
    return (seen is not None and seen[0]() is cu_k
            and seen[1:] == _value_check_mark(cu_q, cu_k, sizes))


def checked_cu_seqlens(ref: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, Nq: int,
                       Nk: int, max_seqlen_q: int, max_seqlen_k: int,
                       names: tuple[str, str] = ("_q", "_k")) -> None:
    """A packed batch's sequence arguments checked (ValueError/TypeError naming them, as
    cu_seqlens and max_seqlen with the suffixes in `names`): the max_seqlen ints, the
    cu_seqlens form (int32 1-D, on ref's device, one length) and values (from 0,
    non-decreasing, ending at Nq and Nk, no sequence past max_seqlen): one device-to-host
    read for each cu_seqlens pair and sizes (again after the tensors are written; none
    under torch.compile or while a CUDA graph is captured)."""
    for name, n in ((f"max_seqlen{names[0]}", max_seqlen_q),
                    (f"max_seqlen{names[1]}", max_seqlen_k)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    sizes = (Nq, Nk, max_seqlen_q, max_seqlen_k)
    _check_cu_seqlens(f"cu_seqlens{names[0]}", cu_seqlens_q, ref)
    _check_cu_seqlens(f"cu_seqlens{names[1]}", cu_seqlens_k, ref)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1); got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    if (torch.compiler.is_compiling()
            or (ref.is_cuda and torch.cuda.is_current_stream_capturing())
            or _passed_before(cu_seqlens_q, cu_seqlens_k, sizes)):
        return
    bad_q, bad_k = torch.stack([_breaks_rules(cu_seqlens_q, Nq, max_seqlen_q),
                                _breaks_rules(cu_seqlens_k, Nk, max_seqlen_k)]).tolist()
    for name, is_bad, rows, longest in ((f"cu_seqlens{names[0]}", bad_q, Nq, max_seqlen_q),
                                        (f"cu_seqlens{names[1]}", bad_k, Nk, max_seqlen_k)):
        if is_bad:
            raise ValueError(f"{name} must start at 0, never decrease and end at {rows}, "
                             f"with no sequence longer than {longest}")
    _mark_checked(cu_seqlens_q, cu_seqlens_k, sizes)


def _mark_checked(cu_q: Tensor, cu_k: Tensor, sizes: tuple[int, ...]) -> None:
    """What _passed_before looks for: this pair passed the value check for these sizes."""
    cu_q._fusedtrain_checked = (weakref.ref(cu_k), *_value_check_mark(cu_q, cu_k, sizes))


def vouch_cu_seqlens(cu_seqlens: Tensor, n: int, max_seqlen: int) -> None:
    """Record that cu_seqlens, as both cu_seqlens_q and cu_seqlens_k over n tokens with
    max_seqlen, follows the rules by construction (fusedtrain.documents' form): the ops
    read none of its values, which saves a packed training step its one device-to-host
    wait. Cleared like a passed check, by any write to it."""
    if torch.compiler.is_compiling():  # not checked there either
        return
    _mark_checked(cu_seqlens, cu_seqlens, (n, n, max_seqlen, max_seqlen))


def flash_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           causal: bool = True, softmax_scale: float | None = None,
                           window: tuple[int, int] | None = None,
                           softcap: float | None = None) -> Tensor:
    """flash_attention over a batch of sequences packed along the first dim, no attention
    crossing a sequence boundary (FlashAttention's flash_attn_varlen_func conventions).

    q: (Nq, Hq, D); k, v: (Nk, Hkv, D), Hq % Hkv == 0; sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k
    and v; cu_seqlens_*: int32 (batch + 1,), from 0, non-decreasing, ending at N, no
    sequence longer than max_seqlen_*. Sequences of length 0 and 1 are allowed. causal,
    softmax_scale, window and softcap as flash_attention's, per sequence (masks aligned to
    each sequence's bottom right). -> o: (Nq, Hq, D).
    The cu_seqlens rules are checked on their values (checked_cu_seqlens).
    """
    q, k, v, scale, window, softcap = _checked_args(q, k, v, 3, softmax_scale, window, softcap)
    checked_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                       max_seqlen_k)
    if q.numel() == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return q.new_zeros(q.shape)
    return _apply_flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                         (max_seqlen_q, max_seqlen_k), bool(causal), scale,
                                         window, softcap)
