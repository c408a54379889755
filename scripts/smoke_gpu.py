"""Quick GPU smoke check: every fused op forward+backward once at small odd shapes,
compared with its eager twin in fp32. Prints one line per op; exit 1 on a mismatch."""

import sys

import torch

from fusedtrain import eager, ops


def check(name, fn_fused, fn_eager, *shapes, tol=2e-2):
    torch.manual_seed(0)
    ins = [torch.randn(*s, device="cuda", requires_grad=True) for s in shapes]
    outs = []
    for fn in (fn_fused, fn_eager):
        leaves = [t.detach().clone().requires_grad_() for t in ins]
        o = fn(*leaves)
        o = torch.cat([t.flatten() for t in o]) if isinstance(o, tuple) else o.flatten()
        o.backward(torch.ones_like(o))
        outs.append((o.detach(), [t.grad for t in leaves]))
    err = max([(outs[0][0] - outs[1][0]).abs().max().item()]
              + [(a - b).abs().max().item() for a, b in zip(outs[0][1], outs[1][1])])
    print(f"{name:<16} max|fused-eager| = {err:.3g}", flush=True)
    return err < tol


ok = all([
    check("linear_gelu", lambda x, w, b: ops.linear_gelu(x, w, b, "none"),
          lambda x, w, b: eager.linear_gelu(x, w, b, "none"), (113, 72), (130, 72), (130,)),
    check("fused_mlp", lambda *a: ops.fused_mlp(*a, "tanh"), lambda *a: eager.fused_mlp(*a, "tanh"),
          (113, 72), (130, 72), (130,), (72, 130), (72,)),
    check("qkv", lambda *a: ops.qkv_projection(*a, 4), lambda *a: eager.qkv_projection(*a, 4),
          (2, 203, 96), (288, 96), (288,)),
    check("attention", lambda *a: ops.flash_attention(*a), lambda *a: eager.flash_attention(*a),
          (2, 3, 203, 80), (2, 3, 203, 80), (2, 3, 203, 80)),
    check("attention_full", lambda *a: ops.flash_attention(*a, causal=False),
          lambda *a: eager.flash_attention(*a, causal=False), (1, 2, 77, 64), (1, 2, 77, 64),
          (1, 2, 77, 64)),
    check("layer_norm", ops.layer_norm, eager.layer_norm, (37, 1500), (1500,), (1500,)),
    check("add_layer_norm", ops.add_layer_norm, eager.add_layer_norm, (37, 768), (37, 768),
          (768,), (768,)),
    check("layer_norm_gelu", ops.layer_norm_gelu, eager.layer_norm_gelu, (37, 768), (768,),
          (768,)),
])
sys.exit(0 if ok else 1)
