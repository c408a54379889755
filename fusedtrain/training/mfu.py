"""The GPU's dense bf16 peak, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

import functools

import torch

# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment, for MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


@functools.cache
def peak_flops(device: torch.device | None = None) -> tuple[str, float] | None:
    """(device name, dense bf16 peak) for a known CUDA GPU, else None."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return name, flops
    return None
