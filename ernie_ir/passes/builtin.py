"""Imports every built-in pass module (each registers itself) and the generic presets."""

from __future__ import annotations

from . import canonicalize, cse, dce, fuse_linear_bias, fuse_projections, parallel_block  # noqa: F401
from .registry import REGISTRY

if "O1" not in REGISTRY.presets:
    REGISTRY.add_preset("O1", "canonicalize,cse,dce", "Generic cleanup: canonicalize, CSE, DCE.")
if "O2" not in REGISTRY.presets:
    REGISTRY.add_preset("O2", "O1,fuse-linear-bias,fuse-parallel-block,fuse-qkv,fuse-gate-up,dce",
                        "O1, then fuse: biases, parallel attention+FFN blocks, q/k/v, gate/up.")
from . import (  # noqa: F401
    fp8,
    lora,
    lora_import,
    lora_merge,
    qat,
    quant_annotate,
    quant_presets,
    split,
    weight_only,
)
