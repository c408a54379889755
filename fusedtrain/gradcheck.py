"""Gradient checks as a run: op gradchecks in fp64, model-level fused-vs-eager gradients,
and an accuracy report. Used by scripts/gradcheck.py and the test suite.

The judging rule everywhere (docs/design.md): the fused error against an fp64 oracle stays
within 2x the eager op's own error in the same dtype, plus a small absolute tolerance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusedtrain import eager
from fusedtrain.model import GPT, GPTConfig

F64 = torch.float64
# gradcheck's fast mode compares one projection v^T J u (u, v random, positive, unit norm)
# of the analytical and the numerical Jacobian, and scales atol by sum(u) sum(v), ~n for
# n elements. A LayerNorm's Jacobian removes the constant direction, where most of such a
# u lies, so its projection can be ~1e-3: with the default atol (1e-5, ~1.4e-3 once
# scaled) a dx 1.5x too large passed. In fp64 the fused ops and finite differences agree
# to atol 1e-10 and rtol 1e-7 on every op case here (CPU); these keep 100x of margin.
ATOL, RTOL = 1e-8, 1e-4


def gradcheck(fn: Callable, inputs: tuple, **kwargs) -> bool:
    """torch.autograd.gradcheck(fn, inputs, **kwargs) at ATOL and RTOL."""
    return torch.autograd.gradcheck(fn, inputs, **{"atol": ATOL, "rtol": RTOL, **kwargs})


@dataclass
class Result:
    name: str
    passed: bool
    detail: str = ""


def _rand(*shape, device="cpu", dtype=F64, grad=True, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_(grad)


def op_cases(device: str) -> dict[str, list[tuple[str, Callable[[], tuple]]]]:
    """Per kernel family: (case name, fn, input factory) at small odd shapes, fp64."""
    from fusedtrain import ops

    r = lambda *s, **k: _rand(*s, device=device, **k)  # noqa: E731
    cases: dict[str, list] = {"mlp": [], "qkv": [], "attention": [], "layernorm": [],
                              "cross_entropy": [], "embedding": []}
    for a in ("none", "tanh"):
        cases["mlp"].append((f"linear_gelu[{a}]", lambda a=a: (
            lambda x, w, b: ops.linear_gelu(x, w, b, a), (r(2, 5, 7), r(9, 7), r(9)))))
        cases["mlp"].append((f"fused_mlp[{a}]", lambda a=a: (
            lambda *t: ops.fused_mlp(*t, a), (r(5, 7), r(9, 7), r(9), r(6, 9), r(6)))))
        cases["layernorm"].append((f"layer_norm_gelu[{a}]", lambda a=a: (
            lambda *t: ops.layer_norm_gelu(*t, approximate=a), (r(3, 5, 13), r(13), r(13)))))
    cases["qkv"].append(("qkv_projection", lambda: (
        lambda *t: ops.qkv_projection(*t, 3), (r(2, 5, 12), r(36, 12), r(36)))))
    cases["qkv"].append(("linear", lambda: (ops.linear, (r(2, 5, 12), r(7, 12), r(7)))))
    positions = torch.tensor([[0, 1, 2, 0, 1], [4, 0, 1, 2, 3]], device=device)
    cases["qkv"].append(("qkv_projection[grouped, rope]", lambda: (
        lambda *t: ops.qkv_projection(*t, 3, 1, 500.0, positions),
        (r(2, 5, 12), r(20, 12), r(20)))))
    cases["mlp"].append(("swiglu_mlp", lambda: (
        ops.swiglu_mlp, (r(5, 7), r(9, 7), r(9, 7), r(6, 9)))))
    for causal in (True, False):
        cases["attention"].append((f"flash_attention[causal={causal}]", lambda c=causal: (
            lambda *t: ops.flash_attention(*t, causal=c), (r(2, 2, 13, 16), r(2, 2, 13, 16),
                                                           r(2, 2, 13, 16)))))
    cases["attention"].append(("qkv_attention", lambda: (
        lambda *t: ops.qkv_attention(*t, 3), (r(2, 5, 12), r(36, 12), r(36)))))
    cu = torch.tensor([0, 3, 3, 7, 10], device=device, dtype=torch.int32)  # one empty
    cases["attention"].append(("qkv_attention_varlen[grouped, rope]", lambda: (
        lambda *t: ops.qkv_attention_varlen(*t, 3, cu, 4, n_kv_heads=1, rope_base=500.0),
        (r(2, 5, 12), r(20, 12), r(20)))))
    cases["layernorm"].append(("rms_norm", lambda: (ops.rms_norm, (r(3, 5, 13), r(13)))))
    cases["layernorm"].append(("add_rms_norm", lambda: (
        ops.add_rms_norm, (r(3, 5, 13), r(3, 5, 13), r(13)))))
    cases["layernorm"].append(("layer_norm", lambda: (
        ops.layer_norm, (r(3, 5, 13), r(13), r(13)))))
    cases["layernorm"].append(("layer_norm_stream", lambda: (
        ops.layer_norm_stream, (r(3, 5, 13), r(13), r(13)))))
    cases["layernorm"].append(("add_layer_norm", lambda: (
        ops.add_layer_norm, (r(3, 5, 13), r(3, 5, 13), r(13), r(13)))))
    cases["layernorm"].append(("add_layer_norm[x_bias]", lambda: (
        lambda *t: ops.add_layer_norm(*t[:4], 1e-5, t[4]),
        (r(3, 5, 13), r(3, 5, 13), r(13), r(13), r(13)))))
    ids = torch.tensor([[3, 0, 3], [9, 3, 1]], device=device)  # repeated ids add up
    cases["embedding"].append(("embedding", lambda: (
        lambda w: ops.embedding(ids, w), (r(11, 6),))))
    cases["embedding"].append(("gpt_embedding[positions]", lambda: (
        lambda w, p: ops.gpt_embedding(ids, w, p, positions=ids % 2)[0], (r(11, 6), r(4, 6)))))
    targets = torch.tensor([[3, 0, 10], [-100, 7, 1]], device=device)
    cases["cross_entropy"].append(("cross_entropy", lambda: (
        lambda logits: ops.cross_entropy(logits, targets), (r(2, 3, 11),))))
    cases["cross_entropy"].append(("linear_cross_entropy", lambda: (
        lambda x, w: ops.linear_cross_entropy(x, w, targets), (r(2, 3, 5), r(11, 5)))))
    return cases


def check_ops(kernels: dict[str, bool], device: str = "cpu") -> list[Result]:
    """torch.autograd.gradcheck (fp64) of every op of every enabled family."""
    results = []
    for family, cases in op_cases(device).items():
        if not kernels.get(family, False):
            continue
        for name, make in cases:
            fn, inputs = make()
            try:
                ok = gradcheck(fn, inputs, fast_mode=True, raise_exception=False)
                results.append(Result(f"ops/{name}", bool(ok), "" if ok else "gradcheck failed"))
            except Exception as e:  # a crash is a failure of that op, named
                results.append(Result(f"ops/{name}", False, f"{type(e).__name__}: {e}"[:200]))
    return results


def _loss_and_grads(model: GPT, x: torch.Tensor, dtype: torch.dtype):
    model.zero_grad(set_to_none=True)
    use_amp = dtype in (torch.bfloat16, torch.float16)
    with torch.autocast(x.device.type, dtype=dtype, enabled=use_amp):
        loss = model.loss(x[:, :-1], x[:, 1:])
    loss.backward()
    return loss.detach().double(), {n: p.grad.detach().double()
                                    for n, p in model.named_parameters()}


def check_model(cfg: GPTConfig, dtype: torch.dtype, device: str, batch: int = 2,
                seq: int | None = None, seed: int = 0, atol: float = 1e-6) -> list[Result]:
    """The GPT with the enabled fused components against the all-eager GPT, same weights
    and batch; errors measured against the all-eager model in fp64. Low-precision dtypes
    run under autocast (fp32 weights), as training does."""
    torch.manual_seed(seed)
    eager_cfg = copy.deepcopy(cfg)
    eager_cfg.kernels = dict.fromkeys(cfg.kernels, False)
    eager_model = GPT(eager_cfg).to(device)
    fused_model = GPT(cfg).to(device)
    fused_model.load_state_dict(eager_model.state_dict())
    seq = seq or min(cfg.block_size, 64)
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    ref_loss, ref = _loss_and_grads(copy.deepcopy(eager_model).to(F64), x, F64)
    param_dtype = F64 if dtype == F64 else torch.float32
    e_loss, e = _loss_and_grads(eager_model.to(param_dtype), x, dtype)
    f_loss, f = _loss_and_grads(fused_model.to(param_dtype), x, dtype)
    results = []
    for name, r, ee, ff in [("loss", ref_loss, e_loss, f_loss)] + [
            (n, ref[n], e[n], f[n]) for n in ref]:
        err_e = (ee - r).abs().max().item()
        err_f = (ff - r).abs().max().item()
        scale = r.abs().max().item()
        rel = err_f / max(scale, 1e-30)
        # The loss is one number, not a distribution: its eager error can be near zero by
        # luck. It also gets the rounding noise expected of a mean over the batch's tokens:
        # one unit of the dtype at the loss's magnitude, over sqrt(tokens).
        slack = torch.finfo(dtype).eps * scale / (batch * seq) ** 0.5 if name == "loss" else 0.0
        ok = err_f <= 2 * err_e + atol + slack
        results.append(Result(f"model[{str(dtype)[6:]}]/{name}", ok,
                              f"fused {err_f:.2e}  eager {err_e:.2e}  rel {rel:.2e}"))
    return results


def accuracy_report(draws: int, device: str, dtype: torch.dtype, large: bool,
                    on_op: Callable[[str, dict], None] | None = None) -> dict:
    """For each op: over `draws` fresh random inputs, the distribution (max, p99, mean) of
    |fused - fp64 reference| next to the eager op's, for the forward output. `on_op(name,
    summary)` is called as each op's summary is ready (the large shapes take minutes)."""
    from fusedtrain import ops

    if large:
        shapes = dict(mlp=(16384, 768, 3072), qkv=(16, 1024, 768, 12),
                      attn=(16, 12, 1024, 64), ln=(16384, 768), ce=(4096, 50304, 768))
    else:
        shapes = dict(mlp=(113, 72, 130), qkv=(2, 37, 48, 4), attn=(1, 2, 113, 32), ln=(113, 96),
                      ce=(113, 1037, 40))
    M, K, N = shapes["mlp"]
    B, T, C, H = shapes["qkv"]
    b_, h_, t_, d_ = shapes["attn"]
    Ml, Cl = shapes["ln"]
    Mc, V, Cc = shapes["ce"]
    r = lambda *s, scale=1.0: _rand(*s, device=device, dtype=torch.float32, grad=False,  # noqa
                                    scale=scale)
    makers = {
        "linear_gelu": ("linear_gelu", lambda: (r(M, K), r(N, K, scale=K ** -0.5), r(N))),
        "fused_mlp": ("fused_mlp", lambda: (r(M, K), r(N, K, scale=K ** -0.5), r(N),
                                            r(K, N, scale=N ** -0.5), r(K))),
        "qkv_projection": ("qkv_projection", lambda: (r(B, T, C), r(3 * C, C, scale=C ** -0.5),
                                                      r(3 * C), H)),
        "flash_attention": ("flash_attention", lambda: (r(b_, h_, t_, d_), r(b_, h_, t_, d_),
                                                        r(b_, h_, t_, d_))),
        "layer_norm": ("layer_norm", lambda: (r(Ml, Cl), 1 + r(Cl, scale=0.1),
                                              r(Cl, scale=0.1))),
        "add_layer_norm": ("add_layer_norm", lambda: (r(Ml, Cl), r(Ml, Cl), 1 + r(Cl, scale=0.1),
                                                      r(Cl, scale=0.1))),
        "layer_norm_gelu": ("layer_norm_gelu", lambda: (r(Ml, Cl), 1 + r(Cl, scale=0.1),
                                                        r(Cl, scale=0.1))),
        "cross_entropy": ("cross_entropy", lambda: (
            r(Mc, V, scale=3.0), torch.randint(0, V, (Mc,), device=device))),
        "linear_cross_entropy": ("linear_cross_entropy", lambda: (
            r(Mc, Cc), r(V, Cc, scale=3 * Cc ** -0.5), torch.randint(0, V, (Mc,), device=device))),
    }
    report = {}
    for op_name, (fn_name, make) in makers.items():
        errs = {"fused": [], "eager": []}
        for _ in range(draws):
            args = make()
            low = [a.to(dtype) if _floating(a) else a for a in args]
            ref = getattr(eager, fn_name)(*[a.double() if _floating(a) else a for a in args])
            for impl, mod in (("fused", ops), ("eager", eager)):
                out = getattr(mod, fn_name)(*low)
                outs = out if isinstance(out, tuple) else (out,)
                refs = ref if isinstance(ref, tuple) else (ref,)
                errs[impl].append(torch.cat([(o.double() - rr).abs().flatten()
                                             for o, rr in zip(outs, refs)]).cpu())
        report[op_name] = {impl: _summary(torch.cat(v)) for impl, v in errs.items()}
        if on_op is not None:
            on_op(op_name, report[op_name])
    return report


def _floating(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _summary(err: torch.Tensor) -> dict:
    sample = err if err.numel() <= 1 << 24 else err[torch.randperm(err.numel())[: 1 << 24]]
    return {"max": err.max().item(), "p99": sample.quantile(0.99).item(),
            "mean": err.mean().item()}
