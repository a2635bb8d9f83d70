"""Common-subexpression elimination: one node per (op, inputs, attrs)."""

from __future__ import annotations

from typing import Any

from ernie_ir.ir import Graph, Node

from ..infra.base import NoOptions, PassContext, function_pass
from ..infra.registry import register_pass


def _key(node: Node) -> Any:
    return (node.op, tuple(id(v) if v is not None else None for v in node.inputs), node.attrs)


@register_pass
@function_pass("cse", "Merge nodes that apply the same op with the same attrs to the same inputs.",
               options=NoOptions)
def cse(graph: Graph, options: NoOptions, ctx: PassContext) -> bool:
    """The first occurrence survives (and keeps its scope); later duplicates are
    replaced by it. Every op in the set is pure, so this is always sound."""
    seen: dict[Any, Node] = {}
    merged = 0
    for node in graph:
        try:
            key = _key(node)
            first = seen.get(key)
        except TypeError:  # unhashable attrs: never merged
            continue
        if first is None:
            seen[key] = node
            continue
        for old, new in zip(node.outputs, first.outputs, strict=True):
            graph.replace_all_uses_with(old, new)
        graph.erase(node)
        merged += 1
    if merged:
        ctx.count("merged", merged)
    return merged > 0
