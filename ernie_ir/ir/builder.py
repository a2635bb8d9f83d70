"""GraphBuilder: write graphs as code, one method per registered op.

    b = GraphBuilder("demo")
    x = b.input("x", tensor(f32, "B", 16))
    w = b.param("proj.weight", tensor(bf16, 16, 32), source=...)
    with b.scope("proj"):
        y = b.linear(x, w)
    b.output(y, name="y")
    graph = b.graph

`b.<op>(inputs..., **attrs)` exists for every op in the registry, built-in or
plugin (docs/ops.md; the op set loads on the first such call): inputs bind
positionally or by the op's input names, the other keywords are attrs.
It returns the output value, or a tuple when the op has several. Frontends,
rewrite rules and tests all build graphs this way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .dtypes import DType
from .errors import OpError
from .graph import Graph, Node, Param, Value
from .registry import all_ops, get_op, has_op
from .types import Dim, TensorType
from .weights import WeightSource


class GraphBuilder:
    """Appends nodes to a graph, under a current scope."""

    def __init__(self, name: str | Graph = "main") -> None:
        self.graph = name if isinstance(name, Graph) else Graph(name)
        self._scopes: list[str] = []
        self.insert_point: Node | None = None  # None: append at the end

    # -- scopes ------------------------------------------------------------------------

    @property
    def current_scope(self) -> str:
        return ".".join(s for s in self._scopes if s)

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Nest a scope: `with b.scope("layers"), b.scope("0"):` gives `layers.0`."""
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    @contextlib.contextmanager
    def at_scope(self, absolute: str) -> Iterator[None]:
        """Replace the whole scope path for the block (used by rewrites)."""
        saved = self._scopes
        self._scopes = [absolute]
        try:
            yield
        finally:
            self._scopes = saved

    # -- interface ---------------------------------------------------------------------

    def input(self, name: str, type: TensorType | None = None, *,
              dtype: DType | None = None, shape: Sequence[Dim] | None = None) -> Value:
        if type is None:
            if dtype is None or shape is None:
                raise TypeError("give a TensorType or both dtype and shape")
            type = TensorType(dtype, shape)
        return self.graph.add_input(name, type)

    def param(
        self,
        name: str,
        type: TensorType | None = None,
        source: WeightSource | None = None,
        *,
        trainable: bool = False,
        annotations: dict[str, Any] | None = None,
    ) -> Param:
        """Declare a param; its type defaults to the source's dtype and shape."""
        if type is None:
            if source is None:
                raise TypeError(f"param {name}: give a type or a source")
            type = TensorType(source.dtype, source.shape)
        return self.graph.add_param(
            Param(name, type, source, trainable=trainable, annotations=annotations)
        )

    def output(self, *values: Value, name: str | None = None,
               names: Sequence[str] | None = None) -> None:
        if name is not None:
            names = [name]
        if names is None or len(names) != len(values):
            raise TypeError("give one name per output")
        for v, n in zip(values, names, strict=True):
            self.graph.add_output(v, n)

    # -- ops ---------------------------------------------------------------------------

    def op(self, op: str, *inputs: Value | None, **kwargs: Any) -> Any:
        """Append `op` applied to inputs; keywords matching input names bind inputs."""
        opdef = get_op(op)
        scope = kwargs.pop("scope", None)
        ins = list(inputs)
        for idx, spec in enumerate(opdef.inputs):
            if spec.name in kwargs and not spec.variadic:
                value = kwargs.pop(spec.name)
                if idx < len(ins) and ins[idx] is not None:
                    raise OpError(f"op {op}: input {spec.name} given twice")
                ins.extend([None] * (idx + 1 - len(ins)))
                ins[idx] = value
        node = Node(op, ins, kwargs, scope=self.current_scope if scope is None else scope)
        if self.insert_point is None:
            self.graph.append(node)
        else:
            self.graph.insert_before(self.insert_point, node)
        return node.outputs[0] if len(node.outputs) == 1 else node.outputs

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or not has_op(name):
            raise AttributeError(f"GraphBuilder has no attribute or op {name!r}")

        def build(*inputs: Value | None, **kwargs: Any) -> Any:
            return self.op(name, *inputs, **kwargs)

        build.__name__ = name
        build.__doc__ = get_op(name).doc
        return build

    def __dir__(self) -> list[str]:
        return [*super().__dir__(), *all_ops()]
