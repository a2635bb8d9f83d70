"""The pattern language, construct by construct, as docs/pass-authoring.md describes it.

Each test states a small graph, a rule using one construct, and what must
(and must not) match, with the tracer's reason for a refusal. Together they
pin every `.where` constraint, attribute constraints and bindings, `_scope`,
`_single_use`, `_outputs`, optional inputs, constants, alternatives,
commuted inputs, multi-root rules, the scope a rewrite's nodes inherit, and
`rewrite_pass` with options and `invalidates`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _passes_testkit import apply_rules, explain_one, ir, registered, with_weights

from ernie_ir.ir import DType, GraphBuilder, Param, Value, f32, tensor
from ernie_ir.ir.weights import ArraySource
from ernie_ir.passes import (
    MatchContext,
    MatchResult,
    PassOptions,
    PatternBuilder,
    RewriteRule,
    RuleSet,
    Var,
    rewrite_pass,
    run_pipeline,
)
from ernie_ir.passes.infra.pipeline import load_pipeline
from ernie_ir.passes.infra.rewrite import RewritePass
from ernie_ir.runtime import run_graph


def matched_scopes(graph_text: str, rule: RewriteRule) -> list[str]:
    return [m.nodes[0].scope for m in RuleSet([rule]).find(ir(graph_text))]


def reason(graph_text: str, rule: RewriteRule) -> str:
    trace = explain_one(ir(graph_text), rule)
    assert trace.matches == 0 and trace.best is not None, trace.summary()
    return trace.best.reason


class SiluOf(RewriteRule):
    """silu(x) with x constrained by `where`: a rule per test, built from keyword arguments."""

    name = "silu-of"

    def __init__(self, **where: Any) -> None:
        self.where_args = where

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        return op.silu(x.where(**self.where_args))

    def rewrite(self, op: GraphBuilder, x: Value) -> Value:
        return op.silu(x)


MIXED = """
graph @g(%x: f32[B,8], %h: bf16[B,8]) -> (a: f32[B,8], b: bf16[B,8], c: f32[8], d: f32[B,8]) {
  param @w : f32[8]
  %0 = silu(%x) : f32[B,8] loc("act.f32")
  %1 = silu(%h) : bf16[B,8] loc("act.bf16")
  %2 = silu(@w) : f32[8] loc("act.param")
  %3 = silu(%0) : f32[B,8] loc("act.twice")
  return %0, %1, %2, %3
}
"""


# -- .where constraints ------------------------------------------------------------------------

@pytest.mark.parametrize(("where", "scopes"), [
    ({"dtype": DType.BF16}, ["act.bf16"]),
    ({"rank": 1}, ["act.param"]),
    ({"param": True}, ["act.param"]),
    ({"param": False}, ["act.f32", "act.bf16", "act.twice"]),
    ({"predicate": lambda v: v.name == "h"}, ["act.bf16"]),
    ({"dtype": DType.F32, "rank": 2}, ["act.f32", "act.twice"]),
])
def test_where_constraints_select_values(where: dict[str, Any], scopes: list[str]):
    assert matched_scopes(MIXED, SiluOf(**where)) == scopes


def test_where_single_use_counts_every_reader():
    # %0 is read by silu @ act.twice and is a graph output's value, but it has one reader node
    assert matched_scopes(MIXED, SiluOf(single_use=True)) == ["act.f32", "act.bf16", "act.param",
                                                              "act.twice"]
    two_readers = MIXED.replace("%3 = silu(%0)", "%3 = silu(%x)")
    assert matched_scopes(two_readers, SiluOf(single_use=True)) == ["act.bf16", "act.param"]
    assert reason("""
    graph @g(%x: f32[B,8]) -> (a: f32[B,8], b: f32[B,8]) {
      %0 = silu(%x) : f32[B,8]
      %1 = silu(%x) : f32[B,8]
      return %0, %1
    }""", SiluOf(single_use=True)) == "variable x must have a single use, has 2"


@pytest.mark.parametrize(("where", "why"), [
    ({"dtype": DType.I32}, "variable x must be i32, found f32[B,8]"),
    ({"rank": 3}, "variable x must have rank 3, found f32[B,8]"),
    ({"predicate": lambda v: False}, "variable x fails its predicate"),
])
def test_where_refusals_name_the_constraint(where: dict[str, Any], why: str):
    assert reason(MIXED, SiluOf(**where)) == why


def test_param_constraint_names_the_param_it_refused():
    assert reason("""
    graph @g(%x: f32[8]) -> (a: f32[8]) {
      param @w : f32[8]
      %0 = silu(@w) : f32[8] loc("act")
      %1 = mul(%0, %x) : f32[8]
      return %1
    }""", SiluOf(param=False)) == "variable x must not be a param (found @w)"


# -- constants -------------------------------------------------------------------------------------


class DropMulByOne(RewriteRule):
    """x * 1 -> x (the 1 a param whose every element is 1)."""

    name = "drop-mul-by-one"
    commute = True

    def pattern(self, op: PatternBuilder, x: Var, one: Var) -> Any:
        return op.mul(x, one.where(value=1.0))

    def rewrite(self, op: GraphBuilder, x: Value, one: Value) -> Value:
        return x


def scaled(values: np.ndarray) -> Any:
    b = GraphBuilder("g")
    x = b.input("x", tensor(f32, "B", 4))
    s = b.param("s", source=ArraySource(values.astype(np.float32)))
    b.output(b.mul(x, s), name="y")
    return b.graph


def test_a_constant_matches_a_param_whose_every_element_equals_it():
    g = scaled(np.ones(4))
    assert apply_rules(g, DropMulByOne()) == 1
    assert len(g) == 0 and g.outputs == g.inputs and g.params == {}


@pytest.mark.parametrize(("values", "why"), [
    (np.array([1.0, 1.0, 2.0, 1.0]), "variable one must be the constant 1.0 (@s holds other values)"),
    (None, "variable one must be the constant 1.0 (@s has no data)"),
])
def test_a_constant_refuses_other_values_and_params_without_data(values: Any, why: str):
    g = scaled(np.ones(4))
    if values is None:
        g.params["s"].source = None
    else:
        g.params["s"].set_data(values.astype(np.float32))
    trace = explain_one(g, DropMulByOne())
    assert trace.matches == 0 and trace.best is not None
    assert trace.best.reason == why


def test_a_constant_may_be_an_array_it_broadcasts_to():
    class MulByRamp(DropMulByOne):
        def pattern(self, op: PatternBuilder, x: Var, one: Var) -> Any:
            return op.mul(x, one.where(value=np.arange(4)))

    assert apply_rules(scaled(np.arange(4)), MulByRamp()) == 1
    assert apply_rules(scaled(np.ones(4)), MulByRamp()) == 0


# -- attributes ------------------------------------------------------------------------------------


class SoftmaxAxis(RewriteRule):
    name = "softmax-axis"

    def __init__(self, axis: Any) -> None:
        self.axis = axis

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        return op.softmax(x, axis=self.axis)

    def rewrite(self, op: GraphBuilder, x: Value, **attrs: Any) -> Value:
        return op.softmax(x, axis=attrs.get("axis", -1))


SOFTMAXES = """
graph @g(%x: f32[B,8]) -> (a: f32[B,8], b: f32[B,8]) {
  %0 = softmax(%x) {axis = -1} : f32[B,8] loc("last")
  %1 = softmax(%x) {axis = 0} : f32[B,8] loc("first")
  return %0, %1
}
"""


def test_attribute_constraints_a_value_a_predicate_or_a_binding():
    assert matched_scopes(SOFTMAXES, SoftmaxAxis(0)) == ["first"]
    assert matched_scopes(SOFTMAXES, SoftmaxAxis(lambda a: a < 0)) == ["last"]
    (m0, m1) = RuleSet([SoftmaxAxis(PatternBuilder().attr("axis"))]).find(ir(SOFTMAXES))
    assert (m0.bindings["axis"], m1.bindings["axis"]) == (-1, 0)
    assert reason(SOFTMAXES.replace("axis = 0", "axis = -1"), SoftmaxAxis(0)) == \
        "softmax at last: attribute axis is -1, pattern wants 0"


def test_an_unknown_attribute_is_an_error_when_the_pattern_is_built():
    class Typo(SoftmaxAxis):
        def pattern(self, op: PatternBuilder, x: Var) -> Any:
            return op.softmax(x, axes=1)

    with pytest.raises(TypeError, match=r"pattern softmax: unknown attribute\(s\) \['axes'\]"):
        Typo(0).compiled()


# -- optional inputs -------------------------------------------------------------------------------


class AnyLinear(RewriteRule):
    """linear(x, w[, b]): a bias that may be absent binds None."""

    name = "any-linear"

    def pattern(self, op: PatternBuilder, x: Var, w: Var, b: Var) -> Any:
        return op.linear(x, w, b.where(optional=True, param=True))

    def rewrite(self, op: GraphBuilder, x: Value, w: Value, b: Value | None) -> Value:
        return op.linear(x, w, b)


LINEARS = """
graph @g(%x: f32[B,4]) -> (a: f32[B,8], b: f32[B,8], c: f32[B,8]) {
  param @w : f32[4,8]
  param @b : f32[8]
  %0 = linear(%x, @w) : f32[B,8] loc("plain")
  %1 = linear(%x, @w, @b) : f32[B,8] loc("biased")
  %2 = silu(@b) : f32[8]
  %3 = linear(%x, @w, %2) : f32[B,8] loc("computed_bias")
  return %0, %1, %3
}
"""


def test_an_optional_input_matches_present_or_absent_and_binds_none_when_absent():
    found = RuleSet([AnyLinear()]).find(ir(LINEARS))
    assert [m.nodes[0].scope for m in found] == ["plain", "biased"]
    assert found[0].bindings["b"] is None and isinstance(found[1].bindings["b"], Param)


def test_a_present_input_the_pattern_lacks_and_an_absent_one_it_needs_are_refused():
    class NoBias(AnyLinear):
        def pattern(self, op: PatternBuilder, x: Var, w: Var, b: Var) -> Any:
            return op.linear(x, w)

    class NeedsBias(AnyLinear):
        def pattern(self, op: PatternBuilder, x: Var, w: Var, b: Var) -> Any:
            return op.linear(x, w, b)

    assert matched_scopes(LINEARS, NoBias()) == ["plain"]
    assert matched_scopes(LINEARS, NeedsBias()) == ["biased", "computed_bias"]
    only_biased = """
    graph @g(%x: f32[B,4]) -> (a: f32[B,8]) {
      param @w : f32[4,8]
      param @b : f32[8]
      %0 = linear(%x, @w, @b) : f32[B,8] loc("biased")
      return %0
    }"""
    assert reason(only_biased, NoBias()) == "linear at biased: input bias is present but the pattern has none"
    assert reason("""
    graph @g(%x: f32[B,4]) -> (a: f32[B,8]) {
      param @w : f32[4,8]
      %0 = linear(%x, @w) : f32[B,8] loc("plain")
      return %0
    }""", NeedsBias()) == "linear at plain: input bias is absent but the pattern needs variable b"


# -- alternatives ------------------------------------------------------------------------------


class LinearThenAct(RewriteRule):
    """either(silu, gelu) of a linear -> the linear with a tag saying which activation it was."""

    name = "linear-then-act"

    def pattern(self, op: PatternBuilder, x: Var, w: Var) -> Any:
        lin = op.linear(x, w, _single_use=True)
        return op.mul(op.either(op.silu(lin), op.gelu(lin), _tag="act"), x)

    def rewrite(self, op: GraphBuilder, x: Value, w: Value, act: int) -> Value:
        lin = op.linear(x, w)
        return op.mul(op.silu(lin) if act == 0 else op.gelu(lin), x)


ACTS = """
graph @g(%x: f32[B,4]) -> (a: f32[B,4], b: f32[B,4], c: f32[B,4]) {
  param @w : f32[4,4]
  %0 = linear(%x, @w) : f32[B,4] loc("s")
  %1 = silu(%0) : f32[B,4] loc("s")
  %2 = mul(%1, %x) : f32[B,4] loc("s")
  %3 = linear(%x, @w) : f32[B,4] loc("g")
  %4 = gelu(%3) {approximate = "none"} : f32[B,4] loc("g")
  %5 = mul(%4, %x) : f32[B,4] loc("g")
  %6 = linear(%x, @w) : f32[B,4] loc("r")
  %7 = softmax(%6) {axis = -1} : f32[B,4] loc("r")
  %8 = mul(%7, %x) : f32[B,4] loc("r")
  return %2, %5, %8
}
"""


def test_alternatives_match_either_sub_pattern_and_tag_which():
    found = RuleSet([LinearThenAct()]).find(ir(ACTS))
    assert [(m.nodes[0].scope, m.bindings["act"]) for m in found] == [("s", 0), ("g", 1)]
    assert [len(m.nodes) for m in found] == [3, 3]
    assert LinearThenAct().size == 3


def test_when_no_alternative_matches_the_closest_is_reported():
    # In block g the gelu alternative gets furthest: gelu and linear match, the bias is absent.
    class SiluOrBiasedGelu(LinearThenAct):
        def pattern(self, op: PatternBuilder, x: Var, w: Var, b: Var) -> Any:
            return op.mul(op.either(op.silu(op.linear(x, w)), op.gelu(op.linear(x, w, b))), x)

    no_silu = ACTS.replace('%1 = silu(%0) : f32[B,4] loc("s")',
                           '%1 = softmax(%0) {axis = -1} : f32[B,4] loc("s")')
    trace = explain_one(ir(no_silu), SiluOrBiasedGelu())
    assert trace.matches == 0 and trace.best is not None
    assert trace.best.node.scope == "g" and (trace.best.matched, trace.best.total) == (3, 3)
    assert trace.best.reason == ("no alternative matches; the closest: linear at g: input bias is "
                                 "absent but the pattern needs variable b")


def test_variables_only_some_alternatives_use_bind_none_for_the_others():
    class BiasOrNot(RewriteRule):
        name = "bias-or-not"

        def pattern(self, op: PatternBuilder, x: Var, w: Var, b: Var) -> Any:
            return op.silu(op.either(op.add(op.linear(x, w), b.where(param=True)), op.linear(x, w)),
                           _scope="re:(?!fused).*")  # not what the rewrite made

        def rewrite(self, op: GraphBuilder, x: Value, w: Value, b: Value | None) -> Value:
            with op.at_scope("fused"):
                return op.silu(op.linear(x, w, b))

    g = with_weights(ir("""
    graph @g(%x: f32[B,4]) -> (a: f32[B,8], b: f32[B,8]) {
      param @w : f32[4,8]
      param @b : f32[8]
      %0 = linear(%x, @w) : f32[B,8] loc("one")
      %1 = add(%0, @b) : f32[B,8] loc("one")
      %2 = silu(%1) : f32[B,8] loc("one")
      %3 = linear(%x, @w) : f32[B,8] loc("two")
      %4 = silu(%3) : f32[B,8] loc("two")
      return %2, %4
    }"""))
    found = RuleSet([BiasOrNot()]).find(g)
    assert [m.bindings["b"] is None for m in found] == [False, True]
    inputs = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}
    before = run_graph(g, inputs)
    assert apply_rules(g, BiasOrNot()) == 2
    assert [n.op for n in g] == ["linear", "silu", "linear", "silu"]
    after = run_graph(g, inputs)
    for k in before:
        np.testing.assert_allclose(after[k], before[k], rtol=1e-6, atol=1e-6)


def test_alternatives_are_inputs_not_pattern_outputs():
    class Bad(RewriteRule):
        name = "bad"

        def pattern(self, op: PatternBuilder, x: Var) -> Any:
            return op.either(op.silu(x), op.gelu(x))

        def rewrite(self, op: GraphBuilder, x: Value) -> Value:
            return x

    with pytest.raises(TypeError, match="pattern must return op results"):
        Bad().compiled()
    with pytest.raises(TypeError, match="at least two"):
        PatternBuilder().either(Var("x"))


# -- scopes and single use -----------------------------------------------------------------------


def test_scope_of_every_pattern_node_and_single_use_of_results():
    class ScopedBias(RewriteRule):
        name = "scoped-bias"

        def pattern(self, op: PatternBuilder, x: Var, w: Var, b: Var) -> Any:
            return op.add(op.linear(x, w, _scope="re:.*\\.up", _single_use=True), b, _scope="*.up")

        def rewrite(self, op: GraphBuilder, x: Value, w: Value, b: Value) -> Value:
            return op.linear(x, w, b)

    text = """
    graph @g(%x: f32[B,4]) -> (a: f32[B,8], b: f32[B,8]) {
      param @w : f32[4,8]
      param @b : f32[8]
      %0 = linear(%x, @w) : f32[B,8] loc("mlp.up")
      %1 = add(%0, @b) : f32[B,8] loc("mlp.up")
      %2 = linear(%x, @w) : f32[B,8] loc("mlp.down")
      %3 = add(%2, @b) : f32[B,8] loc("mlp.up")
      return %1, %3
    }"""
    assert matched_scopes(text, ScopedBias()) == ["mlp.up"]
    assert "linear at mlp.down: scope does not match 're:.*\\\\.up'" in reason(
        text.replace('loc("mlp.up")\n      %2', 'loc("mlp.x")\n      %2'), ScopedBias())


# -- several outputs -------------------------------------------------------------------------------


class SplitHalves(RewriteRule):
    """Both results of one split (`_outputs=2`) -> the same split, halves swapped twice."""

    name = "split-halves"

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        lo, hi = op.split(x, axis=-1, sizes=op.attr("sizes"), _outputs=2)
        return op.silu(lo), op.gelu(hi, approximate="none")

    def rewrite(self, op: GraphBuilder, x: Value, sizes: tuple[int, ...]) -> Any:
        lo, hi = op.split(x, axis=-1, sizes=sizes)
        return op.silu(lo), op.gelu(hi, approximate="tanh")

    def check(self, ctx: MatchContext, x: Value, sizes: tuple[int, ...]) -> MatchResult:
        return ctx.ok() if len(sizes) == 2 else ctx.fail(f"{len(sizes)} pieces")


def test_a_pattern_may_use_several_results_of_one_node_and_return_several_values():
    g = ir("""
    graph @g(%x: f32[B,8]) -> (a: f32[B,4], b: f32[B,4]) {
      %0, %1 = split(%x) {axis = -1, sizes = [4, 4]} : f32[B,4], f32[B,4]
      %2 = silu(%0) : f32[B,4] loc("lo")
      %3 = gelu(%1) {approximate = "none"} : f32[B,4] loc("hi")
      return %2, %3
    }""")
    (m,) = RuleSet([SplitHalves()]).find(g)
    assert [n.op for n in m.nodes] == ["silu", "gelu", "split"]
    assert apply_rules(g, SplitHalves()) == 1
    assert [(n.op, getattr(n.attrs, "approximate", None)) for n in g] == [
        ("split", None), ("silu", None), ("gelu", "tanh")]


# -- the scope a rewrite's nodes get -----------------------------------------------------------


def test_rewritten_nodes_inherit_the_root_scope_unless_the_rewrite_says_otherwise():
    class Rescope(RewriteRule):
        name = "rescope"

        def pattern(self, op: PatternBuilder, x: Var) -> Any:
            return op.silu(op.gelu(x, _scope="inner"), _scope="outer")

        def rewrite(self, op: GraphBuilder, x: Value) -> Value:
            g = op.gelu(x)                    # the root's scope: "outer"
            with op.at_scope("outer.fused"):  # or any scope the rewrite names
                return op.silu(g)

    g = ir("""
    graph @g(%x: f32[B,8]) -> (y: f32[B,8]) {
      %0 = gelu(%x) {approximate = "none"} : f32[B,8] loc("inner")
      %1 = silu(%0) : f32[B,8] loc("outer")
      return %1
    }""")
    assert apply_rules(g, Rescope()) == 1
    assert [(n.op, n.scope) for n in g] == [("gelu", "outer"), ("silu", "outer.fused")]


# -- rewrite_pass: options and invalidated properties -------------------------------------------


class ScaleOptions(PassOptions):
    factor: float = 2.0


class ScaleSilu(RewriteRule):
    """silu(x) -> silu(x) * factor  (a rule configured by its pass's options)"""

    name = "scale-silu"

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        return op.silu(x, _scope="re:(?!scaled).*")

    def rewrite(self, op: GraphBuilder, x: Value) -> Value:
        s = op.param(f"scale.{len(op.graph.params)}",
                     source=ArraySource(np.full(x.shape[-1], self.factor, np.float32)))
        with op.at_scope("scaled"):
            return op.mul(op.silu(x), s)


ScaleSiluPass = rewrite_pass("scale-silu", "Multiply every activation by a factor.",
                             lambda o: [ScaleSilu(o.factor)], options=ScaleOptions,
                             invalidates=("fused",))


def silu_graph() -> Any:
    b = GraphBuilder("g")
    x = b.input("x", tensor(f32, 2, 4))
    b.output(b.silu(x), name="y")
    b.graph.metadata["properties"] = ["fused", "quantized"]
    return b.graph


def test_rewrite_pass_builds_its_rules_from_its_options():
    assert issubclass(ScaleSiluPass, RewritePass) and ScaleSiluPass.Options is ScaleOptions
    assert [r.factor for r in ScaleSiluPass.rules] == [2.0]  # the defaults' rules (explain, listings)
    assert [r.factor for r in ScaleSiluPass({"factor": 3.0}).active_rules()] == [3.0]
    x = np.ones((2, 4), np.float32)
    with registered(ScaleSiluPass):
        g = silu_graph()
        result = run_pipeline(g, "scale-silu{factor=3.0}")
        assert result.stats["1:scale-silu"] == {"scale-silu": 1}
        np.testing.assert_allclose(run_graph(g, {"x": x})["y"], 3.0 * x / (1 + np.exp(-x)), rtol=1e-6)
        assert str(load_pipeline("scale-silu{factor=3.0}")) == "scale-silu{factor=3.0}"


def test_rewrite_pass_declares_what_it_invalidates():
    assert ScaleSiluPass.invalidates == frozenset({"fused"})
    with registered(ScaleSiluPass):
        g = silu_graph()
        run_pipeline(g, "scale-silu")
    from ernie_ir.passes.infra.base import graph_properties

    assert "fused" not in graph_properties(g) and "quantized" in graph_properties(g)


def test_rewrite_pass_refuses_a_bad_option_and_a_non_rule():
    from ernie_ir.passes import PipelineError

    with pytest.raises(PipelineError, match="bad option"):
        ScaleSiluPass({"factor": "big"})
    with pytest.raises(TypeError, match="is not a RewriteRule"):
        rewrite_pass("x", "y", [object()])  # type: ignore[list-item]
