"""Test models: helpers that make small graphs exercise every path a check is meant to cover."""

from __future__ import annotations

import numpy as np

from ernie_ir.ir import Graph


def randomize_lora_b(graph: Graph, seed: int = 0) -> int:
    """Give every `*lora_B` param deterministic random values (x 0.05); returns how many there were.

    LoRA B starts at zero, so without this an adapter adds nothing and a wrong cut, fusion or
    merge of it would go unnoticed."""
    n = 0
    for name, p in graph.params.items():
        if name.endswith("lora_B"):
            rng = np.random.default_rng(seed + n)
            p.set_data((rng.standard_normal(p.type.shape) * 0.05).astype(p.type.dtype.numpy))
            n += 1
    return n
