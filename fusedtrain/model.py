"""GPT-2 shaped language model: pre-norm blocks on a residual stream, GPT-2's by default
(learned positions, LayerNorm, GELU MLP, tied head), Llama's by switches (rotary positions,
RMSNorm, SwiGLU, grouped-query attention, untied head); optionally packed rows of documents
(cu_seqlens) that attend only to themselves."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from fusedtrain import eager
from fusedtrain.casts import grouped_casts
from fusedtrain.documents import Documents, documents
from fusedtrain.modules import MLP, CausalSelfAttention, ResidualLayerNorm, SwiGLU

KERNEL_FAMILIES = ("mlp", "qkv", "attention", "layernorm", "cross_entropy", "embedding")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    gelu: str = "tanh"  # "tanh" (GPT-2's) or "none" (erf)
    eager_attention: str = "math"  # the unfused attention: "math" or "sdpa"
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
    attention_window: int | None = None  # each token sees itself and this many before it
    norm: str = "layernorm"  # "layernorm" or "rmsnorm"
    mlp: str = "gelu"  # "gelu" (GPT-2's) or "swiglu" (Llama's, no biases)
    mlp_hidden: int | None = None  # None: 4 C (gelu), 8 C / 3 rounded up to 64 (swiglu)
    pos: str = "learned"  # "learned" (GPT-2's table) or "rope" (rotary q and k)
    rope_base: float = 10000.0
    tie_head: bool = True  # the output head reads the token embedding's table
    kernels: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(KERNEL_FAMILIES, False))

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if (not isinstance(self.n_kv_head, int) or isinstance(self.n_kv_head, bool)
                or self.n_kv_head <= 0 or self.n_head % self.n_kv_head):
            raise ValueError(f"model.n_kv_head must be a positive divisor of model.n_head "
                             f"({self.n_head}), got {self.n_kv_head!r}")
        if self.attention_window is not None and (
                not isinstance(self.attention_window, int)
                or isinstance(self.attention_window, bool) or self.attention_window < 0):
            raise ValueError(f"model.attention_window must be a non-negative int or null, got "
                             f"{self.attention_window!r}")
        for name, options in (("norm", ("layernorm", "rmsnorm")), ("mlp", ("gelu", "swiglu")),
                              ("pos", ("learned", "rope"))):
            if getattr(self, name) not in options:
                raise ValueError(f"model.{name} must be one of {options}, got "
                                 f"{getattr(self, name)!r}")
        if self.mlp == "swiglu" and self.bias:
            raise ValueError("model.mlp=swiglu has no biases: set model.bias=false")
        if self.mlp_hidden is None:
            self.mlp_hidden = (4 * self.n_embd if self.mlp == "gelu"
                               else -(-8 * self.n_embd // 3 // 64) * 64)
        if (not isinstance(self.mlp_hidden, int) or isinstance(self.mlp_hidden, bool)
                or self.mlp_hidden <= 0):
            raise ValueError(f"model.mlp_hidden must be a positive int or null, got "
                             f"{self.mlp_hidden!r}")
        if self.pos == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"model.pos=rope needs an even head dim, got "
                             f"{self.n_embd // self.n_head}")
        if not 1.0 < float(self.rope_base) < math.inf:
            raise ValueError(f"model.rope_base must be a finite number > 1, got "
                             f"{self.rope_base!r}")
        self.rope_base = float(self.rope_base)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.gelu not in ("none", "tanh"):
            raise ValueError(f"model.gelu must be 'none' or 'tanh', got {self.gelu!r}")
        if self.eager_attention not in ("math", "sdpa"):
            raise ValueError(
                f"model.eager_attention must be 'math' or 'sdpa', got {self.eager_attention!r}"
            )
        unknown = set(self.kernels) - set(KERNEL_FAMILIES)
        if unknown:
            raise ValueError(
                f"unknown model.kernels entries {sorted(unknown)}; known: {list(KERNEL_FAMILIES)}"
            )
        self.kernels = {k: bool(self.kernels.get(k, False)) for k in KERNEL_FAMILIES}

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    """Pre-LN transformer block on the residual stream.

    The sublayer output of the previous block arrives as `delta` and is added to
    the stream inside this block's first LayerNorm (fused as add_layer_norm);
    this block's MLP output leaves as the next delta.

    With the fused LayerNorm and no dropout (`biases_in_ln`), the two output projections
    leave their biases out and the next LayerNorm adds each (add_layer_norm's x_bias),
    whose backward pass then sums its gradient from the gradient it writes anyway: no
    separate read of a (B, T, C) gradient for either bias. The MLP's bias leaves the block
    as `delta_bias`, a copy: the next block may be another FSDP unit, which must not read
    this one's (resharded) parameters; the copy's gradient flows back into this block.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        k = cfg.kernels
        self.ln_1 = ResidualLayerNorm(cfg.n_embd, k["layernorm"], cfg.bias, cfg.norm)
        self.attn = CausalSelfAttention(
            cfg.n_embd, cfg.n_head, k["qkv"], k["attention"], cfg.eager_attention, cfg.bias,
            cfg.n_kv_head, cfg.attention_window,
            cfg.rope_base if cfg.pos == "rope" else None,
        )
        self.ln_2 = ResidualLayerNorm(cfg.n_embd, k["layernorm"], cfg.bias, cfg.norm)
        if cfg.mlp == "gelu":
            self.mlp = MLP(cfg.n_embd, k["mlp"], cfg.bias, cfg.gelu, cfg.mlp_hidden)
        else:
            self.mlp = SwiGLU(cfg.n_embd, cfg.mlp_hidden, k["mlp"])
        self.drop = nn.Dropout(cfg.dropout)
        self.biases_in_ln = (k["layernorm"] and cfg.dropout == 0.0 and cfg.bias
                             and cfg.norm == "layernorm" and cfg.mlp == "gelu")
        # The parameters that the fused ops read through prepared casts, cast together.
        mlp_linears = ([self.mlp.c_fc, self.mlp.c_proj] if cfg.mlp == "gelu"
                       else [self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj])
        linears = ([self.attn.c_attn, self.attn.c_proj] if k["qkv"] else []) + (
            mlp_linears if k["mlp"] else [])
        in_ln = [self.attn.c_proj.bias, self.mlp.c_proj.bias] if self.biases_in_ln else []
        self._cast_params = [p for m in linears for p in (m.weight, m.bias)
                             if p is not None and all(p is not b for b in in_ln)]

    def forward(
        self, stream: torch.Tensor, delta: torch.Tensor | None = None,
        delta_bias: torch.Tensor | None = None, docs: Documents | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """stream, delta: (B, T, C); delta_bias: (C,) -> (stream, delta), or with
        biases_in_ln (stream, delta, delta_bias): the MLP's output without its bias, and
        the bias for the next LayerNorm to add. docs: packed rows' documents, each
        attending only to itself."""
        with grouped_casts(*self._cast_params):
            h, stream = self.ln_1(stream, delta, delta_bias)
            if not self.biases_in_ln:
                h, stream = self.ln_2(stream, self.drop(self.attn(h, docs=docs)))
                return stream, self.drop(self.mlp(h))
            h, stream = self.ln_2(stream, self.attn(h, out_bias=False, docs=docs),
                                  self.attn.c_proj.bias)
            return stream, self.mlp(h, out_bias=False), self.mlp.c_proj.bias.clone()


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        parts = dict(wte=nn.Embedding(cfg.vocab_size, cfg.n_embd))
        if cfg.pos == "learned":
            parts["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.transformer = nn.ModuleDict(dict(
            **parts,
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=ResidualLayerNorm(cfg.n_embd, cfg.kernels["layernorm"], cfg.bias, cfg.norm),
        ))
        self.lm_head = (None if cfg.tie_head
                        else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False))
        self.apply(self._init_weights)
        self._param_counts = (sum(p.numel() for p in self.parameters()),
                              cfg.block_size * cfg.n_embd if cfg.pos == "learned" else 0)
        # GPT-2: residual projections scaled by 1/sqrt(2L) so the stream's variance
        # does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) token ids -> the residual stream (B, T, C)."""
        return self._embed(idx)[0]

    def _embed(self, idx: torch.Tensor, docs: Documents | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """idx: (B, T) -> (the residual stream (B, T, C), the tied head's weight): with the
        fused embedding the token table as ops.gpt_embedding returns it, so that the head's
        gradient for it and the embedding's meet in that op's backward. With docs the
        positions restart at each document."""
        T = idx.shape[1]
        if self.config.block_size < T:
            raise ValueError(
                f"sequence length {T} exceeds model.block_size {self.config.block_size}"
            )
        tr = self.transformer
        positions = None if docs is None else docs.positions
        if self.config.kernels["embedding"]:
            from fusedtrain import ops as impl
        else:
            impl = eager
        if self.config.pos == "rope":  # positions enter in each attention
            x, head_weight = impl.embedding(idx, tr.wte.weight), self.head_weight()
        elif impl is eager:
            x, head_weight = eager.gpt_embedding(idx, tr.wte.weight, tr.wpe.weight,
                                                 positions=positions)
        else:
            # In place: the head (ops.linear or ops.linear_cross_entropy) hands its
            # weight's gradient over fresh.
            x, head_weight = impl.gpt_embedding(idx, tr.wte.weight, tr.wpe.weight,
                                                inplace_backward=True, positions=positions)
        return tr.drop(x), head_weight if self.config.tie_head else self.head_weight()

    def head_weight(self) -> torch.Tensor:
        """The output head's weight, (vocab, C): the token table when tied."""
        return self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight

    def _head_input(self, stream: torch.Tensor, delta: torch.Tensor | None = None,
                    delta_bias: torch.Tensor | None = None,
                    head_weight: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last block's output (stream, delta[, delta_bias]) -> (ln_f of it: (B, T, C),
        the head's weight: (vocab, C)). head_weight: the token table as _embed returned it
        (default: the table)."""
        x, _ = self.transformer.ln_f(stream, delta, delta_bias)
        return x, self.head_weight() if head_weight is None else head_weight

    def logits(self, *last: torch.Tensor, head_weight: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The last block's output `last` -> logits (B, T, vocab)."""
        x, wte = self._head_input(*last, head_weight=head_weight)
        if self.config.kernels["embedding"]:
            from fusedtrain import ops

            # Under autocast its fp32 gradient comes from the GEMM, not widened after it.
            return ops.linear(x, wte)
        return F.linear(x, wte)

    def head_loss(self, targets: torch.Tensor, *last: torch.Tensor,
                  head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy from the last block's output `last`."""
        if self.config.kernels["cross_entropy"]:
            from fusedtrain import ops

            # The head and its loss in one op: the logits' gradient is computed with the
            # loss, in the logits' memory.
            return ops.linear_cross_entropy(*self._head_input(*last, head_weight=head_weight),
                                            targets)
        return eager.cross_entropy(self.logits(*last, head_weight=head_weight), targets)

    def _trunk(self, idx: torch.Tensor, cu_seqlens: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(the tied head's weight, the last block's output (stream, delta[, delta_bias]),
        see Block.forward)."""
        docs = None
        if cu_seqlens is not None:
            c = self.config
            docs = documents(cu_seqlens, *idx.shape, c.attention_window,
                             eager=not c.kernels["attention"])
        x, head_weight = self._embed(idx, docs)
        out = (x,)
        with grouped_casts(*self._cast_params_of_all_blocks()):
            for block in self.transformer.h:
                out = block(*out, docs=docs)
        return head_weight, out

    def _cast_params_of_all_blocks(self) -> list[torch.Tensor]:
        """When training with plain blocks, every block's grouped-cast parameters, for one
        multi-tensor cast before the first block instead of one a block (at GPT-2's size a
        block's 7M parameters fill ~108 of the copy kernel's thread blocks, under one per
        SM of an H200). Their copies live until backward either way, which saves them.
        None when the blocks are FSDP units (their parameters exist only while each block
        runs) or without gradients (each block's copies can go when it is done)."""
        blocks = self.transformer.h
        if not torch.is_grad_enabled() or any(type(b) is not Block for b in blocks):
            return []
        return [p for b in blocks for p in b._cast_params]

    def forward(self, idx: torch.Tensor, cu_seqlens: torch.Tensor | None = None
                ) -> torch.Tensor:
        """idx: (B, T) token ids -> logits: (B, T, vocab_size). cu_seqlens: packed rows'
        documents, int32 (n + 1,), the first token of each in idx's B * T flattened tokens,
        then B * T (data.pack_collate's; see documents.documents): attention and positions
        restart at each document and at each row."""
        head_weight, last = self._trunk(idx, cu_seqlens)
        return self.logits(*last, head_weight=head_weight)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor,
             cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy over the targets other than -100.  idx, targets:
        (B, T); cu_seqlens as forward's."""
        head_weight, last = self._trunk(idx, cu_seqlens)
        return self.head_loss(targets, *last, head_weight=head_weight)

    @classmethod
    def from_pretrained(cls, path: str, kernels: dict[str, bool] | None = None,
                        eager_attention: str | None = None) -> GPT:
        """A GPT from a safetensors file written by scripts/export.py, built fused or
        eager (`kernels`; default all eager): both paths share parameter names."""
        from fusedtrain.training.checkpoint import load_safetensors

        state, cfg = load_safetensors(path)
        return cls._built(state, cfg, kernels, eager_attention)

    @classmethod
    def from_hf(cls, source: str | os.PathLike | torch.nn.Module,
                kernels: dict[str, bool] | None = None,
                eager_attention: str | None = None) -> GPT:
        """A GPT with the weights of a transformers GPT2LMHeadModel or LlamaForCausalLM, or
        of a local directory that loads as one (fusedtrain.hf, fusedtrain.hf_llama), built
        fused or eager (`kernels`; default all eager). Its vocabulary is the model's own."""
        from fusedtrain.hf import from_hf

        state, cfg = from_hf(source)
        return cls._built(state, cfg, kernels, eager_attention)

    @classmethod
    def _built(cls, state: dict, cfg: dict, kernels: dict[str, bool] | None,
               eager_attention: str | None) -> GPT:
        """A GPT of config `cfg` holding `state`: the kernels given (none: all eager, not
        those the weights were trained with) and eager_attention where given."""
        cfg = {**cfg, "kernels": dict(kernels or {})}
        if eager_attention is not None:
            cfg["eager_attention"] = eager_attention
        model = cls(GPTConfig(**cfg))
        model.load_state_dict(state)
        return model

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; with non_embedding, position embeddings are left out (the token
        embedding stays: it is the head's weight too, or stands in for an untied head's).
        Counted when the model was built: FSDP later leaves each rank only its shard of
        the parameters."""
        n, wpe = self._param_counts
        return n - wpe if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training flops per token: 6N + 12 * L * H * Dh * T (PaLM appendix B), N the
        parameters of matrix products (the head once: an untied token table only looks
        rows up), T the keys a query may see (at most attention_window + 1)."""
        c = self.config
        T = seq_len or c.block_size
        if c.attention_window is not None:
            T = min(T, c.attention_window + 1)
        lookups = 0 if c.tie_head else c.vocab_size * c.n_embd
        return 6 * (self.num_params() - lookups) + 12 * c.n_layer * c.n_embd * T
