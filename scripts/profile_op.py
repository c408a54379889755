"""Profile one fused op's forward+backward with torch.profiler (CUDA): top ops by time.

  python scripts/profile_op.py layer_norm 16384 768
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from fusedtrain import eager, ops

name, M, C = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.zeros(C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
for impl in (ops, eager):
    fn = getattr(impl, name)
    for _ in range(3):
        torch.autograd.grad(fn(x, w, b).sum(), (x, w, b))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            torch.autograd.grad(fn(x, w, b).sum(), (x, w, b))
        torch.cuda.synchronize()
    print(f"== {impl.__name__}.{name} M={M} C={C}, 10 iterations")
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                      max_name_column_width=50)
    print(table)
