"""The fused layouts are the published ones, params are lazy views, and unfuse + fuse is the identity.

ERNIE-3.5-SE (REFERENCE.md section 3): qkv_gate_up_proj [H, 3H + 2I] holds qkv interleaved per
head ([nh, 3 hd]: q_h k_h v_h), then X1 (gate), then X2 (up); o_proj [I + H, H] holds the FFN rows
first. ERNIE 4.5: qkv_proj [Q | K | V], up_gate_proj [gate | up]. GPT: per-head qkv.
"""

from __future__ import annotations

import numpy as np
import pytest
from _fusion_testkit import VARIANTS, logits, parallel_block, rel, run_block, tiny

from ernie_ir.ir import Param, f32, tensor
from ernie_ir.ir.equality import structural_diff
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.weights import ArraySource, ConcatSource, SlicedSource
from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.fusion.weight_views import SumSource


def values(graph, name):  # type: ignore[no-untyped-def]
    return np.asarray(graph.params[name].read()).astype(np.float32)


def bits(graph, name):  # type: ignore[no-untyped-def]
    return np.ascontiguousarray(graph.params[name].read()).view(np.uint8)


ROUND_TRIPS = [
    ("ernie-3.5-se-3b", "unfuse-parallel-block", "fuse-parallel-block"),
    ("ernie-4.5-21b-a3b", "unfuse-qkv,unfuse-gate-up", "fuse-qkv,fuse-gate-up"),
    ("ernie-4.5-0.3b", "unfuse-qkv,unfuse-gate-up", "fuse-qkv,fuse-gate-up"),
    ("gpt-345m", "unfuse-qkv", "fuse-qkv{order=per_head}"),
]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("family", "unfuse", "fuse"), ROUND_TRIPS)
def test_unfuse_then_fuse_reproduces_the_imported_graph(family: str, unfuse: str, fuse: str,
                                                         variant: str) -> None:
    imported = load_input(f"{family}@tiny")
    if VARIANTS[variant]:
        run_pipeline(imported, VARIANTS[variant])
    text = print_graph(imported)
    sources = {n: p.source for n, p in imported.params.items()}
    arrays = {n: bits(imported, n) for n in imported.params}
    graph = imported  # rewritten in place
    run_pipeline(graph, unfuse)
    assert print_graph(graph) != text
    run_pipeline(graph, fuse)
    fresh = load_input(f"{family}@tiny")
    if VARIANTS[variant]:
        run_pipeline(fresh, VARIANTS[variant])
    assert structural_diff(graph, fresh) is None
    assert print_graph(graph) == text  # the printed order of params too
    for name, p in graph.params.items():
        assert np.array_equal(bits(graph, name), arrays[name]), name
        if "quant_weight" not in name:  # a quantized source is rebuilt (equal, not the same object)
            assert p.source is sources[name], name  # the very source it was imported with


def test_ernie35_se_unfused_params_are_views_in_the_published_columns() -> None:
    graph = load_input("ernie-3.5-se-3b@tiny")
    cfg = graph.metadata["config"]
    h, i, nh = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    hd = h // nh
    pre = "ernie.layers.1."
    fused_w = values(graph, pre + "self_attn_mlp.qkv_gate_up_proj.weight")
    fused_b = values(graph, pre + "self_attn_mlp.qkv_gate_up_proj.bias")
    fused_o = values(graph, pre + "self_attn_mlp.o_proj.weight")
    base = graph.params[pre + "self_attn_mlp.qkv_gate_up_proj.weight"].source
    run_pipeline(graph, "unfuse-parallel-block")
    per_head = fused_w[:, :3 * h].reshape(h, nh, 3, hd)
    for j, name in enumerate("qkv"):
        np.testing.assert_array_equal(values(graph, f"{pre}self_attn.{name}_proj.weight"),
                                      per_head[:, :, j, :].reshape(h, h))
        np.testing.assert_array_equal(values(graph, f"{pre}self_attn.{name}_proj.bias"),
                                      fused_b[:3 * h].reshape(nh, 3, hd)[:, j, :].reshape(h))
    np.testing.assert_array_equal(values(graph, pre + "mlp.gate_proj.weight"), fused_w[:, 3 * h:3 * h + i])
    np.testing.assert_array_equal(values(graph, pre + "mlp.up_proj.weight"), fused_w[:, 3 * h + i:])
    np.testing.assert_array_equal(values(graph, pre + "mlp.down_proj.weight"), fused_o[:i])  # FFN rows first
    np.testing.assert_array_equal(values(graph, pre + "self_attn.o_proj.weight"), fused_o[i:])
    # the fused bias of o_proj is added once: it stays one param, on o_proj
    o = next(n for n in graph if n.scope == pre + "self_attn.o_proj")
    assert o.inputs[2] is graph.params[pre + "self_attn_mlp.o_proj.bias"]
    # views, not copies: q is nh slices of the fused tensor, gate one slice
    q = graph.params[pre + "self_attn.q_proj.weight"].source
    assert isinstance(q, ConcatSource) and len(q.parts) == nh
    assert all(isinstance(s, SlicedSource) and s.base is base for s in q.parts)
    gate = graph.params[pre + "mlp.gate_proj.weight"].source
    assert isinstance(gate, SlicedSource) and gate.base is base
    assert (gate.start, gate.stop) == (3 * h, 3 * h + i)


