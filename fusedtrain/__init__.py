"""fusedtrain: GPT training with fused Triton kernels and eager PyTorch twins."""

__version__ = "0.1.0"
