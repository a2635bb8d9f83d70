"""The generic passes (dce, cse, canonicalize, fuse-linear-bias): Before -> Expected, and
bit-identical results in the reference interpreter on graphs with real weights."""

from __future__ import annotations

import numpy as np
import pytest
from _passes_testkit import assert_ir, ir, random_inputs, with_weights

from ernie_ir.ir import GraphBuilder, f32, tensor
from ernie_ir.ir.weights import ArraySource, GeneratedSource
from ernie_ir.passes import run_pipeline
from ernie_ir.runtime import run_graph


def test_dce_removes_dead_nodes_transitively_and_the_params_only_they_read():
    g = ir("""
    graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {
      param @w : f32[4,4]
      param @dead.w : f32[4,8]
      %0 = linear(%x, @dead.w) : f32[B,8] loc("dead")
      %1 = silu(%0) : f32[B,8] loc("dead")
      %2 = linear(%x, @w) : f32[B,4]
      return %2
    }""")
    result = run_pipeline(g, "dce")
    assert_ir(g, """
    graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {
      param @w : f32[4,4]
      %0 = linear(%x, @w) : f32[B,4]
      return %0
    }""")
    assert result.stats == {"1:dce": {"erased": 3}}  # two nodes and one param


def test_dce_keeps_every_graph_output_and_reports_no_change_when_nothing_is_dead():
    g = ir("""
    graph @g(%x: f32[4]) -> (y: f32[4], z: f32[4]) {
      %0 = silu(%x) : f32[4]
      %1 = gelu(%0) : f32[4]
      return %1, %0
    }""")
    result = run_pipeline(g, "dce")
    assert not result.changed and result.stats == {}
    assert len(g) == 2


def test_cse_merges_repeated_computations_and_keeps_the_first_scope():
    g = ir("""
    graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {
      param @w : f32[4,4]
      %0 = linear(%x, @w) : f32[B,4] loc("first")
      %1 = linear(%x, @w) : f32[B,4] loc("second")
      %2 = silu(%0) : f32[B,4]
      %3 = silu(%1) : f32[B,4]
      %4 = reshape(%2) {shape = [0, 2, 2]} : f32[B,2,2]
      %5 = reshape(%3) {shape = [0, 4, 1]} : f32[B,4,1]
      %6 = reshape(%5) {shape = [0, 2, 2]} : f32[B,2,2]
      %7 = add(%4, %6) : f32[B,2,2]
      %8 = reshape(%7) {shape = [0, 4]} : f32[B,4]
      return %8
    }""")
    result = run_pipeline(g, "cse")
    # linear and silu merge; the reshapes differ in attrs or inputs and stay.
    assert_ir(g, """
    graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {
      param @w : f32[4,4]
      %0 = linear(%x, @w) : f32[B,4] loc("first")
      %1 = silu(%0) : f32[B,4]
      %2 = reshape(%1) {shape = [0, 2, 2]} : f32[B,2,2]
      %3 = reshape(%1) {shape = [0, 4, 1]} : f32[B,4,1]
      %4 = reshape(%3) {shape = [0, 2, 2]} : f32[B,2,2]
      %5 = add(%2, %4) : f32[B,2,2]
      %6 = reshape(%5) {shape = [0, 4]} : f32[B,4]
      return %6
    }""")
    assert result.stats == {"1:cse": {"merged": 2}}


def test_cse_merges_two_graph_outputs_and_both_keep_their_names():
    g = ir("""
    graph @g(%x: f32[4]) -> (y: f32[4], z: f32[4]) {
      %0 = silu(%x) : f32[4]
      %1 = silu(%x) : f32[4]
      return %0, %1
    }""")
    assert run_pipeline(g, "cse").changed
    assert_ir(g, """
    graph @g(%x: f32[4]) -> (y: f32[4], z: f32[4]) {
      %0 = silu(%x) : f32[4]
      return %0, %0
    }""")
    assert g.output_names == ["y", "z"]


def test_cse_lets_a_merged_output_keep_its_name():
    g = ir("""
    graph @g(%x: f32[4]) -> (y: f32[4]) {
      %0 = silu(%x) : f32[4]
      %1 = silu(%x) : f32[4]
      %2 = gelu(%0) : f32[4]
      %3 = add(%2, %1) : f32[4]
      return %1
    }""")
    run_pipeline(g, "cse,dce")
    assert_ir(g, """
    graph @g(%x: f32[4]) -> (y: f32[4]) {
      %0 = silu(%x) : f32[4]
      return %0
    }""")


