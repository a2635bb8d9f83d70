"""Fusion composes with the tensor-parallel split: fuse before or after `split`, same rank graphs.

`split(fuse(G))` and `fuse(split(G))` (G unfused, tp 2) are structurally equal rank by rank, with
bit-identical params: the fused rank params carry the global name and the `shard` annotation that
`split` gives the fused global weight (ERNIE-3.5-SE: rank r holds [QKV_r | X1_r | X2_r] columns and
[FFN_r ; ATT_r] rows, REFERENCE.md section 3). A fused parallel block keeps one all_reduce per layer,
and the rank graphs run (SPMD) to the unsplit logits.
"""

from __future__ import annotations

import numpy as np
import pytest
from _fusion_testkit import IDS, VARIANTS, logits, rel, tiny

from ernie_ir.ir.equality import structural_diff
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.parallel.split import SHARD, mapping_for, split_graph
from ernie_ir.runtime.spmd import run_spmd

CASES = [
    ("ernie-3.5-se-3b", "unfuse-parallel-block", "fuse-parallel-block"),
    ("ernie-3.5-se-3b", "unfuse-parallel-block,unfuse-qkv,unfuse-gate-up", "O2"),
    ("ernie-4.5-0.3b", "unfuse-qkv,unfuse-gate-up", "fuse-qkv,fuse-gate-up"),  # KV heads replicated
    ("ernie-4.5-21b-a3b", "unfuse-qkv,unfuse-gate-up", "fuse-qkv,fuse-gate-up"),
    ("gpt-345m", "unfuse-qkv", "fuse-qkv{order=per_head}"),
]


def split2(graph):  # type: ignore[no-untyped-def]
    return split_graph(graph, mapping_for(graph, 2))


def per_layer(graph, op: str) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Collectives per layer, by the layer that computed what they reduce (the embedding's
    all_reduce sits at the first layer's norm, which reads it)."""
    out: dict[str, int] = {}
    for n in graph:
        source = n.inputs[0].producer.scope if n.inputs and n.inputs[0].producer else ""
        if n.op == op and ".layers." in source:
            layer = source.split(".layers.")[1].split(".")[0]
            out[layer] = out.get(layer, 0) + 1
    return out


@pytest.mark.parametrize("variant", ["float", "wint8mix", "lora"])
@pytest.mark.parametrize(("family", "unfuse", "fuse"), CASES)
def test_fusing_before_or_after_split_gives_the_same_rank_graphs(family: str, unfuse: str, fuse: str,
                                                                 variant: str) -> None:
    unfused, fused = tiny(family, VARIANTS[variant]), tiny(family, VARIANTS[variant])  # LoRA B random
    run_pipeline(unfused, unfuse)
    run_pipeline(fused, unfuse + "," + fuse)
    before = split2(fused)
    after = split2(unfused)
    for rank in after:
        run_pipeline(rank, fuse)
    for r, (a, b) in enumerate(zip(before, after, strict=True)):
        assert structural_diff(a, b) is None, f"rank {r}: {structural_diff(a, b)}"
        for name, p in a.params.items():
            x, y = np.asarray(p.read()), np.asarray(b.params[name].read())
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"rank {r}: @{name}"
    assert per_layer(after[0], "all_reduce") == per_layer(split2(unfused)[0], "all_reduce")


def test_a_fused_parallel_block_keeps_one_all_reduce_per_layer_and_runs() -> None:
    graph = tiny("ernie-3.5-se-3b", "lora{rank=4}")  # imported fused; adapters cut with their base
    ranks = split2(graph)
    assert per_layer(ranks[0], "all_reduce") == {"0": 1, "1": 1, "2": 1, "3": 1}
    pre = "ernie.layers.1.self_attn_mlp."
    cfg = graph.metadata["config"]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    w = ranks[1].params[pre + "qkv_gate_up_proj.weight"]
    qkv, x1, x2 = [3 * h // 2, 3 * h], [3 * h + i // 2, 3 * h + i], [3 * h + i + i // 2, 3 * h + 2 * i]
    assert w.annotations[SHARD]["cuts"] == [{"axis": 1, "ranges": [qkv, x1, x2]}]  # [QKV_1 | X1_1 | X2_1]
    o = ranks[1].params[pre + "o_proj.weight"]
    assert o.annotations[SHARD]["cuts"] == [{"axis": 0, "ranges": [[i // 2, i], [i + h // 2, i + h]]}]
    outs = run_spmd(ranks, {"input_ids": IDS})
    assert rel(outs[0]["logits"], logits(graph)) < 1e-6
    # the same model unfused, split, then fused per rank: the same logits
    unfused = tiny("ernie-3.5-se-3b", "lora{rank=4}")
    run_pipeline(unfused, "unfuse-parallel-block")
    ranks = split2(unfused)
    for rank in ranks:
        assert run_pipeline(rank, "fuse-parallel-block").stats["1:fuse-parallel-block"] == {
            "fuse-parallel-block": 2}
    assert rel(run_spmd(ranks, {"input_ids": IDS})[0]["logits"], logits(graph)) < 1e-6


def test_unfusing_a_rank_graph_is_refused() -> None:
    ranks = split2(tiny("ernie-3.5-se-3b"))
    from ernie_ir.passes import all_passes
    from ernie_ir.passes.infra.rewrite import RuleSet, find_rule

    (trace,) = RuleSet([find_rule("unfuse-parallel-block", all_passes())]).explain(ranks[0])
    assert trace.matches == 0 and "unfuse before split" in trace.summary()
    result = run_pipeline(tiny("ernie-3.5-se-3b"), "split{tp=2},unfuse-parallel-block")
    assert any("unfuse before split" in w for w in result.warnings)


@pytest.mark.parametrize("fuse", ["fuse-qkv{order=per_head},fuse-gate-up", "fuse-parallel-block"])
def test_per_projection_adapters_split_and_run(fuse: str) -> None:
    # ERNIE-3.5-SE's layer 0 q/k/v and layer 3 gate/up have adapters of their own
    graph = tiny("ernie-3.5-se-3b", "lora{rank=4}")
    reference = logits(graph)
    run_pipeline(graph, "unfuse-parallel-block," + fuse)
    ranks = split2(graph)
    assert rel(run_spmd(ranks, {"input_ids": IDS})[0]["logits"], reference) < 1e-6
