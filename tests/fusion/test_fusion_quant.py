"""Fusion composes with quantization: scales that concatenate fuse exactly; the rest is refused.

Weight-only scales are per output column (and per group of rows), so quantizing parts and fusing
them gives bit for bit the fused layer quantized: fusion and quantization commute. Row fusion
(ERNIE-3.5-SE's o_proj) needs one scale per output column over all rows: group-wise scales stack,
separately computed per-channel scales do not. Fake-quant weights fuse by columns when their scales
are per output channel. Every refusal has a reason the tracer shows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _fusion_testkit import logits, parallel_block, rel, rewrites, run_block, tiny

from ernie_ir.passes import all_passes, run_pipeline
from ernie_ir.passes.infra.rewrite import RuleSet, find_rule


def quant(tmp_path: Path, *rules: str) -> str:
    """A quant-annotate + convert pipeline for YAML rules (one flow mapping each)."""
    path = tmp_path / f"q{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text("rules:\n" + "".join(f"  - {r}\n" for r in rules), encoding="utf-8")
    return f"quant-annotate{{config={path}}},weight-only-quant"


def explain(rule: str, graph) -> str:  # type: ignore[no-untyped-def]
    (trace,) = RuleSet([find_rule(rule, all_passes())]).explain(graph)
    assert trace.matches == 0, trace.summary()
    return trace.summary()


def bits(graph, name):  # type: ignore[no-untyped-def]
    return np.ascontiguousarray(graph.params[name].read()).view(np.uint8)


SPECS = [("weight_only_int8", -1), ("weight_only_int8", 64), ("weight_only_int4", 128)]


@pytest.mark.parametrize(("algo", "group"), SPECS)
def test_column_fusion_commutes_with_weight_only_quantization(tmp_path: Path, algo: str, group: int) -> None:
    q = quant(tmp_path, f"{{match: '.*', algo: {algo}, group_size: {group}}}")
    quantized_then_fused = parallel_block(hidden=128, heads=4, inter=128)
    run_pipeline(quantized_then_fused, q)
    before = run_block(quantized_then_fused)
    run_pipeline(quantized_then_fused, "fuse-qkv,fuse-gate-up")
    fused_then_quantized = parallel_block(hidden=128, heads=4, inter=128)
    run_pipeline(fused_then_quantized, "fuse-qkv,fuse-gate-up," + q)
    for module in ("block.self_attn.qkv_proj", "block.mlp.up_gate_proj"):
        for suffix in ("quant_weight", "weight_scale", "bias"):
            name = f"{module}.{suffix}"
            np.testing.assert_array_equal(bits(quantized_then_fused, name), bits(fused_then_quantized, name))
    out = run_block(quantized_then_fused)
    np.testing.assert_array_equal(out, run_block(fused_then_quantized))
    assert rel(out, before) < 1e-6
    run_pipeline(quantized_then_fused, "unfuse-qkv,unfuse-gate-up")
    assert rel(run_block(quantized_then_fused), before) < 1e-6


def test_grouped_scales_let_a_quantized_parallel_block_fuse(tmp_path: Path) -> None:
    q = quant(tmp_path, "{match: '.*', algo: weight_only_int8, group_size: 64}")
    graph = parallel_block(hidden=128, heads=4, inter=128)
    run_pipeline(graph, q)
    before = run_block(graph)
    run_pipeline(graph, "fuse-parallel-block")
    reference = parallel_block(hidden=128, heads=4, inter=128)
    run_pipeline(reference, "fuse-parallel-block," + q)
    for name in ("block.self_attn_mlp.o_proj.quant_weight", "block.self_attn_mlp.o_proj.weight_scale",
                 "block.self_attn_mlp.qkv_gate_up_proj.weight_scale"):
        np.testing.assert_array_equal(bits(graph, name), bits(reference, name))
    assert rel(run_block(graph), before) < 1e-6


def test_separately_quantized_output_projections_do_not_fuse_by_rows() -> None:
    graph = tiny("ernie-3.5-se-3b", "unfuse-parallel-block,quant-annotate{preset=wint8},weight-only-quant")
    why = explain("fuse-parallel-block", graph)
    assert "own per-output-channel scales" in why and "fuse before quantizing" in why
    # q/k/v and gate/up still fuse by columns
    before = tiny("ernie-3.5-se-3b", "unfuse-parallel-block,quant-annotate{preset=wint8},weight-only-quant")
    result = run_pipeline(graph, "O2")
    assert rewrites(result, "fuse-parallel-block") == 0
    assert rewrites(result, "fuse-qkv") == 3 and rewrites(result, "fuse-gate-up") == 3
    assert rel(logits(graph), logits(before)) < 1e-6


def test_quantized_imported_se_model_unfuses_with_one_shared_row_scale() -> None:
    graph = tiny("ernie-3.5-se-3b", "quant-annotate{preset=wint8mix},weight-only-quant")
    scale = graph.params["ernie.layers.1.self_attn_mlp.o_proj.weight_scale"]
    run_pipeline(graph, "unfuse-parallel-block")
    readers = [n for n in graph if n.op == "weight_only_linear" and n.inputs[2] is scale]
    assert sorted(n.scope for n in readers) == ["ernie.layers.1.mlp.down_proj",
                                                "ernie.layers.1.self_attn.o_proj"]


def test_mismatched_quantization_is_refused_with_the_reason(tmp_path: Path) -> None:
    mixed = quant(tmp_path, "{match: '.*', algo: weight_only_int8}",
                  "{match: '.*k_proj', algo: weight_only_int4}")
    graph = parallel_block(hidden=128, heads=4, inter=128)
    run_pipeline(graph, mixed)
    assert "mismatched weights" in explain("fuse-qkv", graph)
    groups = quant(tmp_path, "{match: '.*', algo: weight_only_int8, group_size: 64}",
                   "{match: '.*up_proj', algo: weight_only_int8, group_size: 128}")
    graph = parallel_block(hidden=128, heads=4, inter=128)
    run_pipeline(graph, groups)
    assert "group sizes" in explain("fuse-gate-up", graph)
    half = quant(tmp_path, "{match: '.*v_proj', algo: weight_only_int8}")
    graph = parallel_block(hidden=128, heads=4, inter=128)
    run_pipeline(graph, half)
    assert "mismatched quantization" in explain("fuse-qkv", graph)
    nothing = run_pipeline(graph, "fuse-qkv")
    assert rewrites(nothing, "fuse-qkv") == 0  # refused means untouched


def qat(tmp_path: Path, weights: str, activations: str) -> str:
    path = tmp_path / f"qat-{weights}-{activations}.yaml"
    path.write_text(f"rules:\n  - {{match: '.*', algo: qat, weight_quantize_type: {weights}, "
                    f"activation_quantize_type: {activations}}}\n", encoding="utf-8")
    return f"quant-annotate{{config={path}}},qat-insert"


def test_fake_quant_fuses_per_output_channel_only(tmp_path: Path) -> None:
    graph = parallel_block()
    run_pipeline(graph, qat(tmp_path, "channel_wise_abs_max", "none"))
    before = run_block(graph)
    result = run_pipeline(graph, "fuse-qkv,fuse-gate-up")
    assert rewrites(result, "fuse-qkv") == 1 and rewrites(result, "fuse-gate-up") == 1
    fq = [n for n in graph if n.op == "fake_quant"]
    assert len(fq) == 4 and all(tuple(n.attrs.axes) == (1,) for n in fq)  # qkv, gate_up, o, down
    assert rel(run_block(graph), before) < 1e-6
    assert "fake-quant weight scales run over all input rows" in explain("fuse-parallel-block",
                                                                          _unfused(graph))
    graph = parallel_block()
    run_pipeline(graph, qat(tmp_path, "abs_max", "none"))
    assert "per-tensor" in explain("fuse-qkv", graph)
    graph = parallel_block()
    run_pipeline(graph, qat(tmp_path, "channel_wise_abs_max", "moving_average_abs_max"))
    assert "fuse before qat-insert" in explain("fuse-qkv", graph)


def _unfused(graph):  # type: ignore[no-untyped-def]
    run_pipeline(graph, "unfuse-qkv,unfuse-gate-up")
    return graph


def test_fp8_linears_are_refused() -> None:
    graph = tiny("gpt-345m", "unfuse-qkv,fp8")
    assert "tensor-wise weight scale" in explain("fuse-qkv", graph)
    graph = tiny("gpt-345m", "fp8")
    assert "tensor-wise weight scale" in explain("unfuse-qkv", graph)


def test_the_fused_layer_goes_after_its_input_even_when_weights_are_fake_quantized_early() -> None:
    from ernie_ir.ir import GraphBuilder, f32, tensor
    from ernie_ir.ir.weights import ArraySource

    rng = np.random.default_rng(0)
    b = GraphBuilder("early")
    x = b.input("x", tensor(f32, "B", 8))
    # the weights' fake_quant nodes come first, before the value the linears read
    weights = [ArraySource(rng.standard_normal((8, 8)).astype(np.float32)) for _ in range(2)]
    wq = [b.fake_quant(b.param(f"{p}.weight", source=w), axes=(1,))
          for p, w in zip(("gate", "up"), weights, strict=True)]
    n = b.silu(x)
    with b.at_scope("gate"):
        g = b.linear(n, wq[0])
    with b.at_scope("up"):
        u = b.linear(n, wq[1])
    b.output(b.mul(b.silu(g), u), name="y")
    graph = b.graph
    feed = {"x": rng.standard_normal((3, 8)).astype(np.float32)}
    from ernie_ir.runtime import run_graph

    before = run_graph(graph, feed)["y"]
    assert rewrites(run_pipeline(graph, "fuse-gate-up"), "fuse-gate-up") == 1  # verified after the pass
    assert rel(run_graph(graph, feed)["y"], before) < 1e-6
    assert rewrites(run_pipeline(graph, "unfuse-gate-up"), "unfuse-gate-up") == 1
    assert rel(run_graph(graph, feed)["y"], before) < 1e-6