def test_the_o1_preset_cleans_up_a_graph():
    g = ir("""
    graph @g(%x: f32[B,8]) -> (y: f32[B,8]) {
      param @w : f32[8,8]
      %0 = reshape(%x) {shape = [0, 2, 4]} : f32[B,2,4]
      %1 = reshape(%0) {shape = [0, 8]} : f32[B,8]
      %2 = linear(%1, @w) : f32[B,8]
      %3 = linear(%x, @w) : f32[B,8]
      %4 = add(%2, %3) : f32[B,8]
      return %4
    }""")
    result = run_pipeline(g, "O1")
    assert_ir(g, """
    graph @g(%x: f32[B,8]) -> (y: f32[B,8]) {
      param @w : f32[8,8]
      %0 = linear(%x, @w) : f32[B,8]
      %1 = add(%0, %0) : f32[B,8]
      return %1
    }""")
    assert result.changed_by == ["canonicalize", "cse"]
    assert result.stats == {"1:canonicalize": {"fold-reshape-chain": 1, "identity-reshape": 1},
                            "2:cse": {"merged": 1}}


# -- numerical equivalence ---------------------------------------------------------------------


def mlp_with_redundancy():
    """A small MLP block written the untidy way frontends and other passes leave graphs."""
    rng = np.random.default_rng(7)
    b = GraphBuilder("mlp")
    x = b.input("x", tensor(f32, "B", "S", 16))
    up_w = b.param("up.weight", source=ArraySource(rng.standard_normal((16, 32)).astype(np.float32)))
    up_b = b.param("up.bias", source=ArraySource(rng.standard_normal(32).astype(np.float32)))
    gate_w = b.param("gate.weight", source=GeneratedSource(f32, (16, 32), seed=1, std=0.3))
    down_w = b.param("down.weight", source=GeneratedSource(f32, (32, 16), seed=2, std=0.3))
    down_b = b.param("down.bias", source=GeneratedSource(f32, (16,), seed=3, init="uniform"))
    probe_w = b.param("probe.weight", source=GeneratedSource(f32, (16, 4), seed=4))
    with b.scope("up"):
        up = b.add(up_b, b.linear(x, up_w))
    with b.scope("gate"):
        gate = b.silu(b.linear(x, gate_w))
        gate_again = b.silu(b.linear(x, gate_w))  # a duplicate for cse
    with b.scope("act"):
        h = b.mul(b.add(gate, gate_again), up)
        h = b.reshape(b.reshape(h, shape=(0, 0, 4, 8)), shape=(0, 0, 32))
        h = b.transpose(b.transpose(h, perm=(1, 0, 2)), perm=(1, 0, 2))
        h = b.cast(h, dtype=f32)
    with b.scope("down"):
        y = b.add(b.linear(h, down_w), down_b)
    with b.scope("probe"):
        b.linear(x, probe_w)  # dead: nobody reads it
    b.output(y, name="y")
    return b.graph


@pytest.mark.parametrize(("pipeline", "nodes_after"), [
    ("canonicalize", 11),
    ("cse", 14),
    ("dce", 15),
    ("fuse-linear-bias", 14),
    ("O1,fuse-linear-bias", 6),
])
def test_generic_passes_keep_the_interpreter_results_bit_identical(pipeline: str, nodes_after: int):
    g = mlp_with_redundancy()
    assert len(g) == 16
    inputs = random_inputs(g, {"B": 2, "S": 3}, seed=11)
    before = run_graph(g, inputs)["y"]
    result = run_pipeline(g, pipeline)
    assert result.changed
    assert len(g) == nodes_after
    after = run_graph(g, inputs)["y"]
    assert after.dtype == before.dtype and after.shape == before.shape
    np.testing.assert_array_equal(after, before)


def test_a_graph_from_text_with_generated_weights_stays_bit_identical():
    g = with_weights(ir("""
    graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
      param @w : f32[4,8]
      param @b : f32[8]
      %0 = linear(%x, @w) : f32[B,8]
      %1 = add(@b, %0) : f32[B,8]
      %2 = linear(%x, @w) : f32[B,8]
      %3 = add(%2, @b) : f32[B,8]
      %4 = mul(%1, %3) : f32[B,8]
      return %4
    }"""))
    inputs = random_inputs(g, {"B": 5})
    before = run_graph(g, inputs)["y"]
    # Fusing first makes both sides identical, so cse can merge them (cse alone cannot:
    # add(b, l) and add(l, b) are different nodes to it).
    run_pipeline(g, "fuse-linear-bias,cse")
    assert_ir(g, """
    graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
      param @w : f32[4,8]
      param @b : f32[8]
      %0 = linear(%x, @w, @b) : f32[B,8]
      %1 = mul(%0, %0) : f32[B,8]
      return %1
    }""")
    np.testing.assert_array_equal(run_graph(g, inputs)["y"], before)
