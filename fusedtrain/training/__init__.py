"""Training: the LightningModule, its callbacks, CUDA-graph capture, the optimizer choice and
checkpoint I/O, shared by scripts/train.py and the benchmarks."""
