"""The verifier: checks every invariant of a graph and reports all violations.

Checked: nodes belong to the graph; every input is a graph input, a declared
param or an output of an earlier node (SSA, defined before use, which also
rules out cycles; a cycle is named as such); use lists match the inputs;
output types equal what each op's type rule infers; params are used and
registered under their own names; graph outputs are defined and named.
Each message names the node (position and op), its scope and the problem.
"""

from __future__ import annotations

import networkx as nx

from .errors import ErnieIRError, VerificationError
from .graph import Graph, Node, Param, Value


def _where(pos: int, node: Node) -> str:
    scope = f" at {node.scope}" if node.scope else ""
    return f"node #{pos} {node.op}{scope}"


def _has_cycle(graph: Graph) -> list[Node] | None:
    g = nx.DiGraph()
    for n in graph:
        g.add_node(n)
        for v in n.inputs:
            if v is not None and v.producer is not None and v.producer.graph is graph:
                g.add_edge(v.producer, n)
    try:
        return [u for u, _ in nx.find_cycle(g)]
    except nx.NetworkXNoCycle:
        return None


def verify_problems(graph: Graph) -> list[str]:
    """Every invariant violation, as messages (empty for a valid graph)."""
    problems: list[str] = []
    defined: set[Value] = set(graph.inputs)
    names = [v.name for v in graph.inputs]
    if len(set(names)) != len(names):
        problems.append(f"graph inputs have duplicate names: {names}")
    for name, p in graph.params.items():
        if p.name != name:
            problems.append(f"param registered as {name!r} is named {p.name!r}")
        defined.add(p)
    out_of_order = False
    for pos, node in enumerate(graph):
        where = _where(pos, node)
        if node.graph is not graph:
            problems.append(f"{where}: is linked into the graph but belongs to another")
        for i, v in enumerate(node.inputs):
            if v is None:
                continue
            label = node.opdef.input_name(i)
            if (node, i) not in v._uses:
                problems.append(f"{where}: input {label} is missing from its value's use list")
            if v in defined:
                continue
            if isinstance(v, Param):
                problems.append(f"{where}: input {label} reads param @{v.name}, which the graph "
                                "does not declare")
            elif v.producer is not None and v.producer.graph is graph:
                out_of_order = True
                problems.append(f"{where}: input {label} is used before its definition by "
                                f"{v.producer.op}"
                                f"{' at ' + v.producer.scope if v.producer.scope else ''}")
            else:
                problems.append(f"{where}: input {label} is not defined in this graph "
                                "(its producer was erased or it belongs to another graph)")
        for j, v in enumerate(node.outputs):
            if v.producer is not node or v.index != j:
                problems.append(f"{where}: output {j} does not point back to its node")
        try:
            expected = node.infer_types()
        except ErnieIRError as e:
            problems.append(f"{where}: {e}")
        else:
            got = [v.type for v in node.outputs]
            if expected != got:
                problems.append(
                    f"{where}: outputs are typed {', '.join(map(str, got))} but the op produces "
                    f"{', '.join(map(str, expected))}"
                )
        defined.update(node.outputs)
    if out_of_order:
        cycle = _has_cycle(graph)
        if cycle is not None:
            problems.append("graph has a cycle: " + " -> ".join(
                f"{n.op}{'@' + n.scope if n.scope else ''}" for n in cycle))
    for name, p in graph.params.items():
        if not any(u.graph is graph for u, _ in p._uses):
            problems.append(f"param @{name} is never used (remove it or use it)")
    names = graph.output_names
    if len(names) != len(graph.outputs):
        problems.append(f"graph has {len(graph.outputs)} outputs but {len(names)} output names")
    elif len(set(names)) != len(names):
        problems.append(f"graph outputs have duplicate names: {names}")
    for i, v in enumerate(graph.outputs):
        name = names[i] if i < len(names) else ""
        if v not in defined:
            problems.append(f"output {i} ({name or v.name}) is not defined in this graph")
        if not name:
            problems.append(f"output {i} has no name")
    return problems


def verify(graph: Graph) -> None:
    """Raise VerificationError listing every problem, or return quietly."""
    problems = verify_problems(graph)
    if problems:
        raise VerificationError(problems)
