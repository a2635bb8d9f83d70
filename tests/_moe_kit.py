"""The sparse-MoE test cases shared by the ONNX and the Paddle executables' tests.

`moe_graph(pipeline, **config_overrides)`: the tiny ERNIE 4.5 MoE with generated weights,
through `pipeline`, every LoRA B matrix random (so the adapters change the result); `CASES`
names the expert kinds checked (float, wint8, wint4, sm70-packed, LoRA); `EXPERTS64` is the
64-expert top-6 variant whose widths let sm80 pack the expert stacks, as for a real model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_ir.frontends.builtins import builtin_config
from ernie_ir.frontends.config import parse_config
from ernie_ir.frontends.loader import GeneratedWeights, build_graph
from ernie_ir.ir import Graph
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.infra.base import graph_properties
from ernie_ir.passes.infra.pipeline import load_pipeline
from ernie_ir.testing.models import randomize_lora_b

MOE = "ernie-4.5-21b-a3b"
IDS = np.array([[1, 2, 3, 400, 5, 77], [9, 8, 7, 6, 5, 4]], dtype=np.int64)
EXPERTS64 = {"moe_num_experts": 64, "hidden_size": 128, "moe_intermediate_size": 64, "head_dim": 8}
CASES = {
    "float": "",
    "wint8": "wint8,legalize-cuda{cuda_arch=80}",
    "wint4": "wint4,legalize-cuda{cuda_arch=80}",
    "wint8mix-sm70-packed": "wint8mix,legalize-cuda{cuda_arch=70}",
    "lora": "lora{rank=4}",
    "wint8mix-lora": "wint8mix,lora{rank=4}",
}


def moe_graph(pipeline: str, **overrides: Any) -> Graph:
    cfg = {**builtin_config(MOE, "tiny"), **overrides}
    g = build_graph(parse_config(cfg, f"{MOE}@tiny+{overrides}"), GeneratedWeights(0), name=MOE)
    if pipeline:
        run_pipeline(g, load_pipeline(pipeline, initial=graph_properties(g)))
    randomize_lora_b(g, seed=3)
    return g