def test_a_graphbuilder_block_fuses_into_the_ernie35_se_layout() -> None:
    graph = parallel_block(hidden=32, heads=4, inter=48)
    w = {n: np.asarray(p.read()) for n, p in graph.params.items()}
    before = run_block(graph)
    run_pipeline(graph, "fuse-parallel-block")
    assert [n.op for n in graph] == ["layer_norm", "linear", "split", "reshape", "split", "rope", "rope",
                                     "attention", "reshape", "silu", "mul", "concat", "linear", "add"]
    fused = values(graph, "block.self_attn_mlp.qkv_gate_up_proj.weight")
    heads = [w[f"block.self_attn.{p}_proj.weight"].reshape(32, 4, 8) for p in "qkv"]
    want = np.concatenate([np.stack(heads, axis=2).reshape(32, 96), w["block.mlp.gate_proj.weight"],
                           w["block.mlp.up_proj.weight"]], axis=1)
    np.testing.assert_array_equal(fused, want)
    rows = np.concatenate([w["block.mlp.down_proj.weight"], w["block.self_attn.o_proj.weight"]])
    np.testing.assert_array_equal(values(graph, "block.self_attn_mlp.o_proj.weight"), rows)  # FFN first
    assert isinstance(graph.params["block.self_attn_mlp.o_proj.weight"].source, ConcatSource)
    assert rel(run_block(graph), before) < 1e-6
    # and back: the parts' values are those the block was built with
    run_pipeline(graph, "unfuse-parallel-block")
    for name, array in w.items():
        np.testing.assert_array_equal(np.asarray(graph.params[name].read()), array)
    assert rel(run_block(graph), before) < 1e-6


def test_a_residual_chain_and_two_biases_fold_exactly() -> None:
    # (x + o) + down with biases on both: the fused bias is their sum in f32 (a lazy SumSource)
    graph = parallel_block(residual_chain=True)
    bd = np.random.default_rng(5).standard_normal(32).astype(np.float32)
    bo = values(graph, "block.self_attn.o_proj.bias")
    down = next(n for n in graph if n.scope == "block.mlp.down_proj")
    down.set_input(2, graph.add_param(Param("block.mlp.down_proj.bias", tensor(f32, 32), ArraySource(bd))))
    before = run_block(graph)
    run_pipeline(graph, "fuse-parallel-block")
    np.testing.assert_array_equal(values(graph, "block.self_attn_mlp.o_proj.bias"), bd + bo)
    assert isinstance(graph.params["block.self_attn_mlp.o_proj.bias"].source, SumSource)
    assert rel(run_block(graph), before) < 1e-6
    assert [n.op for n in graph][-3:] == ["concat", "linear", "add"]


def test_plain_and_per_head_qkv_orders() -> None:
    graph = parallel_block(hidden=32, heads=4)
    w = {p: np.asarray(graph.params[f"block.self_attn.{p}_proj.weight"].read()) for p in "qkv"}
    before = run_block(graph)
    run_pipeline(graph, "fuse-qkv")
    np.testing.assert_array_equal(values(graph, "block.self_attn.qkv_proj.weight"),
                                  np.concatenate([w["q"], w["k"], w["v"]], axis=1))  # [Q | K | V]
    assert rel(run_block(graph), before) < 1e-6
    run_pipeline(graph, "unfuse-qkv,fuse-qkv{order=per_head}")
    want = np.stack([w[p].reshape(32, 4, 8) for p in "qkv"], axis=2).reshape(32, 96)
    np.testing.assert_array_equal(values(graph, "block.self_attn.qkv_proj.weight"), want)  # [q_h k_h v_h]
    assert rel(run_block(graph), before) < 1e-6


def test_per_head_qkv_round_trip_restores_separate_projections() -> None:
    graph = tiny("ernie-3.5-se-3b")  # layer 0 has separate q/k/v_proj
    run_pipeline(graph, "fuse-qkv{order=per_head}")
    assert graph.params["ernie.layers.0.self_attn.qkv_proj.weight"].type.shape == (64, 192)
    run_pipeline(graph, "unfuse-qkv")
    # each part rebuilt whole (linear, then its reshape into heads), as the frontend writes it;
    # the unfused params are listed by role (biases, then weights), which equality ignores
    assert structural_diff(graph, tiny("ernie-3.5-se-3b")) is None


def test_gate_up_order_and_names() -> None:
    graph = tiny("ernie-3.5-se-3b")
    pre = "ernie.layers.3.mlp."
    g, u = values(graph, pre + "gate_proj.weight"), values(graph, pre + "up_proj.weight")
    before = logits(graph)
    run_pipeline(graph, "fuse-gate-up")
    np.testing.assert_array_equal(values(graph, pre + "up_gate_proj.weight"), np.concatenate([g, u], axis=1))
    assert rel(logits(graph), before) < 1e-6
    run_pipeline(graph, "unfuse-gate-up")
    np.testing.assert_array_equal(values(graph, pre + "gate_proj.weight"), g)


def test_meta_graphs_fuse_and_unfuse_without_data() -> None:
    graph = load_input("ernie-3.5-se-3b@meta")
    text = print_graph(graph)
    run_pipeline(graph, "unfuse-parallel-block")
    assert not any(p.has_data for p in graph.params.values())
    run_pipeline(graph, "fuse-parallel-block")
    assert print_graph(graph) == text
