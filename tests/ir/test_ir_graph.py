"""The in-memory graph API: use lists stay exact through every mutation helper."""

from __future__ import annotations

import random

import pytest

import ernie_ir  # noqa: F401  (registers the op set)
from ernie_ir.ir import DType, Graph, GraphBuilder, Node, OpError, Param, Value, tensor
from ernie_ir.ir.verifier import verify_problems

F = DType.F32


def use_table(graph: Graph) -> dict[Value, list[tuple[Node, int]]]:
    """The use lists the node inputs imply, value by value."""
    expected: dict[Value, list[tuple[Node, int]]] = {}
    for node in graph:
        for i, v in enumerate(node.inputs):
            if v is not None:
                expected.setdefault(v, []).append((node, i))
    return expected


def assert_uses_exact(graph: Graph) -> None:
    """Every value's use list holds exactly the (node, index) pairs that read it."""
    expected = use_table(graph)
    values = set(graph.inputs) | set(graph.params.values())
    values |= {v for n in graph for v in n.outputs}
    values |= set(expected)
    for v in values:
        assert sorted(v.uses, key=lambda u: (id(u[0]), u[1])) == sorted(
            expected.get(v, []), key=lambda u: (id(u[0]), u[1])
        ), f"use list of {v} is not exact"


def chain() -> tuple[Graph, Value, list[Node]]:
    """x -> silu -> gelu -> softmax -> y, scopes a, b, c."""
    b = GraphBuilder("chain")
    x = b.input("x", tensor(F, "B", 4))
    with b.scope("a"):
        s = b.silu(x)
    with b.scope("b"):
        g = b.gelu(s)
    with b.scope("c"):
        y = b.softmax(g)
    b.output(y, name="y")
    return b.graph, x, list(b.graph)


def test_builder_records_uses_producers_and_scopes():
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, "B", 4))
    w = b.param("layer.w", tensor(F, 4, 4))
    with b.scope("layers"), b.scope("0"):
        y = b.linear(x, w)
    z = b.add(y, y)
    b.output(z, name="z")
    g = b.graph
    lin, add = list(g)
    assert lin.scope == "layers.0" and add.scope == ""
    assert x.uses == [(lin, 0)] and w.uses == [(lin, 1)]
    assert y.uses == [(add, 0), (add, 1)] and y.users == [add] and y.num_uses() == 2
    assert y.producer is lin and y.index == 0 and y.type == tensor(F, "B", 4)
    assert lin.input("weight") is w and lin.input("bias") is None
    assert g.outputs == [z] and z.name == "z"
    assert_uses_exact(g)
    assert verify_problems(g) == []


def test_trailing_absent_optional_inputs_are_dropped():
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, 4))
    bias = b.param("b", tensor(F, 4))
    y = b.layer_norm(x, None, None, eps=1e-5)
    z = b.layer_norm(x, None, bias, eps=1e-5)
    assert y.producer.inputs == (x,)
    assert z.producer.inputs == (x, None, bias)
    assert bias.uses == [(z.producer, 2)]


def test_a_required_input_cannot_be_absent():
    x = Value(tensor(F, 4), "x")
    with pytest.raises(OpError, match=r"op rms_norm: input weight is required"):
        Node("rms_norm", [x, None], {"eps": 1e-5})
    with pytest.raises(OpError, match=r"op linear: input x is required"):
        Node("linear", [None, x])
    assert x.uses == []  # a refused node leaves no use behind


def test_dropping_a_required_input_is_a_type_error_not_a_crash():
    _g, _x, (_silu, gelu, _softmax) = chain()
    gelu.set_input(0, None)
    with pytest.raises(OpError, match=r"op gelu takes \(x\) but got 0 inputs"):
        gelu.infer_types()


def test_set_input_moves_the_use_between_values():
    g, x, (silu, gelu, _softmax) = chain()
    s_out = silu.output
    gelu.set_input(0, x)
    assert s_out.uses == []
    assert x.uses == [(silu, 0), (gelu, 0)]
    assert gelu.inputs == (x,)
    assert_uses_exact(g)


