"""Structural equality of graphs: same computation, whatever the value names.

Two graphs are equal when they have the same name, inputs (names and
types), params (by name: type, annotations, trainable flag), the same nodes
in the same order (op, attrs, scope, result types, and inputs that
correspond), and the same outputs. Internal value names are ignored, which is
what golden tests need: a rename is not a change.
"""

from __future__ import annotations

from .graph import Graph, Value
from .printer import format_attrs, format_dict


def structural_diff(a: Graph, b: Graph) -> str | None:
    """The first difference between two graphs, in words; None if they are equal."""
    if a.name != b.name:
        return f"graph names differ: {a.name} vs {b.name}"
    if a.metadata != b.metadata and format_dict(a.metadata) != format_dict(b.metadata):
        return "graph metadata differs"
    if len(a.inputs) != len(b.inputs):
        return f"input counts differ: {len(a.inputs)} vs {len(b.inputs)}"
    mapping: dict[Value, Value] = {}
    for x, y in zip(a.inputs, b.inputs, strict=True):
        if x.name != y.name or x.type != y.type:
            return f"input {x.name}: {x.type} vs {y.name}: {y.type}"
        mapping[x] = y
    if set(a.params) != set(b.params):
        only_a = sorted(set(a.params) - set(b.params))[:3]
        only_b = sorted(set(b.params) - set(a.params))[:3]
        return f"params differ: only in first {only_a}, only in second {only_b}"
    for name, p in a.params.items():
        q = b.params[name]
        if p.type != q.type or p.trainable != q.trainable:
            return f"param @{name}: {p.type}{' trainable' * p.trainable} vs " \
                   f"{q.type}{' trainable' * q.trainable}"
        if format_dict(p.annotations) != format_dict(q.annotations):
            return f"param @{name}: annotations differ"
        mapping[p] = q
    if len(a) != len(b):
        return f"node counts differ: {len(a)} vs {len(b)}"
    for pos, (n, m) in enumerate(zip(a, b, strict=True)):
        where = f"node #{pos} ({n.op}{' at ' + n.scope if n.scope else ''})"
        if n.op != m.op:
            return f"{where}: op {n.op} vs {m.op}"
        if n.scope != m.scope:
            return f"{where}: scope {n.scope!r} vs {m.scope!r}"
        if n.attrs != m.attrs and format_attrs(n.attrs) != format_attrs(m.attrs):
            return f"{where}: attrs {format_attrs(n.attrs)} vs {format_attrs(m.attrs)}"
        if len(n.inputs) != len(m.inputs):
            return f"{where}: {len(n.inputs)} vs {len(m.inputs)} inputs"
        for i, (x, y) in enumerate(zip(n.inputs, m.inputs, strict=True)):
            if (x is None) != (y is None) or (x is not None and mapping.get(x) is not y):
                return f"{where}: input {n.opdef.input_name(i)} comes from a different value"
        if [v.type for v in n.outputs] != [v.type for v in m.outputs]:
            return f"{where}: result types differ"
        mapping.update(zip(n.outputs, m.outputs, strict=True))
    if len(a.outputs) != len(b.outputs):
        return f"output counts differ: {len(a.outputs)} vs {len(b.outputs)}"
    if a.output_names != b.output_names:
        return f"output names differ: {a.output_names} vs {b.output_names}"
    for name, x, y in zip(a.output_names, a.outputs, b.outputs, strict=True):
        if mapping.get(x) is not y:
            return f"output {name} differs"
    return None


def structural_equal(a: Graph, b: Graph) -> bool:
    return structural_diff(a, b) is None
