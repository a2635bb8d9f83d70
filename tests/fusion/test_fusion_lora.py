"""Fusion composes with LoRA: an adapter stays with the projection it was trained for.

Decision (docs/fusion.md): per projection, never block-diagonal. A fused adapter (one A over the
fused input, B over the fused columns) unfuses into per-part adapters that share that A (rows: that
B), and parts sharing one A fuse back into it; parts with adapters of their own keep them, applied to
their columns of the fused output (rows: to their own input). Both are exact and keep every adapter
param as it was, so training and exported adapters are unaffected.
"""

from __future__ import annotations

import numpy as np
from _fusion_testkit import logits, parallel_block, randomize_lora_b, rel, run_block, tiny

from ernie_ir.ir.printer import print_graph
from ernie_ir.passes import run_pipeline

ALL_PROJECTIONS = 'lora{rank=2,targets=[".*_proj"]}'


def loras(graph):  # type: ignore[no-untyped-def]
    return [n for n in graph if n.op == "lora"]


def test_a_fused_adapter_unfuses_into_adapters_sharing_its_a() -> None:
    graph = tiny("ernie-4.5-0.3b", "lora{rank=4}")
    pre = "ernie.layers.0.self_attn."
    a = graph.params[pre + "qkv_proj.lora_A"]
    b = np.asarray(graph.params[pre + "qkv_proj.lora_B"].read())
    before = logits(graph)
    run_pipeline(graph, "unfuse-qkv")
    qkv = [n for n in loras(graph) if n.scope.startswith(pre) and n.scope != pre + "o_proj"]
    assert [n.scope for n in qkv] == [pre + "q_proj", pre + "k_proj", pre + "v_proj"]
    assert all(n.inputs[2] is a for n in qkv)  # one A, trained once, read by the three parts
    widths = [n.outputs[0].type.shape[-1] for n in qkv]
    cols = np.split(b, np.cumsum(widths)[:-1], axis=1)
    for n, part in zip(qkv, cols, strict=True):
        np.testing.assert_array_equal(np.asarray(n.inputs[3].read()), part)  # [Q | K | V] columns of B
    assert rel(logits(graph), before) < 1e-6
    run_pipeline(graph, "fuse-qkv")
    assert graph.params[pre + "qkv_proj.lora_A"] is a
    np.testing.assert_array_equal(np.asarray(graph.params[pre + "qkv_proj.lora_B"].read()), b)


def test_own_adapters_stay_per_projection_when_fused() -> None:
    # ERNIE-3.5-SE's attention-only layer 0 has q/k/v_proj with an adapter each
    graph = tiny("ernie-3.5-se-3b", "lora{rank=4}")
    text = print_graph(graph)
    pre = "ernie.layers.0.self_attn."
    adapters = {p: (graph.params[f"{pre}{p}_proj.lora_A"], graph.params[f"{pre}{p}_proj.lora_B"])
                for p in "qkv"}
    before = logits(graph)
    run_pipeline(graph, "fuse-qkv")
    fused = [n for n in graph if n.scope == pre + "qkv_proj"]
    assert [n.op for n in fused] == ["linear"]  # no adapter on the fused layer itself
    for p, (a, b) in adapters.items():
        (node,) = [n for n in loras(graph) if n.scope == f"{pre}{p}_proj"]
        assert node.inputs[2] is a and node.inputs[3] is b  # the same params, same names
        assert node.inputs[0].producer.op == "split"  # on its columns of the fused output
        assert a.type.shape[1] == 4  # rank unchanged: no block-diagonal re-factoring
    assert rel(logits(graph), before) < 1e-6
    run_pipeline(graph, "unfuse-qkv")
    assert rel(logits(graph), before) < 1e-6
    assert print_graph(graph) != text  # the same layers, listed in another order
    # per head, each adapter reads its heads' columns through a reshape
    graph = tiny("ernie-3.5-se-3b", "lora{rank=4}")
    run_pipeline(graph, "fuse-qkv{order=per_head}")
    (q,) = [n for n in graph if n.scope == pre + "q_proj"]
    assert q.op == "lora" and q.inputs[0].producer.op == "reshape"
    assert rel(logits(graph), before) < 1e-6
    run_pipeline(graph, "unfuse-qkv")
    unfused = print_graph(graph)
    run_pipeline(graph, "fuse-qkv{order=per_head},unfuse-qkv")
    assert print_graph(graph) == unfused and rel(logits(graph), before) < 1e-6


def test_a_parallel_block_with_an_adapter_per_projection() -> None:
    graph = parallel_block()
    run_pipeline(graph, ALL_PROJECTIONS)
    assert randomize_lora_b(graph) == 7
    params = dict(graph.params)
    before = run_block(graph)
    run_pipeline(graph, "fuse-parallel-block")
    assert len(loras(graph)) == 7
    linears = [n for n in graph if n.op == "linear"]
    assert [n.scope for n in linears] == ["block.self_attn_mlp.qkv_gate_up_proj",
                                          "block.self_attn_mlp.o_proj"]
    # the output-side adapters read their own inputs, chained after the fused o_proj
    out = loras(graph)[-2:]
    assert [n.scope for n in out] == ["block.mlp.down_proj", "block.self_attn.o_proj"]
    assert out[0].inputs[1].producer.op == "mul" and out[1].inputs[1].producer.op == "reshape"
    assert rel(run_block(graph), before) < 1e-6
    run_pipeline(graph, "unfuse-parallel-block")
    assert rel(run_block(graph), before) < 1e-6
    assert set(graph.params) == set(params)
    for name in params:
        if "lora" in name:
            assert graph.params[name] is params[name]  # the adapters themselves, untouched
        else:
            np.testing.assert_array_equal(np.asarray(graph.params[name].read()), params[name].read())
    text = print_graph(graph)
    run_pipeline(graph, "fuse-parallel-block,unfuse-parallel-block")
    assert print_graph(graph) == text  # the unfused form is a fixed point of the round trip


def test_the_imported_se_adapters_merge_back() -> None:
    graph = tiny("ernie-3.5-se-3b", "lora{rank=4}")
    pre = "ernie.layers.1.self_attn_mlp."
    a_in, b_out = graph.params[pre + "qkv_gate_up_proj.lora_A"], graph.params[pre + "o_proj.lora_B"]
    before = logits(graph)
    run_pipeline(graph, "unfuse-parallel-block")
    ins = [n for n in loras(graph) if n.inputs[2] is a_in]
    outs = [n for n in loras(graph) if n.inputs[3] is b_out]
    assert len(ins) == 5 and len(outs) == 2  # q, k, v, gate, up share A; down, o share B
    assert rel(logits(graph), before) < 1e-6
    run_pipeline(graph, "fuse-parallel-block")
    assert len([n for n in loras(graph) if n.scope.startswith("ernie.layers.1.")]) == 2
    assert rel(logits(graph), before) < 1e-6
