"""The benchmarks behind scripts/bench.py: `kernels` (each fused op against its peers) and
`training` (tokens/s, MFU, memory and loss parity per model variant)."""
