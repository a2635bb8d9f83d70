"""Fusion passes and what they share.

Passes:
- `linear_bias`: `fuse-linear-bias`.
- `qkv_gate_up`: `fuse-qkv` / `unfuse-qkv`, `fuse-gate-up` / `unfuse-gate-up`.
- `parallel_block`: `fuse-parallel-block` / `unfuse-parallel-block` (ERNIE-3.5-SE).

Shared by them:
- `projection`: one linear-like layer as the graph holds it (quantization, adapter).
- `column_row_fusion`: fusing projections by columns or rows, and the inverses.
- `weight_views`: lazy slices and concatenations of weights.
"""
