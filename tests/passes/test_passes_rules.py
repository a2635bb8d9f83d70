"""Rewrite rules, specified as Before -> Expected IR, and near misses with the tracer's reason.

Each rule test states a graph before, applies the rule(s), and compares with
the expected graph structurally. A near miss states a graph the rule must not
rewrite, checks the graph is untouched, and checks that `RuleSet.explain`
names the best partial match and why it failed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _passes_testkit import apply_rules, assert_ir, explain_one, ir, random_inputs, with_weights

from ernie_ir.ir import DType, GraphBuilder, Value
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.weights import ConcatSource
from ernie_ir.passes import MatchContext, MatchResult, PatternBuilder, RewriteRule, RuleSet, Var
from ernie_ir.passes.cleanup.canonicalize import (
    FoldReshapeChain,
    FoldTransposeChain,
    IdentityCast,
    IdentityReshape,
    IdentityTranspose,
    SinglePieceSplit,
)
from ernie_ir.passes.fusion.linear_bias import FuseLinearBias
from ernie_ir.runtime import run_graph


def assert_near_miss(before: str, rule: RewriteRule, reason: str, matched: int | None = None) -> None:
    """`rule` does not rewrite `before`, and explain() says why (substring `reason`)."""
    g = ir(before)
    text = print_graph(g)
    trace = explain_one(g, rule)
    assert trace.matches == 0, trace.summary()
    assert trace.best is not None, trace.summary()
    assert reason in trace.best.reason, trace.summary()
    if matched is not None:
        assert (trace.best.matched, trace.best.total) == (matched, rule.size), trace.summary()
    assert reason in trace.summary()
    assert apply_rules(g, rule) == 0
    assert print_graph(g) == text


# -- fuse-linear-bias ---------------------------------------------------------------------

LINEAR_PLUS_BIAS = """
graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
  param @w : f32[4,8]
  param @b : f32[8]
  %0 = linear(%x, @w) : f32[B,8] loc("proj")
  %1 = add(%0, @b) : f32[B,8] loc("proj")
  return %1
}
"""

BIASED_LINEAR = """
graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
  param @w : f32[4,8]
  param @b : f32[8]
  %0 = linear(%x, @w, @b) : f32[B,8] loc("proj")
  return %0
}
"""


def test_fuse_linear_bias_folds_a_param_bias_into_the_linear():
    g = ir(LINEAR_PLUS_BIAS)
    assert apply_rules(g, FuseLinearBias()) == 1
    assert_ir(g, BIASED_LINEAR)


def test_fuse_linear_bias_matches_the_commuted_add():
    g = ir(LINEAR_PLUS_BIAS.replace("add(%0, @b)", "add(@b, %0)"))
    assert apply_rules(g, FuseLinearBias()) == 1
    assert_ir(g, BIASED_LINEAR)


def test_without_commute_the_swapped_add_is_a_near_miss():
    class NoCommute(FuseLinearBias):
        commute = False

    assert_near_miss(LINEAR_PLUS_BIAS.replace("add(%0, @b)", "add(@b, %0)"), NoCommute(),
                     "add at proj: input a: expected result of linear, found param @b", matched=1)


def test_fuse_linear_bias_rewrites_every_site_and_keeps_each_scope():
    g = ir("""
    graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
      param @l0.w : f32[4,4]
      param @l0.b : f32[4]
      param @l1.w : f32[4,8]
      param @l1.b : f32[8]
      %0 = linear(%x, @l0.w) : f32[B,4] loc("l0")
      %1 = add(@l0.b, %0) : f32[B,4] loc("l0")
      %2 = silu(%1) : f32[B,4] loc("act")
      %3 = linear(%2, @l1.w) : f32[B,8] loc("l1")
      %4 = add(%3, @l1.b) : f32[B,8] loc("l1")
      return %4
    }""")
    assert apply_rules(g, FuseLinearBias()) == 2
    assert_ir(g, """
    graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
      param @l0.w : f32[4,4]
      param @l0.b : f32[4]
      param @l1.w : f32[4,8]
      param @l1.b : f32[8]
      %0 = linear(%x, @l0.w, @l0.b) : f32[B,4] loc("l0")
      %1 = silu(%0) : f32[B,4] loc("act")
      %2 = linear(%1, @l1.w, @l1.b) : f32[B,8] loc("l1")
      return %2
    }""")


@pytest.mark.parametrize(("before", "reason", "matched"), [
    pytest.param("""
        graph @g(%x: f32[B,4], %b: f32[8]) -> (y: f32[B,8]) {
          param @w : f32[4,8]
          %0 = linear(%x, @w) : f32[B,8]
          %1 = add(%0, %b) : f32[B,8]
          return %1
        }""", "variable b must be a param", 2, id="bias-is-an-activation"),
    pytest.param("""
        graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
          param @w : f32[4,8]
          param @b : f32[1,8]
          %0 = linear(%x, @w) : f32[B,8]
          %1 = add(%0, @b) : f32[B,8]
          return %1
        }""", "variable b must have rank 1, found f32[1,8]", 2, id="bias-of-rank-2"),
    pytest.param("""
        graph @g(%x: f32[B,4]) -> (y: f32[B,8], z: f32[B,8]) {
          param @w : f32[4,8]
          param @b : f32[8]
          %0 = linear(%x, @w) : f32[B,8]
          %1 = add(%0, @b) : f32[B,8]
          %2 = silu(%0) : f32[B,8]
          return %1, %2
        }""", "result of linear must have a single use, has 2", 2, id="linear-read-twice"),
    pytest.param("""
        graph @g(%x: f32[B,4]) -> (y: f32[B,8], z: f32[B,8]) {
          param @w : f32[4,8]
          param @b : f32[8]
          %0 = linear(%x, @w) : f32[B,8]
          %1 = add(%0, @b) : f32[B,8]
          return %1, %0
        }""", "intermediate result of linear is a graph output", 2, id="linear-is-an-output"),
    pytest.param("""
        graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
          param @w : f32[4,1]
          param @b : f32[8]
          %0 = linear(%x, @w) : f32[B,1]
          %1 = add(%0, @b) : f32[B,8]
          return %1
        }""", "check: bias has 8 elements but the linear has 1 outputs", 2, id="bias-broadcasts"),
    pytest.param("""
        graph @g(%x: bf16[B,4]) -> (y: f32[B,8]) {
          param @w : bf16[4,8]
          param @b : f32[8]
          %0 = linear(%x, @w) : bf16[B,8]
          %1 = add(%0, @b) : f32[B,8]
          return %1
        }""", "check: the add promotes bf16 to f32; a fused linear would not", 2, id="promotion"),
    pytest.param("""
        graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
          param @w : f32[4,8]
          param @b0 : f32[8]
          param @b : f32[8]
          %0 = linear(%x, @w, @b0) : f32[B,8] loc("proj")
          %1 = add(%0, @b) : f32[B,8]
          return %1
        }""", "linear at proj: input bias is present but the pattern has none", 2,
                 id="linear-has-a-bias-already"),
    pytest.param("""
        graph @g(%x: f32[B,8]) -> (y: f32[B,8]) {
          param @b : f32[8]
          %0 = silu(%x) : f32[B,8]
          %1 = add(%0, @b) : f32[B,8]
          return %1
        }""", "expected linear, found silu", 1, id="not-a-linear"),
])
def test_fuse_linear_bias_near_misses_explain_why(before: str, reason: str, matched: int):
    assert_near_miss(before, FuseLinearBias(), reason, matched)


def test_explain_counts_candidates_and_says_when_the_root_op_is_absent():
    g = ir("""
    graph @g(%x: f32[4]) -> (y: f32[4]) {
      %0 = silu(%x) : f32[4]
      return %0
    }""")
    trace = explain_one(g, FuseLinearBias())
    assert (trace.matches, trace.candidates, trace.best) == (0, 0, None)
    assert trace.summary() == ("fuse-linear-bias: 0 match(es) among 0 candidate node(s) "
                               "(no node has the pattern's root op)")
    g = ir(LINEAR_PLUS_BIAS)
    trace = explain_one(g, FuseLinearBias())
    assert (trace.matches, trace.candidates, trace.best) == (1, 1, None)


# -- canonicalize rules ------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "before", "expected"), [
    pytest.param(FoldReshapeChain(), """
        graph @g(%x: f32[B,24]) -> (y: f32[B,6,4]) {
          %0 = reshape(%x) {shape = [0, 2, 12]} : f32[B,2,12] loc("a")
          %1 = reshape(%0) {shape = [0, 6, 4]} : f32[B,6,4] loc("b")
          return %1
        }""", """
        graph @g(%x: f32[B,24]) -> (y: f32[B,6,4]) {
          %0 = reshape(%x) {shape = [0, 6, 4]} : f32[B,6,4] loc("b")
          return %0
        }""", id="fold-reshape-chain"),
    pytest.param(FoldReshapeChain(), """
        graph @g(%x: f32[2,3,4]) -> (y: f32[2,12]) {
          %0 = reshape(%x) {shape = [2, 0, 2, 2]} : f32[2,3,2,2]
          %1 = reshape(%0) {shape = [0, -1]} : f32[2,12]
          return %1
        }""", """
        graph @g(%x: f32[2,3,4]) -> (y: f32[2,12]) {
          %0 = reshape(%x) {shape = [2, -1]} : f32[2,12]
          return %0
        }""", id="fold-reshape-chain-resolves-0-through-the-inner-shape"),
    pytest.param(IdentityReshape(), """
        graph @g(%x: f32[B,8]) -> (y: f32[B,8]) {
          %0 = reshape(%x) {shape = [0, 8]} : f32[B,8]
          %1 = silu(%0) : f32[B,8]
          return %1
        }""", """
        graph @g(%x: f32[B,8]) -> (y: f32[B,8]) {
          %0 = silu(%x) : f32[B,8]
          return %0
        }""", id="identity-reshape"),
    pytest.param(FoldTransposeChain(), """
        graph @g(%x: f32[2,3,4]) -> (y: f32[3,2,4]) {
          %0 = transpose(%x) {perm = [1, 2, 0]} : f32[3,4,2]
          %1 = transpose(%0) {perm = [0, 2, 1]} : f32[3,2,4]
          return %1
        }""", """
        graph @g(%x: f32[2,3,4]) -> (y: f32[3,2,4]) {
          %0 = transpose(%x) {perm = [1, 0, 2]} : f32[3,2,4]
          return %0
        }""", id="fold-transpose-chain"),
    pytest.param(FoldTransposeChain(), """
        graph @g(%x: f32[2,3]) -> (y: f32[2,3]) {
          %0 = transpose(%x) {perm = [1, 0]} : f32[3,2]
          %1 = transpose(%0) {perm = [1, 0]} : f32[2,3]
          %2 = silu(%1) : f32[2,3]
          return %2
        }""", """
        graph @g(%x: f32[2,3]) -> (y: f32[2,3]) {
          %0 = silu(%x) : f32[2,3]
          return %0
        }""", id="transpose-chain-that-cancels"),
    pytest.param(IdentityTranspose(), """
        graph @g(%x: f32[2,3]) -> (y: f32[2,3]) {
          %0 = transpose(%x) {perm = [0, 1]} : f32[2,3]
          %1 = silu(%0) : f32[2,3]
          return %1
        }""", """
        graph @g(%x: f32[2,3]) -> (y: f32[2,3]) {
          %0 = silu(%x) : f32[2,3]
          return %0
        }""", id="identity-transpose"),
    pytest.param(IdentityCast(), """
        graph @g(%x: bf16[4]) -> (y: f32[4]) {
          %0 = cast(%x) {dtype = bf16} : bf16[4]
          %1 = cast(%0) {dtype = f32} : f32[4]
          return %1
        }""", """
        graph @g(%x: bf16[4]) -> (y: f32[4]) {
          %0 = cast(%x) {dtype = f32} : f32[4]
          return %0
        }""", id="identity-cast"),
    pytest.param(SinglePieceSplit(), """
        graph @g(%x: f32[2,6]) -> (y: f32[2,6]) {
          %0 = split(%x) {axis = 1, sizes = [6]} : f32[2,6]
          %1 = silu(%0) : f32[2,6]
          return %1
        }""", """
        graph @g(%x: f32[2,6]) -> (y: f32[2,6]) {
          %0 = silu(%x) : f32[2,6]
          return %0
        }""", id="single-piece-split"),
])
def test_canonicalize_rule(rule: RewriteRule, before: str, expected: str):
    g = ir(before)
    assert apply_rules(g, rule) == 1
    assert_ir(g, expected)


@pytest.mark.parametrize(("rule", "before", "reason"), [
    pytest.param(FoldReshapeChain(), """
        graph @g(%x: f32[B,8]) -> (y: f32[B,2,4]) {
          %0 = reshape(%x) {shape = [-1, 8]} : f32[B,8]
          %1 = reshape(%0) {shape = [0, 2, 4]} : f32[B,2,4]
          return %1
        }""", "check: outer dim 0 copies a dim the inner reshape infers",
                 id="outer-0-copies-an-inferred-dim"),
    pytest.param(FoldReshapeChain(), """
        graph @g(%x: f32[B,8]) -> (y: f32[B,2,4], z: f32[B,4,2]) {
          %0 = reshape(%x) {shape = [0, 2, 4]} : f32[B,2,4]
          %1 = reshape(%0) {shape = [0, 4, 2]} : f32[B,4,2]
          return %0, %1
        }""", "intermediate result of reshape is a graph output", id="inner-is-an-output"),
    pytest.param(IdentityCast(), """
        graph @g(%x: f32[4]) -> (y: bf16[4]) {
          %0 = cast(%x) {dtype = bf16} : bf16[4]
          return %0
        }""", "check: cast changes f32 to bf16", id="a-real-cast"),
    pytest.param(IdentityTranspose(), """
        graph @g(%x: f32[2,3]) -> (y: f32[3,2]) {
          %0 = transpose(%x) {perm = [1, 0]} : f32[3,2]
          return %0
        }""", "transpose: attribute perm=(1, 0) fails its predicate", id="a-real-transpose"),
    pytest.param(SinglePieceSplit(), """
        graph @g(%x: f32[2,6]) -> (y: f32[2,2], z: f32[2,4]) {
          %0, %1 = split(%x) {axis = 1, sizes = [2, 4]} : f32[2,2], f32[2,4]
          return %0, %1
        }""", "attribute sizes=(2, 4) fails its predicate", id="a-real-split"),
])
def test_canonicalize_near_misses_explain_why(rule: RewriteRule, before: str, reason: str):
    assert_near_miss(before, rule, reason)


# -- attribute constraints -----------------------------------------------------------------


class MulOfTransposes(RewriteRule):
    """mul(transpose(a, p), transpose(b, p)) -> transpose(mul(a, b), p): one AttrVar, twice."""

    name = "mul-of-transposes"

    def pattern(self, op: PatternBuilder, a: Var, b: Var) -> Any:
        return op.mul(op.transpose(a, perm=op.attr("p"), _single_use=True),
                      op.transpose(b, perm=op.attr("p"), _single_use=True))

    def check(self, ctx: MatchContext, a: Value, b: Value, p: tuple[int, ...]) -> MatchResult:
        if a.type != b.type:
            return ctx.fail(f"operands differ: {a.type} vs {b.type}", a, b)
        return ctx.ok()

    def rewrite(self, op: GraphBuilder, a: Value, b: Value, p: tuple[int, ...]) -> Value:
        return op.transpose(op.mul(a, b), perm=p)


def test_an_attr_var_binds_the_attribute_and_is_passed_to_rewrite():
    g = ir("""
    graph @g(%a: f32[2,3,4], %b: f32[2,3,4]) -> (y: f32[2,4,3]) {
      %0 = transpose(%a) {perm = [0, 2, 1]} : f32[2,4,3]
      %1 = transpose(%b) {perm = [0, 2, 1]} : f32[2,4,3]
      %2 = mul(%0, %1) : f32[2,4,3] loc("m")
      return %2
    }""")
    (m,) = RuleSet([MulOfTransposes()]).find(g)
    assert m.bindings["p"] == (0, 2, 1)
    assert apply_rules(g, MulOfTransposes()) == 1
    assert_ir(g, """
    graph @g(%a: f32[2,3,4], %b: f32[2,3,4]) -> (y: f32[2,4,3]) {
      %0 = mul(%a, %b) : f32[2,3,4] loc("m")
      %1 = transpose(%0) {perm = [0, 2, 1]} : f32[2,4,3] loc("m")
      return %1
    }""")


def test_an_attr_var_used_twice_must_bind_the_same_value():
    assert_near_miss("""
    graph @g(%a: f32[2,3,4], %b: f32[2,4,3]) -> (y: f32[2,4,3]) {
      %0 = transpose(%a) {perm = [0, 2, 1]} : f32[2,4,3]
      %1 = transpose(%b) {perm = [0, 1, 2]} : f32[2,4,3]
      %2 = mul(%0, %1) : f32[2,4,3]
      return %2
    }""", MulOfTransposes(), "transpose: attribute perm=(0, 1, 2) differs from p=(0, 2, 1)", 2)


class CastRoundTrip(RewriteRule):
    """cast(cast(x, bf16), f32) -> x for bf16 x: an exact attribute value in the pattern."""

    name = "cast-round-trip"

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        return op.cast(op.cast(x.where(dtype=DType.BF16), dtype=DType.F32, _single_use=True),
                       dtype=DType.BF16)

    def rewrite(self, op: GraphBuilder, x: Value) -> Value:
        return x


ROUND_TRIP = """
graph @g(%x: bf16[4]) -> (y: f32[4]) {
  %0 = cast(%x) {dtype = f32} : f32[4]
  %1 = cast(%0) {dtype = bf16} : bf16[4]
  %2 = silu(%1) : bf16[4]
  %3 = cast(%2) {dtype = f32} : f32[4]
  return %3
}
"""


def test_an_exact_attribute_value_matches():
    g = ir(ROUND_TRIP)
    assert apply_rules(g, CastRoundTrip()) == 1
    assert_ir(g, """
    graph @g(%x: bf16[4]) -> (y: f32[4]) {
      %0 = silu(%x) : bf16[4]
      %1 = cast(%0) {dtype = f32} : f32[4]
      return %1
    }""")


def test_an_exact_attribute_value_refuses_another_value():
    assert_near_miss("""
    graph @g(%x: bf16[4]) -> (y: f16[4]) {
      %0 = silu(%x) : bf16[4]
      %1 = cast(%0) {dtype = f16} : f16[4]
      return %1
    }""", CastRoundTrip(), "cast: attribute dtype is DType.F16, pattern wants DType.BF16", 0)


def test_a_var_dtype_constraint_refuses_another_dtype():
    assert_near_miss(ROUND_TRIP.replace("%x: bf16[4]", "%x: f16[4]"), CastRoundTrip(),
                     "variable x must be bf16, found f16[4]", 2)


# -- constraints on variables --------------------------------------------------------------


class LinearFinder(RewriteRule):
    """Any linear, binding an optional bias; used with find() only."""

    name = "linear-finder"

    def pattern(self, op: PatternBuilder, x: Var, w: Var, b: Var) -> Any:
        return op.linear(x.where(param=False), w.where(param=True, predicate=lambda v: v.name
                                                       .endswith(".weight")),
                         b.where(optional=True))

    def rewrite(self, op: GraphBuilder, x: Value, w: Value, b: Value | None) -> Value:
        raise AssertionError("find-only rule")


TWO_LINEARS = """
graph @g(%x: f32[B,4]) -> (y: f32[B,8], z: f32[B,8]) {
  param @p.weight : f32[4,8]
  param @p.bias : f32[8]
  param @q.weight : f32[4,8]
  %0 = linear(%x, @p.weight, @p.bias) : f32[B,8] loc("p")
  %1 = linear(%x, @q.weight) : f32[B,8] loc("q")
  return %0, %1
}
"""


def test_an_optional_var_binds_a_present_input_or_none():
    g = ir(TWO_LINEARS)
    matches = RuleSet([LinearFinder()]).find(g)
    assert [(m.nodes[0].scope, m.bindings["b"]) for m in matches] == [
        ("p", g.params["p.bias"]), ("q", None)]
    assert all(m.bindings["x"] is g.inputs[0] for m in matches)


def test_a_required_var_refuses_an_absent_input():
    class NeedsBias(LinearFinder):
        def pattern(self, op: PatternBuilder, x: Var, w: Var, b: Var) -> Any:
            return op.linear(x, w, b)

    g = ir(TWO_LINEARS)
    assert [m.nodes[0].scope for m in RuleSet([NeedsBias()]).find(g)] == ["p"]
    trace = explain_one(g, NeedsBias())
    assert trace.matches == 1 and trace.best is None  # a match hides the near misses
    assert_near_miss(TWO_LINEARS.replace("%0 = linear(%x, @p.weight, @p.bias)",
                                         "%0 = linear(%x, @p.weight)")
                     .replace("  param @p.bias : f32[8]\n", ""),
                     NeedsBias(), "input bias is absent but the pattern needs variable b")


def test_param_and_predicate_constraints_on_vars():
    assert_near_miss("""
    graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
      param @q.w : f32[4,8]
      %0 = linear(%x, @q.w) : f32[B,8] loc("q")
      return %0
    }""", LinearFinder(), "variable w fails its predicate")
    assert_near_miss("""
    graph @g(%w: f32[4,8]) -> (y: f32[4,8]) {
      param @x : f32[4,4]
      %0 = linear(@x, %w) : f32[4,8]
      return %0
    }""", LinearFinder(), "variable x must not be a param (found @x)")


class SiluOfSingleUse(RewriteRule):
    """silu(x) where nothing else reads x; used with find() and explain() only."""

    name = "silu-of-single-use"

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        return op.silu(x.where(single_use=True))

    def rewrite(self, op: GraphBuilder, x: Value) -> Value:
        raise AssertionError("find-only rule")


def test_a_single_use_var():
    g = ir("""
    graph @g(%x: f32[4]) -> (y: f32[4]) {
      %0 = gelu(%x) : f32[4]
      %1 = silu(%0) : f32[4] loc("only-reader")
      %2 = silu(%x) : f32[4] loc("x-has-other-readers")
      %3 = add(%1, %2) : f32[4]
      %4 = add(%3, %x) : f32[4]
      return %4
    }""")
    assert [m.nodes[0].scope for m in RuleSet([SiluOfSingleUse()]).find(g)] == ["only-reader"]
    assert_near_miss("""
    graph @g(%x: f32[4]) -> (y: f32[4]) {
      %0 = silu(%x) : f32[4]
      %1 = add(%0, %x) : f32[4]
      return %1
    }""", SiluOfSingleUse(), "variable x must have a single use, has 2", 1)


# -- scopes ----------------------------------------------------------------------------------------


def scoped_linears() -> str:
    lines = ["graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {", "  param @w : f32[4,4]"]
    scopes = ["layers.0.mlp.up", "layers.1.mlp.up", "layers.1.attn.q", "layers.10.mlp.up",
              "head.mlp.up"]
    prev = "%x"
    for i, s in enumerate(scopes):
        lines.append(f'  %{i} = linear({prev}, @w) : f32[B,4] loc("{s}")')
        prev = f"%{i}"
    lines += [f"  return {prev}", "}"]
    return "\n".join(lines)


def scoped_rule(scope: str) -> RewriteRule:
    class Scoped(RewriteRule):
        name = "scoped"

        def pattern(self, op: PatternBuilder, x: Var, w: Var) -> Any:
            return op.linear(x, w, _scope=scope)

        def rewrite(self, op: GraphBuilder, x: Value, w: Value) -> Value:
            raise AssertionError("find-only rule")

    return Scoped()


@pytest.mark.parametrize(("scope", "expected"), [
    ("layers.*.mlp.*", ["layers.0.mlp.up", "layers.1.mlp.up", "layers.10.mlp.up"]),
    ("*.mlp.up", ["layers.0.mlp.up", "layers.1.mlp.up", "layers.10.mlp.up", "head.mlp.up"]),
    ("layers.1.*", ["layers.1.mlp.up", "layers.1.attn.q"]),
    ("layers.?.mlp.up", ["layers.0.mlp.up", "layers.1.mlp.up"]),
    ("layers.1", []),  # a glob matches the whole scope, not a prefix
    (r"re:layers\.1\..*", ["layers.1.mlp.up", "layers.1.attn.q"]),
    (r"re:layers\.(0|10)\.mlp\.up", ["layers.0.mlp.up", "layers.10.mlp.up"]),
    (r"re:layers\.1", []),  # a regex must match the whole scope too
    (r"re:.*\.attn\..*|head\..*", ["layers.1.attn.q", "head.mlp.up"]),
])
def test_scope_constraints_glob_and_regex_match_the_full_scope(scope: str, expected: list[str]):
    g = ir(scoped_linears())
    assert [m.nodes[0].scope for m in RuleSet([scoped_rule(scope)]).find(g)] == expected


def test_a_scope_near_miss_names_the_pattern_scope():
    g = ir(scoped_linears())
    trace = explain_one(g, scoped_rule(r"re:layers\.1"))
    assert trace.candidates == 5 and trace.matches == 0
    assert trace.best is not None
    assert trace.best.reason == r"linear at layers.0.mlp.up: scope does not match 're:layers\\.1'"


# -- multi-output patterns ------------------------------------------------------------------------


class FuseQKV(RewriteRule):
    """Three linears reading one x -> one linear on the concatenated weight, split three ways."""

    name = "fuse-qkv"

    def pattern(self, op: PatternBuilder, x: Var, wq: Var, wk: Var, wv: Var) -> Any:
        return (op.linear(x, wq.where(param=True), _scope="*.q_proj"),
                op.linear(x, wk.where(param=True), _scope="*.k_proj"),
                op.linear(x, wv.where(param=True), _scope="*.v_proj"))

    def rewrite(self, op: GraphBuilder, x: Value, wq: Any, wk: Any, wv: Any) -> Any:
        parts = [wq, wk, wv]
        sizes = [p.type.shape[1] for p in parts]
        source = (ConcatSource([p.source for p in parts], axis=1)
                  if all(p.has_data for p in parts) else None)
        name = wq.name.replace("q_proj", "qkv_proj")
        w = op.param(name, wq.type.with_shape([wq.type.shape[0], sum(sizes)]), source)
        with op.at_scope(name.rsplit(".", 1)[0]):
            return op.split(op.linear(x, w), axis=-1, sizes=sizes)


QKV = """
graph @attn(%x: f32[B,8]) -> (q: f32[B,8], k: f32[B,4], v: f32[B,4]) {
  param @attn.q_proj.weight : f32[8,8]
  param @attn.k_proj.weight : f32[8,4]
  param @attn.v_proj.weight : f32[8,4]
  %0 = silu(%x) : f32[B,8] loc("attn.act")
  %1 = linear(%0, @attn.k_proj.weight) : f32[B,4] loc("attn.k_proj")
  %2 = linear(%0, @attn.q_proj.weight) : f32[B,8] loc("attn.q_proj")
  %3 = linear(%0, @attn.v_proj.weight) : f32[B,4] loc("attn.v_proj")
  return %2, %1, %3
}
"""

QKV_FUSED = """
graph @attn(%x: f32[B,8]) -> (q: f32[B,8], k: f32[B,4], v: f32[B,4]) {
  param @attn.qkv_proj.weight : f32[8,16]
  %0 = silu(%x) : f32[B,8] loc("attn.act")
  %1 = linear(%0, @attn.qkv_proj.weight) : f32[B,16] loc("attn.qkv_proj")
  %2, %3, %4 = split(%1) {axis = -1, sizes = [8, 4, 4]} : f32[B,8], f32[B,4], f32[B,4] loc("attn.qkv_proj")
  return %2, %3, %4
}
"""


def test_a_multi_output_pattern_fuses_three_linears_sharing_an_input():
    g = with_weights(ir(QKV))
    inputs = random_inputs(g, {"B": 3})
    before = run_graph(g, inputs)
    (m,) = RuleSet([FuseQKV()]).find(g)
    assert [n.scope for n in m.nodes] == ["attn.q_proj", "attn.k_proj", "attn.v_proj"]
    assert apply_rules(g, FuseQKV()) == 1
    assert_ir(g, QKV_FUSED)
    after = run_graph(g, inputs)
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(after[name], before[name])


def test_a_multi_output_pattern_with_a_missing_output_is_a_near_miss():
    before = (QKV.replace("  %3 = linear(%0, @attn.v_proj.weight) : f32[B,4] loc(\"attn.v_proj\")\n",
                          "  %3 = silu(%0) : f32[B,8]\n")
              .replace("  param @attn.v_proj.weight : f32[8,4]\n", "")
              .replace("v: f32[B,4]", "v: f32[B,8]"))
    assert_near_miss(before, FuseQKV(), "no linear reads the values bound so far", 2)


def test_a_multi_output_pattern_refuses_outputs_in_the_wrong_scope():
    before = QKV.replace('loc("attn.v_proj")', 'loc("attn.o_proj")')
    assert_near_miss(before, FuseQKV(), "linear at attn.o_proj: scope does not match '*.v_proj'", 2)


# -- values that escape the pattern -------------------------------------------------------------


class FuseLinearBiasAnyUse(FuseLinearBias):
    """FuseLinearBias without `_single_use`: the matcher itself must refuse escaping values."""

    name = "fuse-linear-bias-any-use"

    def pattern(self, op: PatternBuilder, x: Var, w: Var, b: Var) -> Any:
        return op.add(op.linear(x, w), b.where(param=True, rank=1))


def test_an_intermediate_value_read_outside_the_pattern_is_refused_with_a_reason():
    assert_near_miss("""
    graph @g(%x: f32[B,4]) -> (y: f32[B,8]) {
      param @w : f32[4,8]
      param @b : f32[8]
      %0 = linear(%x, @w) : f32[B,8] loc("proj")
      %1 = add(%0, @b) : f32[B,8] loc("proj")
      %2 = silu(%0) : f32[B,8] loc("act")
      %3 = mul(%1, %2) : f32[B,8]
      return %3
    }""", FuseLinearBiasAnyUse(),
        "intermediate result of linear at proj is also read by silu at act outside the pattern", 2)


def test_check_returning_false_is_a_refusal_without_a_reason():
    class Refuses(FuseLinearBias):
        def check(self, ctx: MatchContext, **bindings: Any) -> bool:
            return False

    assert_near_miss(LINEAR_PLUS_BIAS, Refuses(), "check: check() refused (no reason given)", 2)


def test_a_rewrite_may_return_a_graph_input_as_an_output_which_keeps_its_name():
    # reshape(reshape(x)) == x: the output `y` becomes the input itself, still named `y`.
    g = ir("""
    graph @g(%x: f32[B,24]) -> (y: f32[B,24]) {
      %0 = reshape(%x) {shape = [0, 2, 12]} : f32[B,2,12]
      %1 = reshape(%0) {shape = [0, 24]} : f32[B,24]
      return %1
    }""")
    apply_rules(g, FoldReshapeChain(), IdentityReshape())
    assert_ir(g, """
    graph @g(%x: f32[B,24]) -> (y: f32[B,24]) {
      return %x
    }""")
    assert g.output_names == ["y"]
