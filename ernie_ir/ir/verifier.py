"""The verifier: checks every invariant of a graph and reports all violations.

Checked: nodes belong to the graph; every input is a graph input, a declared
param or an output of an earlier node (SSA, defined before use, which also
rules out cycles; a cycle is named as such); use lists match the inputs in
both directions (every input is recorded as a use, every recorded use is a
real input of a live node);
output types equal what each op's type rule infers; params are used and
registered under their own names; graph outputs are defined and named.
Each message names the node (position and op), its scope and the problem.
"""

from __future__ import annotations

from .errors import ErnieIRError, VerificationError
from .graph import Graph, Node, Param, Value


def _where(pos: int, node: Node) -> str:
    scope = f" at {node.scope}" if node.scope else ""
    return f"node #{pos} {node.op}{scope}"


def _where_node(node: Node) -> str:
    return f"{node.op}{' at ' + node.scope if node.scope else ''}"


def _find_cycle(graph: Graph) -> list[Node] | None:
    """Nodes on one dataflow cycle, in edge order, or None.

    An iterative depth-first search (no recursion limit on deep graphs, and no graph
    library on the import path: the CLI imports the verifier and should start fast).
    """
    producers: dict[Node, list[Node]] = {}
    for n in graph:
        producers[n] = list(dict.fromkeys(
            v.producer for v in n.inputs
            if v is not None and v.producer is not None and v.producer.graph is graph))
    done: set[Node] = set()
    for start in producers:
        if start in done:
            continue
        # Walk producer edges; a node met again while still on the stack closes a cycle.
        path: list[Node] = [start]
        on_path = {start}
        iters = [iter(producers[start])]
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                iters.pop()
                continue
            if nxt in on_path:
                cycle = path[path.index(nxt):]
                return list(reversed(cycle))  # producer edges walked backwards: flip to dataflow
            if nxt in done:
                continue
            path.append(nxt)
            on_path.add(nxt)
            iters.append(iter(producers.get(nxt, ())))
    return None


def _stale_uses(graph: Graph) -> list[str]:
    """Uses recorded on the graph's values that are no real input of a live node.

    The other direction (every input recorded as a use) is checked node by node. A use by
    a node of another graph is left alone: rank graphs may share params and inputs.
    """
    problems: list[str] = []
    positions = {n: i for i, n in enumerate(graph)}
    # (label, value, whether nodes of other graphs may read it)
    labelled: list[tuple[str, Value, bool]] = [(f"graph input {v.name}", v, True)
                                               for v in graph.inputs]
    labelled += [(f"param @{name}", p, True) for name, p in graph.params.items()]
    for node, pos in positions.items():
        for j, v in enumerate(node.outputs):
            labelled.append((f"{_where(pos, node)}: output {j}", v, False))
    for label, v, shared in labelled:
        for user, i in v._uses:
            if user.graph is not graph and user.graph is not None and not shared:
                problems.append(f"{label}: use list records input {user.opdef.input_name(i)} "
                                f"of {_where_node(user)} in graph {user.graph.name}: a node "
                                "result read by another graph")
            elif user.graph is None:
                problems.append(f"{label}: use list records input {user.opdef.input_name(i)} "
                                f"of {_where_node(user)}, which is in no graph (erased, or never "
                                "inserted)")
            elif user.graph is graph and (i >= len(user.inputs) or user.inputs[i] is not v):
                problems.append(f"{label}: use list records input {user.opdef.input_name(i)} "
                                f"of {_where(positions[user], user)}, which reads another value")
    return problems


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
        cycle = _find_cycle(graph)
        if cycle is not None:
            problems.append("graph has a cycle: " + " -> ".join(
                f"{n.op}{'@' + n.scope if n.scope else ''}" for n in cycle))
    problems.extend(_stale_uses(graph))
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