def test_set_input_can_fill_and_clear_an_optional_slot():
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, 4))
    w = b.param("w", tensor(F, 4))
    bias = b.param("bias", tensor(F, 4))
    ln = b.layer_norm(x, eps=1e-5).producer
    ln.set_input(2, bias)
    assert ln.inputs == (x, None, bias) and bias.uses == [(ln, 2)]
    ln.set_input(1, w)
    assert ln.inputs == (x, w, bias)
    ln.set_input(2, None)
    ln.set_input(1, None)
    assert ln.inputs == (x,)
    assert w.uses == [] and bias.uses == []
    assert_uses_exact(b.graph)


def test_replace_all_uses_with_rewires_nodes_and_graph_outputs():
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, 4))
    s = b.silu(x)
    a = b.add(s, s)
    b.output(a, s, names=["sum", "act"])
    g = b.graph
    _silu, add = list(g)
    g2 = b.gelu(x)  # the replacement, appended after
    assert g.replace_all_uses_with(s, g2) == 3  # two node inputs + one graph output
    assert s.uses == []
    assert g2.uses == [(add, 0), (add, 1)]
    assert g.outputs == [a, g2]
    assert g.output_names == ["sum", "act"]  # the output keeps its interface name
    assert g.replace_all_uses_with(g2, g2) == 0
    assert_uses_exact(g)


def test_replace_all_uses_with_keeps_a_graph_input_name():
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, 4))
    s = b.silu(x)
    b.output(s, name="y")
    g = b.graph
    assert g.replace_all_uses_with(s, x) == 1
    assert g.outputs == [x] and x.name == "x" and g.output_names == ["y"]


def test_erase_refuses_while_an_output_is_used():
    g, _x, (silu, _gelu, softmax) = chain()
    with pytest.raises(ValueError, match=r"cannot erase <Node silu @ a>: output 0 is still used"):
        g.erase(silu)
    with pytest.raises(ValueError, match=r"output 0 is still used"):
        g.erase(softmax)  # used as the graph output only
    assert len(g) == 3


def test_erase_detaches_the_node_from_its_inputs():
    g, _x, (silu, gelu, softmax) = chain()
    g.replace_all_uses_with(gelu.output, silu.output)
    g.erase(gelu)
    assert list(g) == [silu, softmax]
    assert silu.output.uses == [(softmax, 0)]
    assert gelu.graph is None and gelu.inputs == ()
    assert (g.first, g.last, len(g)) == (silu, softmax, 2)
    assert_uses_exact(g)
    with pytest.raises(ValueError, match=r"is not in graph chain"):
        g.erase(gelu)


def test_force_erase_leaves_a_dangling_value_the_verifier_reports():
    g, _x, (silu, gelu, _softmax) = chain()
    g.erase(silu, force=True)
    assert silu.output.uses == [(gelu, 0)]  # the reader still points at it
    assert any("input x is not defined in this graph" in p for p in verify_problems(g))


def test_insert_before_and_after_keep_the_given_order():
    g, x, (silu, gelu, softmax) = chain()
    n1, n2 = Node("silu", [x]), Node("gelu", [x])
    g.insert_before(gelu, [n1, n2])
    assert list(g) == [silu, n1, n2, gelu, softmax]
    n3, n4 = Node("silu", [x]), Node("silu", [x])
    g.insert_after(softmax, [n3, n4])
    assert list(g) == [silu, n1, n2, gelu, softmax, n3, n4]
    assert g.last is n4
    n5 = Node("gelu", [x])
    g.insert_before(silu, n5)
    assert g.first is n5 and n5.next is silu and silu.prev is n5
    assert list(reversed(g)) == list(reversed([n5, silu, n1, n2, gelu, softmax, n3, n4]))
    assert len(g) == 8
    with pytest.raises(ValueError, match=r"already belongs to a graph"):
        g.append(n5)
    stranger = Node("silu", [x])
    with pytest.raises(ValueError, match=r"is not in graph"):
        g.insert_after(stranger, Node("silu", [x]))


