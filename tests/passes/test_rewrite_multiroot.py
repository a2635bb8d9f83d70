"""Multi-root rewrite rules: replacements never read a value before its definition.

A multi-root pattern (several outputs, e.g. two linears reading one input)
matches nodes that may lie far apart, and within one sweep a match may
include nodes an earlier rewrite of the same sweep created. These tests fuse
shared-input linears in graphs where a naive anchor (before the first or the
root matched node) reads a value before its definition, and check that the
result verifies and computes the same. A match whose roots depend on each
other cannot be merged into one replacement at all: it is refused, and the
tracer says why.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _passes_testkit import explain_one, ir, random_inputs, with_weights

from ernie_ir.ir import GraphBuilder, Value, f32, tensor
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.verifier import verify, verify_problems
from ernie_ir.ir.weights import GeneratedSource
from ernie_ir.passes import PatternBuilder, RewriteRule, RuleSet, Var
from ernie_ir.runtime import run_graph


class FuseTwoLinears(RewriteRule):
    """linear(x, w1), linear(x, w2)  ->  split(linear(x, concat(w1, w2)))"""

    name = "fuse-two-linears"

    def pattern(self, op: PatternBuilder, x: Var, w1: Var, w2: Var) -> Any:
        return op.linear(x, w1), op.linear(x, w2)

    def rewrite(self, op: GraphBuilder, x: Value, w1: Value, w2: Value) -> Any:
        sizes = [int(w1.shape[1]), int(w2.shape[1])]
        return op.split(op.linear(x, op.concat(w1, w2, axis=1)), axis=-1, sizes=sizes)


def fuse_and_compare(text: str, expected_rewrites: int, rule: RewriteRule | None = None) -> Any:
    g = with_weights(ir(text))
    verify(g)
    inputs = random_inputs(g, {"B": 3})
    before = run_graph(g, inputs)
    n = RuleSet([rule or FuseTwoLinears()]).apply(g)
    assert verify_problems(g) == [], print_graph(g)
    assert n == expected_rewrites
    after = run_graph(g, inputs)
    for name, want in before.items():
        np.testing.assert_allclose(after[name], want, rtol=1e-5, atol=1e-5)
    return g


QKV_INTERLEAVED = """
graph @g(%x: f32[B,8]) -> (y: f32[B,4]) {
  param @q : f32[8,4]
  param @k : f32[8,4]
  param @v : f32[8,4]
  %0 = silu(%x) : f32[B,8] loc("norm")
  %1 = linear(%0, @q) : f32[B,4] loc("attn.q_proj")
  %2 = silu(%1) : f32[B,4] loc("attn.q_act")
  %3 = linear(%0, @k) : f32[B,4] loc("attn.k_proj")
  %4 = silu(%3) : f32[B,4] loc("attn.k_act")
  %5 = linear(%0, @v) : f32[B,4] loc("attn.v_proj")
  %6 = silu(%5) : f32[B,4] loc("attn.v_act")
  %7 = add(%2, %4) : f32[B,4]
  %8 = add(%7, %6) : f32[B,4]
  return %8
}
"""


def test_fusing_pairs_of_three_shared_input_linears_keeps_the_ir_valid_and_the_numbers():
    # Sweep 1 fuses q+k into a new linear placed near q; later in the same sweep the v linear
    # (the root) matches with that new linear: the replacement must still come before the
    # readers of the new linear's result, which sit between it and v.
    g = fuse_and_compare(QKV_INTERLEAVED, 2)
    assert [n.op for n in g].count("linear") == 1


QKV_LATE_WEIGHT = """
graph @g(%x: f32[B,8], %s: f32[8,4]) -> (y: f32[B,4]) {
  param @q : f32[8,4]
  %0 = linear(%x, @q) : f32[B,4] loc("attn.q_proj")
  %1 = silu(%0) : f32[B,4] loc("attn.q_act")
  %2 = silu(%s) : f32[8,4] loc("attn.k_weight")
  %3 = linear(%x, %2) : f32[B,4] loc("attn.k_proj")
  %4 = add(%1, %3) : f32[B,4]
  return %4
}
"""


def test_a_replacement_reading_a_value_defined_between_the_roots_goes_after_it():
    # The k weight is computed after q's reader: the fused linear needs it, and q's reader
    # needs the fused linear, so that reader moves after the replacement.
    g = fuse_and_compare(QKV_LATE_WEIGHT, 1)
    assert [n.op for n in g].count("linear") == 1


def test_many_layers_of_shared_input_linears_fuse_in_one_apply():
    b = GraphBuilder("layers")
    h = b.input("x", tensor(f32, "B", 8))
    for layer in range(4):
        with b.scope(f"layers.{layer}"):
            outs = []
            for i, p in enumerate("qkv"):
                w = b.param(f"layers.{layer}.{p}",
                            source=GeneratedSource(f32, [8, 8], seed=10 * layer + i, std=0.3))
                outs.append(b.silu(b.linear(h, w)))
            h = b.add(b.add(outs[0], outs[1]), outs[2])
    b.output(h, name="y")
    g = b.graph
    inputs = {"x": np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)}
    before = run_graph(g, inputs)["y"]
    assert RuleSet([FuseTwoLinears()]).apply(g) == 8
    assert verify_problems(g) == []
    assert [n.op for n in g].count("linear") == 4
    np.testing.assert_allclose(run_graph(g, inputs)["y"], before, rtol=1e-5, atol=1e-5)


DEPENDENT_ROOTS = """
graph @g(%x: f32[4,4]) -> (y: f32[4,4]) {
  param @w : f32[4,4]
  %0 = linear(%x, @w) : f32[4,4] loc("first")
  %1 = silu(%0) : f32[4,4] loc("weight_from_first")
  %2 = linear(%x, %1) : f32[4,4] loc("second")
  %3 = add(%0, %2) : f32[4,4]
  return %3
}
"""


def test_a_match_whose_roots_depend_on_each_other_is_refused_with_a_reason():
    g = with_weights(ir(DEPENDENT_ROOTS))
    text = print_graph(g)
    trace = explain_one(g, FuseTwoLinears())
    assert trace.matches == 0, trace.summary()
    assert trace.best is not None
    assert "depend on each other" in trace.best.reason, trace.summary()
    assert "linear at first" in trace.best.reason and "linear at second" in trace.best.reason
    assert RuleSet([FuseTwoLinears()]).find(g) == []
    assert RuleSet([FuseTwoLinears()]).apply(g) == 0
    assert print_graph(g) == text


def test_a_root_reading_another_roots_result_directly_is_refused():
    g = with_weights(ir(DEPENDENT_ROOTS.replace("%2 = linear(%x, %1)", "%2 = linear(%x, %0)")
                        .replace('  %1 = silu(%0) : f32[4,4] loc("weight_from_first")\n', "")))
    trace = explain_one(g, FuseTwoLinears())
    assert trace.matches == 0 and trace.best is not None, trace.summary()
    assert "depend on each other" in trace.best.reason, trace.summary()
    assert RuleSet([FuseTwoLinears()]).apply(g) == 0
    verify(g)


@pytest.mark.parametrize("text", [QKV_INTERLEAVED, QKV_LATE_WEIGHT])
def test_find_reports_the_matches_apply_makes(text: str):
    g = with_weights(ir(text))
    assert len(RuleSet([FuseTwoLinears()]).find(g)) >= 1


# -- the tracer on multi-root rules ----------------------------------------------------------------


class FuseQKVParams(RewriteRule):
    """q, k, v linears (by scope) with param weights, reading one x."""

    name = "fuse-qkv-params"

    def pattern(self, op: PatternBuilder, x: Var, wq: Var, wk: Var, wv: Var) -> Any:
        return (op.linear(x, wq.where(param=True), _scope="*.q_proj"),
                op.linear(x, wk.where(param=True), _scope="*.k_proj"),
                op.linear(x, wv.where(param=True), _scope="*.v_proj"))

    def rewrite(self, op: GraphBuilder, x: Value, wq: Value, wk: Value, wv: Value) -> Any:
        sizes = [int(w.shape[1]) for w in (wq, wk, wv)]
        return op.split(op.linear(x, op.concat(wq, wk, wv, axis=1)), axis=-1, sizes=sizes)


QKV_TWO_NEAR_MISSES = """
graph @g(%x: f32[B,8], %s: f32[8,4]) -> (y: f32[B,4]) {
  param @q : f32[8,4]
  param @k : f32[8,4]
  param @o : f32[8,4]
  %0 = linear(%x, @q) : f32[B,4] loc("attn.q_proj")
  %1 = linear(%x, @k) : f32[B,4] loc("attn.k_proj")
  %2 = linear(%x, %s) : f32[B,4] loc("attn.v_proj")
  %3 = linear(%x, @o) : f32[B,4] loc("attn.o_proj")
  %4 = add(%0, %1) : f32[B,4]
  %5 = add(%4, %2) : f32[B,4]
  %6 = add(%5, %3) : f32[B,4]
  return %6
}
"""


def test_explain_names_the_deepest_near_miss_among_the_candidates_for_a_further_root():
    # For v, the v_proj linear gets further (its scope holds, its weight is no param) than the
    # o_proj linear (wrong scope), which is tried last: the tracer reports the v_proj attempt.
    trace = explain_one(with_weights(ir(QKV_TWO_NEAR_MISSES)), FuseQKVParams())
    assert trace.matches == 0 and trace.best is not None, trace.summary()
    assert trace.best.reason == "variable wv must be a param", trace.summary()
    assert (trace.best.matched, trace.best.total) == (3, 3)


class LinearAndBiasedLinear(RewriteRule):
    """A second root two pattern nodes above the shared input: add(linear(x, wk), bk)."""

    name = "linear-and-biased-linear"

    def pattern(self, op: PatternBuilder, x: Var, wq: Var, wk: Var, bk: Var) -> Any:
        return op.linear(x, wq), op.add(op.linear(x, wk), bk.where(param=True))

    def rewrite(self, op: GraphBuilder, x: Value, wq: Value, wk: Value, bk: Value) -> Any:
        q, k = op.split(op.linear(x, op.concat(wq, wk, axis=1)), axis=-1,
                        sizes=[int(wq.shape[1]), int(wk.shape[1])])
        return q, op.add(k, bk)


def test_a_further_root_above_the_shared_input_is_found():
    text = """
    graph @g(%x: f32[B,8]) -> (y: f32[B,4]) {
      param @q : f32[8,4]
      param @k : f32[8,4]
      param @kb : f32[4]
      %0 = linear(%x, @q) : f32[B,4] loc("q")
      %1 = linear(%x, @k) : f32[B,4] loc("k")
      %2 = add(%1, @kb) : f32[B,4] loc("k")
      %3 = mul(%0, %2) : f32[B,4]
      return %3
    }"""
    (m,) = RuleSet([LinearAndBiasedLinear()]).find(with_weights(ir(text)))
    assert [n.scope for n in m.nodes] == ["q", "k", "k"]
    assert [n.op for n in m.nodes] == ["linear", "add", "linear"]
    g = fuse_and_compare(text, 1, LinearAndBiasedLinear())
    assert [n.op for n in g] == ["concat", "linear", "split", "add", "mul"]


def test_explain_on_the_command_line_shows_why_dependent_roots_are_refused(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]):
    from _passes_testkit import cli, registered

    from ernie_ir.ir.storage import save_graph
    from ernie_ir.passes import rewrite_pass

    model = tmp_path / "model"
    save_graph(with_weights(ir(DEPENDENT_ROOTS)), model)
    with registered(rewrite_pass("fuse-two-linears", "Fuse two linears that share an input.",
                                 [FuseTwoLinears()])):
        code, out, err = cli(capsys, "explain", "fuse-two-linears", str(model))
    assert code == 0, err
    assert "0 match(es) among 2 candidate node(s)" in out
    assert "the roots depend on each other" in out, out
