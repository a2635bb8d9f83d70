"""Param bookkeeping shared by the quantization and LoRA passes.

`ParamPlacer` keeps the printed order readable: params a pass creates for a
weight are listed right after that weight (or where it was, when the pass
removed it), instead of at the end of the graph.
"""

from __future__ import annotations

from ernie_ir.ir import Graph, Param


class ParamPlacer:
    """Collects `anchor -> new params` and reorders `graph.params` once, at the end."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.after: dict[str, list[str]] = {}

    def add(self, anchor: str, param: Param) -> Param:
        """Add `param` to the graph (if new) to be listed after param `anchor`."""
        if param.name not in self.graph.params:
            self.graph.add_param(param)
        names = self.after.setdefault(anchor, [])
        if param.name not in names:
            names.append(param.name)
        return param

    def finish(self, removed: set[str] | None = None) -> None:
        """Apply the order; params in `removed` that nothing uses any more are dropped."""
        g = self.graph
        before = list(g.params)
        for name in removed or ():
            if name in g.params and not g.params[name].num_uses():
                g.remove_param(name)
        placed = {n for names in self.after.values() for n in names}
        order: list[str] = []
        seen: set[str] = set()

        def emit(name: str) -> None:
            if name in seen:
                return
            seen.add(name)
            if name in g.params:
                order.append(name)
            for child in self.after.get(name, ()):
                emit(child)

        for name in before:
            if name not in placed:
                emit(name)
        for name in g.params:  # placed params whose anchor is unknown
            emit(name)
        g.params = {n: g.params[n] for n in order}
