"""Fusing and unfusing changes no logit: every built-in family @tiny, float, wint8mix and LoRA.

Each graph is unfused completely (parallel blocks, q/k/v, gate/up), then fused completely (the
fusions O2 runs), and the logits of both forms equal the imported model's to 1e-6 relative. The
node counts say the passes did what they claim (unfused forms have more nodes, one projection
each); fusing again after a full round trip changes nothing.
"""

from __future__ import annotations

import pytest
from _fusion_testkit import FAMILIES, FUSE, UNFUSE, VARIANTS, logits, rel, tiny

from ernie_ir.passes import run_pipeline

# rewrites per @tiny model: (unfuse-parallel-block, unfuse-qkv, unfuse-gate-up)
EXPECTED = {
    "ernie-4.5-0.3b": (0, 2, 2),       # dense: fused qkv_proj and up_gate_proj in both layers
    "ernie-4.5-21b-a3b": (0, 3, 3),    # 3 layers: 1 dense MLP + 2 shared-expert MLPs
    "ernie-4.5-300b-a47b": (0, 5, 3),  # 5 layers, 3 dense MLPs (the MoE layers have no shared experts)
    "ernie-3.5-se-3b": (2, 0, 0),      # layers 1, 2 are parallel blocks; 0 and 3 are imported unfused
    "gpt-345m": (0, 2, 0),             # per-head fused qkv; GELU MLP without a gate
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_unfuse_then_fuse_keeps_the_logits(family: str, variant: str) -> None:
    graph = tiny(family, VARIANTS[variant])
    before, nodes = logits(graph), len(graph)

    unfused = run_pipeline(graph, UNFUSE)
    counts = tuple(unfused.stats.get(f"{i}:{name}", {}).get(name, 0)
                   for i, name in enumerate(UNFUSE.split(","), 1))
    assert counts == EXPECTED[family]
    assert len(graph) > nodes
    assert rel(logits(graph), before) < 1e-6

    fuse = FUSE.replace("fuse-qkv", "fuse-qkv{order=per_head}") if family == "gpt-345m" else FUSE
    fused = run_pipeline(graph, fuse)
    assert sum(sum(s.values()) for s in fused.stats.values()) == sum(counts) + (
        2 if family == "ernie-3.5-se-3b" else 0)  # SE: its attention-only and FFN-only layers fuse too
    assert rel(logits(graph), before) < 1e-6
    assert len(graph) <= nodes
    again = run_pipeline(graph, fuse)
    assert not any(again.stats.values())  # a fixed point


@pytest.mark.parametrize("variant", ["float", "wint8mix+lora"])
def test_o2_fuses_the_whole_ernie35_se_model(variant: str) -> None:
    graph = tiny("ernie-3.5-se-3b", VARIANTS[variant])
    before = logits(graph)
    run_pipeline(graph, UNFUSE)
    result = run_pipeline(graph, "O2")
    counts = {k.split(":", 1)[1]: sum(v.values()) for k, v in result.stats.items() if v}
    assert counts["fuse-parallel-block"] == 2 and counts["fuse-qkv"] == 1 and counts["fuse-gate-up"] == 1
    assert rel(logits(graph), before) < 1e-6
    linears = [n for n in graph if n.op in ("linear", "weight_only_linear")]
    # layer 0: qkv + o; layers 1, 2: qkv_gate_up + o; layer 3: up_gate + down; lm_head is its own op
    assert len(linears) == 8
