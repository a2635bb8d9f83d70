"""Dead-code elimination: drop nodes whose results nobody reads, then unused params."""

from __future__ import annotations

from ernie_ir.ir import Graph

from ..infra.base import NoOptions, PassContext, function_pass
from ..infra.registry import register_pass


@register_pass
@function_pass("dce", "Remove nodes whose results are unused, and params no node reads.",
               options=NoOptions)
def dce(graph: Graph, options: NoOptions, ctx: PassContext) -> bool:
    """Walks backwards once: a node is dead when none of its results is read or returned,
    and erasing it may make its producers dead in turn, which the backward walk sees next."""
    outputs = set(graph.outputs)
    removed = 0
    for node in reversed(graph):
        if any(v.num_uses() or v in outputs for v in node.outputs):
            continue
        graph.erase(node)
        removed += 1
    # Unused params always go: the verifier's invariant is that every param is used.
    for name in [n for n, p in graph.params.items() if not p.num_uses() and p not in outputs]:
        graph.remove_param(name)
        removed += 1
    if removed:
        ctx.count("erased", removed)
    return removed > 0
