"""Rule sets run to a fixed point; find-only mode reports matches and changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from _passes_testkit import assert_ir, ir

from ernie_ir.ir import GraphBuilder, Value
from ernie_ir.ir.printer import print_graph
from ernie_ir.passes import PassContext, PatternBuilder, RewriteRule, RuleSet, Var
from ernie_ir.passes.cleanup.canonicalize import CANONICAL_RULES, FoldReshapeChain
from ernie_ir.passes.fusion.linear_bias import FuseLinearBias

FIVE_RESHAPES = """
graph @g(%x: f32[B,24]) -> (y: f32[B,6,4]) {
  %0 = reshape(%x) {shape = [0, 2, 12]} : f32[B,2,12] loc("r0")
  %1 = reshape(%0) {shape = [0, 4, 6]} : f32[B,4,6] loc("r1")
  %2 = reshape(%1) {shape = [0, 24]} : f32[B,24] loc("r2")
  %3 = reshape(%2) {shape = [0, 3, 8]} : f32[B,3,8] loc("r3")
  %4 = reshape(%3) {shape = [0, 6, 4]} : f32[B,6,4] loc("r4")
  return %4
}
"""

ONE_RESHAPE = """
graph @g(%x: f32[B,24]) -> (y: f32[B,6,4]) {
  %0 = reshape(%x) {shape = [0, 6, 4]} : f32[B,6,4] loc("r4")
  return %0
}
"""


def test_a_chain_of_five_reshapes_folds_to_one_in_one_apply():
    g = ir(FIVE_RESHAPES)
    ctx = PassContext()
    assert RuleSet(CANONICAL_RULES).apply(g, ctx) == 4
    assert_ir(g, ONE_RESHAPE)
    assert ctx.stats == {"fold-reshape-chain": 4}


def test_apply_at_the_fixed_point_changes_nothing():
    g = ir(FIVE_RESHAPES)
    rules = RuleSet(CANONICAL_RULES)
    rules.apply(g)
    text = print_graph(g)
    assert rules.apply(g) == 0
    assert print_graph(g) == text


def test_one_rules_rewrite_enables_another_rules_match():
    # The transposes cancel; then the reshapes meet and fold; then the reshape is an identity.
    g = ir("""
    graph @g(%x: f32[B,6], %z: f32[B,6]) -> (y: f32[B,6]) {
      %0 = reshape(%x) {shape = [0, 2, 3]} : f32[B,2,3]
      %1 = transpose(%0) {perm = [0, 2, 1]} : f32[B,3,2]
      %2 = transpose(%1) {perm = [0, 2, 1]} : f32[B,2,3]
      %3 = reshape(%2) {shape = [0, 6]} : f32[B,6]
      %4 = cast(%3) {dtype = f32} : f32[B,6]
      %5 = add(%4, %z) : f32[B,6]
      return %5
    }""")
    ctx = PassContext()
    assert RuleSet(CANONICAL_RULES).apply(g, ctx) == 4
    assert ctx.stats == {"fold-transpose-chain": 1, "fold-reshape-chain": 1, "identity-reshape": 1,
                         "identity-cast": 1}
    assert_ir(g, """
    graph @g(%x: f32[B,6], %z: f32[B,6]) -> (y: f32[B,6]) {
      %0 = add(%x, %z) : f32[B,6]
      return %0
    }""")


def test_the_fixed_point_does_not_depend_on_the_order_of_the_rules():
    forward, backward = ir(FIVE_RESHAPES), ir(FIVE_RESHAPES)
    RuleSet(CANONICAL_RULES).apply(forward)
    RuleSet(reversed(CANONICAL_RULES)).apply(backward)
    assert_ir(backward, forward)


def test_rules_that_undo_each_other_are_reported_instead_of_looping_forever():
    class SwapMul(RewriteRule):
        name = "swap-mul"

        def pattern(self, op: PatternBuilder, a: Var, b: Var) -> Any:
            return op.mul(a, b)

        def rewrite(self, op: GraphBuilder, a: Value, b: Value) -> Value:
            return op.mul(b, a)

    g = ir("""
    graph @g(%a: f32[4], %b: f32[4]) -> (y: f32[4]) {
      %0 = mul(%a, %b) : f32[4]
      return %0
    }""")
    with pytest.raises(RuntimeError, match=r"rules \['swap-mul'\] did not reach a fixed point in 5 "
                                           r"sweeps \(a rule undoes another\?\)"):
        RuleSet([SwapMul()]).apply(g, max_sweeps=5)


# -- find-only mode -----------------------------------------------------------------------------


def test_find_returns_the_current_matches_and_leaves_the_graph_unchanged():
    g = ir(FIVE_RESHAPES)
    text = print_graph(g)
    matches = RuleSet(CANONICAL_RULES).find(g)
    assert print_graph(g) == text
    # Only what matches now: the folds a rewrite would enable next are not reported.
    assert [(m.rule.name, m.nodes[0].scope) for m in matches] == [
        ("fold-reshape-chain", "r1"), ("fold-reshape-chain", "r2"), ("fold-reshape-chain", "r3"),
        ("fold-reshape-chain", "r4")]
    first = matches[0]
    assert [n.scope for n in first.nodes] == ["r1", "r0"]
    assert first.bindings == {"x": g.inputs[0], "inner": (0, 2, 12), "outer": (0, 4, 6)}
    assert first.outputs == [g.nodes[1].outputs[0]]
    assert repr(first) == "<Match fold-reshape-chain at reshape @ r1>"


def test_find_and_apply_agree_on_independent_matches():
    g = ir("""
    graph @g(%x: f32[B,4]) -> (y: f32[B,8], z: f32[B,8]) {
      param @w1 : f32[4,8]
      param @b1 : f32[8]
      param @w2 : f32[4,8]
      param @b2 : f32[8]
      %0 = linear(%x, @w1) : f32[B,8] loc("a")
      %1 = add(%0, @b1) : f32[B,8] loc("a")
      %2 = linear(%x, @w2) : f32[B,8] loc("b")
      %3 = add(@b2, %2) : f32[B,8] loc("b")
      return %1, %3
    }""")
    rules = RuleSet([FuseLinearBias(), FoldReshapeChain()])
    found = [m.nodes[0].scope for m in rules.find(g)]
    assert found == ["a", "b"]
    assert rules.apply(g) == len(found)
    assert rules.find(g) == []
