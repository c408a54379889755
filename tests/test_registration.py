"""Every `fusedtrain::` custom op passes torch.library.opcheck (schema, fake tensor,
autograd registration, AOT dispatch with dynamic shapes) with the arguments the public
ops really give it in a forward and backward pass: what torch.compile relies on."""

import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, bf16_adamw_step
from torch.utils._python_dispatch import TorchDispatchMode

from fusedtrain import ops
from fusedtrain.ops import _registry
from fusedtrain.ops.published_cast import published_cast

F64 = torch.float64
OPS = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fusedtrain::"))


class _FirstCalls(TorchDispatchMode):
    """Records the first call of each fusedtrain op (a dispatch mode also makes the
    launchers go through the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusedtrain":
            self.calls.setdefault(func.name(), (func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def first_calls():
    def leaf(*shape):
        return torch.randn(*shape, dtype=F64, requires_grad=True)

    B, T, C, H = 2, 5, 12, 3
    x = leaf(B, T, C)
    with _FirstCalls() as mode:
        losses = [ops.linear_gelu(x, leaf(7, C), leaf(7)).sum(),
                  ops.fused_mlp(x, leaf(16, C), leaf(16), leaf(C, 16), leaf(C)).sum()]
        losses.append(ops.swiglu_mlp(x, leaf(16, C), leaf(16, C), leaf(C, 16)).sum())
        with torch.no_grad():
            ops.linear_gelu(x, leaf(7, C), leaf(7))
            ops.swiglu_mlp(x, leaf(16, C), leaf(16, C), leaf(C, 16))
        q, k, v = ops.qkv_projection(x, leaf(3 * C, C), leaf(3 * C), H)
        losses.append(ops.rotary(q, 10000.0, torch.tensor([[0, 1, 0, 1, 2]] * B)).sum())
        losses.append(ops.flash_attention(q, k, v, causal=True).sum())
        # Grouped heads, a window and a softcap: the backward with three gradient buffers.
        losses.append(ops.flash_attention(q, k[:, :1], v[:, :1], causal=True, window=(2, 0),
                                          softcap=3.0).sum())
        cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # a packed batch, one empty
        losses.append(ops.flash_attention_varlen(
            leaf(5, 2, 8), leaf(5, 1, 8), leaf(5, 1, 8), cu, cu, 3, 3).sum())
        losses.append(ops.qkv_attention_varlen(x[:1], leaf(2 * C, C), leaf(2 * C), 4, cu, 3,
                                               n_kv_heads=2).sum())
        # Created last, so its backward runs first: the attention_bwd recorded is the one
        # that also sums a bias gradient.
        losses.append(ops.qkv_attention(x, leaf(3 * C, C), leaf(3 * C), H).sum())
        losses.append(ops.layer_norm(x, leaf(C), leaf(C)).sum())
        y, s = ops.add_layer_norm(x, leaf(B, T, C), leaf(C), leaf(C))
        losses += [y.sum(), s.sum(), ops.layer_norm_gelu(x, leaf(C), leaf(C)).sum()]
        losses.append(ops.cross_entropy(leaf(B * T, 11), torch.randint(0, 11, (B * T,))))
        losses.append(ops.linear_cross_entropy(x, leaf(11, C), torch.randint(0, 11, (B, T))))
        losses.append(ops.embedding(torch.tensor([[1, 4, 1]]), leaf(6, C)).sum())
        for inplace in (True, False):  # into the head's gradient, or into a new one
            xe, head_weight = ops.gpt_embedding(torch.tensor([[1, 4, 1]]), leaf(6, C),
                                                leaf(4, C), inplace_backward=inplace)
            losses.append((xe @ head_weight.t()).sum())
        # What the fused ops cast their weights with under torch.compile.
        published_cast(leaf(4, C).detach(), torch.float32)
        sum(losses).backward()
    return mode.calls


def test_every_op_is_reached(first_calls):
    assert OPS and sorted(first_calls) == OPS


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, first_calls):
    func, args, kwargs = first_calls[name]
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(func, args, kwargs)


def test_opcheck_gpt_embedding_at_given_positions():
    """The input embedding's launchers with packed documents' positions (first_calls
    records them without)."""
    idx, positions = torch.tensor([[1, 4, 1]]), torch.tensor([[0, 0, 1]])
    tw, pw, dx = (torch.randn(*s, dtype=F64) for s in ((6, 12), (4, 12), (1, 3, 12)))
    emb = torch.ops.fusedtrain
    torch.library.opcheck(emb.gpt_embedding_fwd.default, (idx, tw, pw, positions))
    torch.library.opcheck(emb.gpt_embedding_bwd.default, (idx, dx, None, 6, 4, positions))
    torch.library.opcheck(emb.gpt_embedding_bwd_into.default,
                          (idx, dx, torch.zeros(6, 12, dtype=F64), 4, positions))


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on CPU needs a C++ compiler")
def test_inductor_never_formats_an_op_for_an_implicit_fallback(monkeypatch):
    """After register_inductor_fallbacks every fusedtrain:: op has a lowering, so Inductor
    never builds the implicit fallback's log message for one (torch 2.11 builds it at any
    log level, formatting the op's whole input IR: minutes for a 12-layer GPT). Logging at
    INFO makes even a lazy message get built, so the test fails without the fallbacks."""
    from torch._inductor import exc, lowering

    formatted = []
    operator_str = exc.OperatorIssue.operator_str
    monkeypatch.setattr(exc.OperatorIssue, "operator_str", staticmethod(
        lambda target, args, kwargs: formatted.append(str(target))
        or operator_str(target, args, kwargs)))
    ops.register_inductor_fallbacks()
    assert all(getattr(torch.ops.fusedtrain, n.split("::")[1]).default in lowering.lowerings
               for n in OPS)
    x, w, b = torch.randn(3, 5, 16), torch.randn(16), torch.randn(16)
    wl, bl = torch.randn(8, 16, requires_grad=True), torch.randn(8)

    def f(x):
        return ops.linear_gelu(ops.layer_norm(x, w, b), wl, bl).sum()

    torch._logging.set_logs(inductor=logging.INFO)
    try:
        with torch._inductor.config.patch(force_disable_caches=True):  # lower, not load
            out = torch.compile(f, fullgraph=True)(x)
            out.backward()
    finally:
        torch._logging.set_logs()
    torch.testing.assert_close(out, f(x))
    assert not [t for t in formatted if "fusedtrain" in t]


def _every_op_forward_and_backward(device: str) -> list[torch.Tensor]:
    """Outputs and input gradients of every public op (fp32, small odd shapes)."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(device).requires_grad_()

    B, T, C, H = 2, 5, 12, 3
    x, w, b = leaf(B, T, C), leaf(C), leaf(C)
    outs = [ops.linear_gelu(x, leaf(7, C), leaf(7)),
            ops.fused_mlp(x, leaf(16, C), leaf(16), leaf(C, 16), leaf(C)),
            ops.swiglu_mlp(x, leaf(16, C), leaf(16, C), leaf(C, 16)),
            *ops.qkv_projection(x, leaf(3 * C, C), leaf(3 * C), H),
            ops.layer_norm(x, w, b), *ops.add_layer_norm(x, leaf(B, T, C), w, b),
            ops.layer_norm_gelu(x, w, b)]
    q, k, v = (leaf(B, H, T, C // H) for _ in range(3))
    outs.append(ops.flash_attention(q, k, v, causal=True))
    outs.append(ops.qkv_attention(x, leaf(3 * C, C), leaf(3 * C), H))
    targets = torch.randint(0, 11, (B * T,), generator=gen).to(device)
    outs += [ops.cross_entropy(leaf(B * T, 11), targets),
             ops.cross_entropy(leaf(B * T, 11), targets, inplace_backward=True),
             ops.linear_cross_entropy(x, leaf(11, C), targets.view(B, T))]
    leaves = [x, w, b, q, k, v]
    sum(o.float().sum() for o in outs).backward()
    return outs + [t.grad for t in leaves]


def test_every_op_runs_on_meta_tensors_as_on_real_ones():
    """Meta tensors (shape inference, deferred init) go to the fake implementations: the
    same shapes and dtypes as a real run, forward and backward, and no kernel launched."""
    real, meta = _every_op_forward_and_backward("cpu"), _every_op_forward_and_backward("meta")
    assert [(t.shape, t.dtype) for t in meta] == [(t.shape, t.dtype) for t in real]
    assert all(t.is_meta for t in meta)


def test_traceable_launchers_trace_into_their_kernels(tmp_path):
    """scripts/traced_graphs.py: under ops.trace_kernels(), each traceable launcher, traced
    as torch.compile's functionalization traces it (fake CUDA tensors, kernels defined for
    sm_90), leaves its Triton launches in the graph and no opaque op, no launch copies an
    input beyond the known ones, and every traceable launcher has a case. A launch that
    read an address or a plan while traced fails there."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "traced_graphs.py")],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    n = len(_registry.TRACEABLE)
    assert n >= 28 and f"{n} of {n} traceable launchers covered" in r.stdout


def test_traced_graphs_compute_what_their_launchers_compute(tmp_path):
    """scripts/traced_execution.py: each traceable launcher's functionalized graph, run on
    CPU tensors with every launch through the kernel's interpreter twin, gives bit for bit
    the outputs and input writes of the launcher called directly (the check that caught the
    attention's lse and delta lost to functionalization); and the tiny gpt2 and llama
    compiled under trace_kernels (AOTAutograd, no Inductor) give the uncompiled gradients."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "traced_execution.py")],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    done, cases = map(int, re.search(r"(\d+) of (\d+) traced graphs compute", r.stdout).groups())
    assert done == cases >= len(_registry.TRACEABLE)
    assert "2 of 2 traced models compute the uncompiled model's gradients" in r.stdout


def test_trace_kernels_is_refused_by_the_interpreter():
    """Triton's interpreter cannot be traced (wrap_triton hands interpreted kernels back to
    be called on the traced tensors): the ops stay opaque, and asking says so."""
    with pytest.raises(RuntimeError, match="interpreter"):
        ops.trace_kernels(True)
    ops.trace_kernels(False)


def test_trace_kernels_holds_its_compile_settings_and_restores_them(monkeypatch):
    """While on, AOTAutograd's cache is off and Inductor types float kernel arguments as
    fp32 (as Triton's launcher does); going off gives back the user's values."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from fusedtrain.ops import _registry

    monkeypatch.setattr(_registry, "INTERPRET", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", "user's")
    monkeypatch.setattr(inductor_config, "_use_fp64_for_unbacked_floats", "user's")
    ops.trace_kernels(True)
    try:
        assert functorch_config.enable_autograd_cache is False
        assert inductor_config._use_fp64_for_unbacked_floats is False
    finally:
        ops.trace_kernels(False)
    assert functorch_config.enable_autograd_cache == "user's"
    assert inductor_config._use_fp64_for_unbacked_floats == "user's"


@pytest.mark.gpu
def test_gpu_traced_kernels_in_inductors_code_and_equal_to_opaque():
    """Under ops.trace_kernels(), a compiled block of traceable ops (embedding, LayerNorms,
    rotary, cross-entropy; forward and backward) runs the kernels from Inductor's own code
    (their names in it, no fusedtrain:: call left for them) and gives the opaque
    compilation's loss and gradients (the same kernels, launched by another caller;
    within bf16's rounding, as Inductor tunes their tiles itself and fuses the ops
    between them)."""
    from torch._inductor.utils import run_and_get_code

    V, C, T = 1000, 256, 64
    leaf = lambda *s: torch.randn(*s, device="cuda", requires_grad=True)  # noqa: E731
    tw, pw, w, b = leaf(V, C), leaf(T, C), leaf(C), leaf(C)
    idx = torch.randint(0, V, (4, T), device="cuda")

    def loss(tw, pw, w, b):
        with torch.autocast("cuda", torch.bfloat16):
            x, _ = ops.gpt_embedding(idx, tw, pw)
            y, s = ops.add_layer_norm(x, x, w, b)
            q = ops.rotary(ops.layer_norm(s, w, b).view(4, T, 4, C // 4).transpose(1, 2), 1e4)
            logits = (q.transpose(1, 2).reshape(4 * T, C) + y.reshape(4 * T, C)) @ tw.t()
            return ops.cross_entropy(logits, idx.view(-1))

    params = (tw, pw, w, b)

    def step(fn):
        out = fn(*params)
        out.backward()  # compiles the backward graph inside run_and_get_code
        return out

    results = {}
    ops.register_inductor_fallbacks()
    for traced in (False, True):
        torch._dynamo.reset()
        ops.trace_kernels(traced)
        try:
            out, code = run_and_get_code(step, torch.compile(loss, fullgraph=True))
        finally:
            ops.trace_kernels(False)
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        results[traced] = (out.detach(), grads, "\n".join(code))
    code = results[True][2]
    for kernel in ("_embedding_fwd_kernel", "_ln_fwd_kernel", "_ln_bwd_kernel", "_rope_kernel",
                   "_ce_fwd_kernel", "_ce_bwd_kernel"):
        assert kernel in code, kernel
    assert "torch.ops.fusedtrain.layer_norm_fwd" not in code
    assert "torch.ops.fusedtrain.layer_norm_fwd" in results[False][2]
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-2, atol=1e-2)
    for got, want in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", ["gpt2", "llama"])
def test_gpu_traced_model_trains_as_the_uncompiled_one(blocks):
    """Three AdamW steps of the fused model (every family) compiled under
    ops.trace_kernels() against uncompiled from the same weights: the same losses within
    bf16's rounding, and Inductor's code calls no fusedtrain op but the weight-copy cast."""
    from torch._inductor.utils import run_and_get_code

    from fusedtrain.model import GPT, KERNEL_FAMILIES, GPTConfig
    from fusedtrain.optim import AdamW

    shape = dict(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=128)
    if blocks == "llama":
        shape.update(n_kv_head=2, bias=False, norm="rmsnorm", mlp="swiglu", mlp_hidden=256,
                     pos="rope", tie_head=False)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(GPTConfig(**shape, kernels=dict.fromkeys(KERNEL_FAMILIES, True)))
                      .cuda())
    idx = torch.randint(0, 512, (4, 65), device="cuda")
    opts = [AdamW(m.parameters(), lr=1e-2) for m in models]
    ops.register_inductor_fallbacks()
    torch._dynamo.reset()
    ops.trace_kernels(True)
    try:
        compiled = torch.compile(models[1].loss)
        first, code = run_and_get_code(bf16_adamw_step, compiled, opts[1], idx)
        losses = [[bf16_adamw_step(models[0].loss, opts[0], idx) for _ in range(3)],
                  [first] + [bf16_adamw_step(compiled, opts[1], idx) for _ in range(2)]]
    finally:
        ops.trace_kernels(False)
    torch.testing.assert_close(losses[1], losses[0], rtol=5e-3, atol=5e-3)
    calls = set(re.findall(r"torch\.ops\.fusedtrain\.(\w+)", "\n".join(code)))
    assert calls <= {"published_cast"}, calls
