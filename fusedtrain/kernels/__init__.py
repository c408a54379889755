"""Triton kernels and their thin launchers (no autograd, no nn).

Importing this package on a machine without CUDA switches Triton to its CPU
interpreter (TRITON_INTERPRET=1), which must happen before any kernel is defined.
"""

import logging
import os

import torch

log = logging.getLogger("fusedtrain")

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    log.warning("fusedtrain: no CUDA device, running the Triton kernels on the CPU "
                "through Triton's interpreter (correct but slow)")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    from fusedtrain.kernels._interpreter import patch_bf16

    patch_bf16()
