"""Tensor and expert parallelism: `split`, the global graph into per-rank graphs."""
