"""Graph invariants hold under failure, and the verifier checks use lists both ways.

Creating a node whose type rule refuses its inputs, or inserting a batch of
nodes one of which cannot be linked, must leave the graph and every use list
as they were (all or nothing). The verifier reports a use recorded on a value
that is no real input of a live node, as well as an input missing from its
value's use list.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import ernie_ir  # noqa: F401  (registers the op set)
from ernie_ir.ir import DType, GraphBuilder, Node, OpError, Param, Value, tensor
from ernie_ir.ir.verifier import verify_problems

F = DType.F32


def linear_graph() -> tuple[GraphBuilder, Value, Param]:
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, "B", 4))
    w = b.param("w", tensor(F, 4, 8))
    with b.scope("proj"):
        y = b.linear(x, w)
    b.output(y, name="y")
    return b, x, w


def test_a_node_whose_type_rule_raises_leaves_no_use_on_its_inputs():
    b, x, w = linear_graph()
    bad = b.graph.add_param(Param("bad", tensor(F, 5, 8)))
    uses_before = (x.uses, w.uses)
    with pytest.raises(OpError, match="do not match"):
        Node("linear", [x, bad])
    assert (x.uses, w.uses) == uses_before
    assert bad.uses == []


def test_a_builder_op_whose_type_rule_raises_leaves_the_graph_as_it_was():
    b, x, _w = linear_graph()
    nodes_before = b.graph.nodes
    with pytest.raises(OpError):
        b.linear(x, b.param("w2", tensor(F, 7, 8)))
    assert b.graph.nodes == nodes_before
    assert [n for n, _ in x.uses] == nodes_before
    assert b.graph.params["w2"].uses == []


def test_inserting_a_batch_with_a_node_already_in_a_graph_inserts_nothing():
    b, x, _w = linear_graph()
    g = b.graph
    (lin,) = g.nodes
    fresh = Node("silu", [x])
    with pytest.raises(ValueError, match="already belongs"):
        g.insert_before(lin, [fresh, lin])
    assert g.nodes == [lin] and fresh.graph is None and len(g) == 1
    with pytest.raises(ValueError, match="already belongs"):
        g.insert_after(lin, [fresh, lin])
    assert g.nodes == [lin] and fresh.graph is None and len(g) == 1
    g.insert_before(lin, fresh)  # the node itself is still insertable
    assert g.nodes == [fresh, lin]


def test_the_verifier_reports_a_use_of_a_node_outside_the_graph():
    b, x, _w = linear_graph()
    Node("silu", [x])  # built but never inserted: its use on x is stale
    assert verify_problems(b.graph) == [
        "graph input x: use list records input x of silu, which is in no graph (erased, or never inserted)"]


def test_the_verifier_reports_a_node_result_read_by_another_graph():
    b, _x, _w = linear_graph()
    (lin,) = b.graph.nodes
    other = GraphBuilder("other")
    other.silu(lin.output)  # a node of `other` reads a result of `g`
    assert verify_problems(b.graph) == [
        "node #0 linear at proj: output 0: use list records input x of silu in graph other: a "
        "node result read by another graph"]


def test_the_verifier_reports_a_use_that_is_not_a_real_input():
    b, _x, w = linear_graph()
    (lin,) = b.graph.nodes
    w._uses[(lin, 0)] = None  # says linear's input 0 reads w; it reads x
    assert verify_problems(b.graph) == [
        "param @w: use list records input x of node #0 linear at proj, which reads another value"]


def test_the_verifier_reports_an_input_missing_from_the_use_list():
    b, x, _w = linear_graph()
    (_lin,) = b.graph.nodes
    x._uses.clear()
    assert verify_problems(b.graph) == [
        "node #0 linear at proj: input x is missing from its value's use list"]


def test_an_erased_reader_leaves_no_use_behind():
    b, x, _w = linear_graph()
    g = b.graph
    s = b.silu(x)
    g.erase(s.producer)
    assert verify_problems(g) == []
    assert len(x.uses) == 1


@pytest.mark.slow
def test_the_verifier_does_not_import_networkx():
    code = ("import sys, ernie_ir.ir.verifier as v; "
            "assert 'networkx' not in sys.modules, 'networkx imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_cycle_through_a_long_chain_is_found_without_recursion():
    b = GraphBuilder("chain")
    x = b.input("x", tensor(F, "B", 4))
    v = x
    for _ in range(5000):  # deeper than Python's recursion limit
        v = b.silu(v)
    b.output(v, name="y")
    first = b.graph.first
    assert first is not None
    first.set_input(0, v)  # the first silu reads the last: one cycle through all of them
    problems = verify_problems(b.graph)
    assert problems[-1].startswith("graph has a cycle: silu -> silu")
    assert problems[-1].count("silu") == 5000