def test_iteration_survives_erasing_the_current_node():
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, 4))
    keep = []
    for i in range(6):
        v = b.silu(x)
        if i % 2 == 0:
            keep.append(v)
    b.output(*keep, names=[f"y{i}" for i in range(len(keep))])
    g = b.graph
    visited = []
    for node in g:
        visited.append(node)
        if not node.output.uses and node.output not in g.outputs:
            g.erase(node)
    assert len(visited) == 6
    assert [n.output for n in g] == keep
    assert x.uses == [(v.producer, 0) for v in keep]
    assert_uses_exact(g)


def test_value_lookup_by_name_and_op():
    g, x, (_silu, gelu, softmax) = chain()
    assert g.value_by_name("x") is x
    assert g.value_by_name("y") is softmax.output
    assert g.nodes_by_op("gelu") == [gelu]
    with pytest.raises(KeyError):
        g.value_by_name("nope")


def test_params_cannot_be_declared_twice_or_removed_while_used():
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, 4))
    w = b.param("w", tensor(F, 4, 4))
    b.linear(x, w)
    with pytest.raises(ValueError, match=r"already has a param named 'w'"):
        b.param("w", tensor(F, 4, 4))
    with pytest.raises(ValueError, match=r"param w is still used by <Node linear>"):
        b.graph.remove_param("w")
    with pytest.raises(ValueError, match=r"already has an input named 'x'"):
        b.input("x", tensor(F, 4))
    assert isinstance(b.graph.params["w"], Param)


def test_topological_sort_restores_a_valid_order_after_a_shuffle():
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, 4))
    w = b.param("w", tensor(F, 4, 4))
    a = b.linear(x, w)
    c = b.silu(a)
    d = b.gelu(a)
    e = b.add(c, d)
    f = b.softmax(e)
    b.output(f, name="y")
    g = b.graph
    original = list(g)
    wiring = {n: n.inputs for n in original}
    rng = random.Random(0)
    for _ in range(20):
        shuffled = original[:]
        rng.shuffle(shuffled)
        for n in shuffled:  # relink in shuffled order, as a careless rewrite might
            g.erase(n, force=True)
        for n in shuffled:
            g.append(n)
            for i, v in enumerate(wiring[n]):
                n.set_input(i, v)
        assert list(g) == shuffled
        g.topological_sort()
        order = list(g)
        pos = {n: i for i, n in enumerate(order)}
        for n in order:
            for v in n.inputs:
                if v is not None and v.producer is not None:
                    assert pos[v.producer] < pos[n]
        assert verify_problems(g) == []
    assert_uses_exact(g)


def test_topological_sort_keeps_a_valid_order_unchanged():
    g, _x, nodes = chain()
    g.topological_sort()
    assert list(g) == nodes
    assert (g.first, g.last, len(g)) == (nodes[0], nodes[-1], 3)


def test_topological_sort_names_a_node_on_the_cycle():
    b = GraphBuilder("g")
    x = b.input("x", tensor(F, 4))
    with b.scope("downstream"):
        down = b.softmax(x)
    with b.scope("loop.a"):
        a = b.add(x, x)
    with b.scope("loop.b"):
        c = b.silu(a)
    g = b.graph
    a.producer.set_input(1, c)  # add reads silu, silu reads add
    down.producer.set_input(0, c)  # the first stuck node in order is downstream of the loop
    with pytest.raises(ValueError, match=r"graph has a cycle through <Node (add @ loop\.a|silu @ loop\.b)>"):
        g.topological_sort()


def test_topological_sort_ignores_producers_outside_the_graph():
    g, _x, (silu, gelu, softmax) = chain()
    g.erase(silu, force=True)  # gelu now reads a dangling value: not a cycle
    g.topological_sort()
    assert list(g) == [gelu, softmax]
