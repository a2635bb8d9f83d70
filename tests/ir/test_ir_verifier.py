"""The verifier reports every broken invariant, naming node position, op, scope and problem."""

from __future__ import annotations

import pytest

import ernie_ir  # noqa: F401  (registers the op set)
from ernie_ir.ir import DType, Graph, GraphBuilder, Node, Param, Value, VerificationError, tensor
from ernie_ir.ir.verifier import verify, verify_problems

F = DType.F32


def valid() -> Graph:
    """x -> linear(w) @ proj -> silu @ act -> softmax @ head -> y"""
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, "B", 4))
    w = b.param("w", tensor(F, 4, 4))
    with b.scope("proj"):
        h = b.linear(x, w)
    with b.scope("act"):
        a = b.silu(h)
    with b.scope("head"):
        y = b.softmax(a)
    b.output(y, name="y")
    return b.graph


def test_a_valid_graph_has_no_problems():
    g = valid()
    assert verify_problems(g) == []
    verify(g)  # does not raise


def test_use_before_definition():
    g = valid()
    lin, silu, softmax = g.nodes
    g.erase(softmax, force=True)
    g.insert_before(lin, softmax)
    softmax.set_input(0, silu.output)
    assert verify_problems(g) == [
        "node #0 softmax at head: input x is used before its definition by silu at act",
    ]


def test_a_cycle_is_named_with_the_ops_and_scopes_on_it():
    g = valid()
    lin, _silu, softmax = g.nodes
    lin.set_input(0, softmax.output)  # linear reads softmax, which reads silu, which reads linear
    problems = verify_problems(g)
    assert problems[0] == "node #0 linear at proj: input x is used before its definition by softmax at head"
    cycle = problems[-1]
    assert cycle.startswith("graph has a cycle: ")
    assert set(cycle.removeprefix("graph has a cycle: ").split(" -> ")) == {
        "linear@proj", "silu@act", "softmax@head"}
    with pytest.raises(VerificationError, match=r"^node #0 linear at proj: .* \(and 1 more\)$") as info:
        verify(g)
    assert info.value.problems == problems


def test_wrong_output_type():
    g = valid()
    silu = g.nodes[1]
    silu.outputs[0].type = tensor(DType.BF16, "B", 4)
    problems = verify_problems(g)
    assert problems == [
        "node #1 silu at act: outputs are typed bf16[B,4] but the op produces f32[B,4]",
        # softmax's rule follows its (now bf16) input, so its declared f32 disagrees too
        "node #2 softmax at head: outputs are typed f32[B,4] but the op produces bf16[B,4]",
    ]


def test_inputs_the_type_rule_refuses_are_reported_not_raised():
    g = valid()
    lin = g.nodes[0]
    lin.set_input(1, Param("v", tensor(F, 8, 4)))
    g.add_param(lin.inputs[1])
    problems = verify_problems(g)
    assert "node #0 linear at proj: linear: x's last dim and weight's in_features do not match (4 vs 8)" \
        in problems
    assert "param @w is never used (remove it or use it)" in problems


def test_unused_param():
    g = valid()
    g.add_param(Param("spare", tensor(F, 4)))
    assert verify_problems(g) == ["param @spare is never used (remove it or use it)"]


def test_param_registered_under_another_name():
    g = valid()
    g.params["alias"] = g.params.pop("w")
    assert verify_problems(g) == ["param registered as 'alias' is named 'w'"]


def test_undeclared_param():
    g = valid()
    lin = g.nodes[0]
    lin.set_input(1, Param("ghost", tensor(F, 4, 4)))
    assert verify_problems(g) == [
        "node #0 linear at proj: input weight reads param @ghost, which the graph does not declare",
        "param @w is never used (remove it or use it)",
    ]


def test_dangling_value_of_an_erased_node():
    g = valid()
    g.erase(g.nodes[1], force=True)  # silu goes, softmax still reads its output
    assert verify_problems(g) == [
        "node #1 softmax at head: input x is not defined in this graph "
        "(its producer was erased or it belongs to another graph)",
    ]


def test_value_of_another_graph():
    g, other = valid(), valid()
    g.nodes[2].set_input(0, other.inputs[0])
    assert verify_problems(g) == [
        "node #2 softmax at head: input x is not defined in this graph "
        "(its producer was erased or it belongs to another graph)",
    ]


def test_output_not_defined():
    g = valid()
    stray = Value(tensor(F, "B", 4), "stray")
    g.add_output(stray, "stray")
    assert verify_problems(g) == ["output 1 (stray) is not defined in this graph"]


def test_outputs_and_names_must_pair_up():
    g = valid()
    g.outputs.append(g.outputs[0])
    assert verify_problems(g) == ["graph has 2 outputs but 1 output names", "output 1 has no name"]


def test_output_of_an_erased_node():
    g = valid()
    softmax = g.nodes[2]
    g.erase(softmax, force=True)
    assert verify_problems(g) == ["output 0 (y) is not defined in this graph"]


def test_unnamed_output():
    g = valid()
    g.output_names[0] = ""
    assert verify_problems(g) == ["output 0 has no name"]


def test_duplicate_input_names():
    g = valid()
    g.inputs.append(Value(tensor(F, 4), "x"))
    assert verify_problems(g) == ["graph inputs have duplicate names: ['x', 'x']"]


def test_a_use_list_that_lost_an_entry():
    g = valid()
    silu = g.nodes[1]
    silu.inputs[0]._uses.clear()
    assert verify_problems(g) == ["node #1 silu at act: input x is missing from its value's use list"]


def test_a_node_without_a_required_input():
    g = valid()
    silu = g.nodes[1]
    silu.set_input(0, None)
    assert verify_problems(g) == ["node #1 silu at act: op silu takes (x) but got 0 inputs"]


def test_a_node_linked_from_another_graph():
    g = valid()
    stranger = Node("silu", [g.inputs[0]], scope="far")
    other = Graph("other")
    other.append(stranger)
    # splice it into g's list without going through g's helpers
    last = g.last
    last._next, stranger._prev = stranger, last
    g._tail = stranger
    g._count += 1
    assert verify_problems(g) == ["node #3 silu at far: is linked into the graph but belongs to another"]


def test_every_problem_is_reported_at_once():
    g = valid()
    _lin, silu, softmax = g.nodes
    g.add_param(Param("spare", tensor(F, 4)))
    silu.outputs[0].type = tensor(F, "B", 5)
    g.erase(softmax, force=True)
    problems = verify_problems(g)
    assert problems == [
        "node #1 silu at act: outputs are typed f32[B,5] but the op produces f32[B,4]",
        "param @spare is never used (remove it or use it)",
        "output 0 (y) is not defined in this graph",
    ]
    with pytest.raises(VerificationError) as info:
        verify(g)
    assert str(info.value) == problems[0] + " (and 2 more)"
