"""Values, params, nodes and graphs: the in-memory IR.

- A `Value` is an SSA tensor: defined once (by a node, or as a graph input),
  used by any number of node inputs. It knows its producer and its uses.
- A `Param` is a named weight. It is a `Value` with no producer, so nodes
  take params as ordinary inputs; it carries a lazy `WeightSource`, a
  `trainable` flag and free-form annotations (quantization, sharding) that
  print as part of its declaration.
- A `Node` applies a registered op to inputs, with validated attrs, and a
  scope: the module path (`ernie.layers.3.mlp`) that passes select by.
- A `Graph` is an ordered sequence of nodes (a linked list, so inserting and
  erasing are O(1) during rewrites) plus its inputs, outputs and params.

Mutation goes through the graph's helpers, which keep use lists exact and are
all or nothing: a node whose type rule refuses its inputs records no use on
them, and a batch insert that cannot link every node links none. The
verifier checks the remaining invariants (types, order, param use) and the
use lists in both directions.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from .dtypes import DType
from .errors import OpError, WeightError
from .registry import OpAttrs, OpDef, get_op
from .types import TensorType
from .weights import ArraySource, WeightSource


class Value:
    """An SSA tensor value."""

    __slots__ = ("_uses", "index", "name", "producer", "type")

    def __init__(
        self,
        type: TensorType,
        name: str | None = None,
        producer: Node | None = None,
        index: int = 0,
    ) -> None:
        self.type = type
        self.name = name
        self.producer = producer
        self.index = index
        self._uses: dict[tuple[Node, int], None] = {}

    @property
    def uses(self) -> list[tuple[Node, int]]:
        """(node, input index) pairs that read this value, in insertion order."""
        return list(self._uses)

    @property
    def users(self) -> list[Node]:
        """Distinct nodes that read this value."""
        return list(dict.fromkeys(n for n, _ in self._uses))

    def num_uses(self) -> int:
        return len(self._uses)

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    @property
    def shape(self) -> tuple[int | str, ...]:
        return self.type.shape

    def __repr__(self) -> str:
        origin = f" from {self.producer.op}" if self.producer is not None else ""
        return f"<Value {self.name or '?'}: {self.type}{origin}>"


class Param(Value):
    """A named weight: a value defined by the graph itself, with a lazy data source."""

    __slots__ = ("annotations", "digest", "source", "trainable")

    def __init__(
        self,
        name: str,
        type: TensorType,
        source: WeightSource | None = None,
        *,
        trainable: bool = False,
        annotations: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(type, name)
        self.source = source
        self.trainable = trainable
        self.annotations: dict[str, Any] = dict(annotations or {})
        self.digest: str | None = None  # content hash the text promised, checked on load
        if source is not None:
            self._check_source(source)

    def _check_source(self, source: WeightSource) -> None:
        if source.dtype != self.type.dtype or tuple(source.shape) != self.type.shape:
            raise WeightError(
                f"param {self.name}: declared {self.type} but its source "
                f"({source.describe()}) holds {source.dtype}{list(source.shape)}"
            )

    @property
    def has_data(self) -> bool:
        return self.source is not None

    def read(self) -> np.ndarray:
        """The values (lazily loaded; may be a read-only view of a memory map)."""
        if self.source is None:
            raise WeightError(
                f"param {self.name} has no data (a meta graph): load the model with weights, from a "
                "checkpoint folder or NAME@tiny (@meta, .ir files and graph folders without "
                "weights.safetensors hold none)"
            )
        return self.source.read()

    def set_data(self, array: np.ndarray) -> None:
        """Replace the values with an in-memory array of the declared type."""
        src = ArraySource(array)
        self._check_source(src)
        self.source = src

    def __repr__(self) -> str:
        flag = " trainable" if self.trainable else ""
        return f"<Param @{self.name}: {self.type}{flag}>"


class Node:
    """One application of an op."""

    __slots__ = ("_next", "_prev", "attrs", "graph", "inputs", "op", "opdef", "outputs", "scope")

    def __init__(
        self,
        op: str,
        inputs: Sequence[Value | None],
        attrs: dict[str, Any] | OpAttrs | None = None,
        *,
        scope: str = "",
        output_types: Sequence[TensorType] | None = None,
        output_names: Sequence[str | None] | None = None,
    ) -> None:
        self.opdef: OpDef = get_op(op)
        self.op = op
        self.opdef.check_arity(len(inputs))
        ins = list(inputs)
        if None in ins:
            for i, v in enumerate(ins):  # before trailing Nones are dropped below
                if v is None and not self.opdef.inputs[min(i, len(self.opdef.inputs) - 1)].optional:
                    raise OpError(f"op {op}: input {self.opdef.input_name(i)} is required")
            # Trailing absent optional inputs are dropped so equal nodes look equal.
            while ins and ins[-1] is None:
                ins.pop()
        self.inputs: tuple[Value | None, ...] = tuple(ins)
        self.attrs: OpAttrs = self.opdef.make_attrs(attrs)
        self.scope = scope
        self.graph: Graph | None = None
        self._prev: Node | None = None
        self._next: Node | None = None
        # Infer before recording uses: a type rule that refuses the inputs must leave no
        # use behind on them (creating a node is all or nothing).
        if output_types is None:
            output_types = self.infer_types()
        if output_names:
            names = list(output_names)
            self.outputs: tuple[Value, ...] = tuple(
                Value(t, names[i] if i < len(names) else None, self, i)
                for i, t in enumerate(output_types)
            )
        elif len(output_types) == 1:
            self.outputs = (Value(output_types[0], None, self, 0),)
        else:
            self.outputs = tuple(Value(t, None, self, i) for i, t in enumerate(output_types))
        for i, v in enumerate(self.inputs):
            if v is not None:
                v._uses[(self, i)] = None

    def input_types(self) -> list[TensorType | None]:
        return [v.type if v is not None else None for v in self.inputs]

    def infer_types(self) -> list[TensorType]:
        """Output types the op's rule gives for the current inputs (OpError if they don't fit)."""
        self.opdef.check_arity(len(self.inputs))  # a rewrite may have dropped a required input
        return self.opdef.infer(self.input_types(), self.attrs)

    @property
    def output(self) -> Value:
        """The only output (error if the op has several)."""
        if len(self.outputs) != 1:
            raise ValueError(f"{self.op} has {len(self.outputs)} outputs; use .outputs")
        return self.outputs[0]

    def input(self, name: str) -> Value | None:
        """The input bound to the op's input slot `name` (None if absent)."""
        for i, spec in enumerate(self.opdef.inputs):
            if spec.name == name:
                return self.inputs[i] if i < len(self.inputs) else None
        raise KeyError(f"op {self.op} has no input named {name!r}")

    def set_input(self, index: int, value: Value | None) -> None:
        """Rebind one input, keeping use lists exact."""
        old = self.inputs[index] if index < len(self.inputs) else None
        if old is not None:
            old._uses.pop((self, index), None)
        ins = list(self.inputs) + [None] * (index + 1 - len(self.inputs))
        ins[index] = value
        while ins and ins[-1] is None:
            ins.pop()
        self.inputs = tuple(ins)
        if value is not None:
            value._uses[(self, index)] = None

    def drop_inputs(self) -> None:
        """Detach from every input (used when erasing)."""
        for i, v in enumerate(self.inputs):
            if v is not None:
                v._uses.pop((self, i), None)
        self.inputs = ()

    @property
    def next(self) -> Node | None:
        return self._next

    @property
    def prev(self) -> Node | None:
        return self._prev

    def __repr__(self) -> str:
        where = f" @ {self.scope}" if self.scope else ""
        return f"<Node {self.op}{where}>"


class Graph:
    """An ordered graph of nodes with inputs, outputs and params."""

    def __init__(self, name: str = "main") -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        # The interface names of the outputs, kept apart from the values: replacing an
        # output value (by an input, a param or another output) must not rename the output.
        self.output_names: list[str] = []
        self.params: dict[str, Param] = {}
        self.metadata: dict[str, Any] = {}
        self._head: Node | None = None
        self._tail: Node | None = None
        self._count = 0

    # -- sequence of nodes ---------------------------------------------------------

    def __iter__(self) -> Iterator[Node]:
        """Nodes in order. Safe against erasing the current node while iterating."""
        node = self._head
        while node is not None:
            nxt = node._next
            yield node
            node = nxt

    def __reversed__(self) -> Iterator[Node]:
        node = self._tail
        while node is not None:
            prv = node._prev
            yield node
            node = prv

    def __len__(self) -> int:
        return self._count

    @property
    def nodes(self) -> list[Node]:
        return list(self)

    @property
    def first(self) -> Node | None:
        return self._head

    @property
    def last(self) -> Node | None:
        return self._tail

    def _link(self, node: Node, prev: Node | None, nxt: Node | None) -> None:
        if node.graph is not None:
            raise ValueError(f"{node} already belongs to a graph")
        node.graph = self
        node._prev, node._next = prev, nxt
        if prev is None:
            self._head = node
        else:
            prev._next = node
        if nxt is None:
            self._tail = node
        else:
            nxt._prev = node
        self._count += 1

    def append(self, node: Node) -> Node:
        self._link(node, self._tail, None)
        return node

    def _insertable(self, anchor: Node, nodes: Node | Iterable[Node]) -> list[Node]:
        """The nodes to insert, checked before any is linked (inserting is all or nothing)."""
        self._check_member(anchor)
        if isinstance(nodes, Node):  # the common case (every GraphBuilder op): no batch to check
            if nodes.graph is not None:
                raise ValueError(f"{nodes} already belongs to a graph")
            return [nodes]
        batch = list(nodes)
        seen: set[int] = set()
        for n in batch:
            if n.graph is not None:
                raise ValueError(f"{n} already belongs to a graph")
            if id(n) in seen:
                raise ValueError(f"{n} appears twice in the nodes to insert")
            seen.add(id(n))
        return batch

    def insert_before(self, anchor: Node, nodes: Node | Iterable[Node]) -> None:
        """Insert node(s), in order, right before `anchor` (all, or none if one cannot be)."""
        for n in self._insertable(anchor, nodes):
            self._link(n, anchor._prev, anchor)

    def insert_after(self, anchor: Node, nodes: Node | Iterable[Node]) -> None:
        """Insert node(s), in order, right after `anchor` (all, or none if one cannot be)."""
        prev = anchor
        for n in self._insertable(anchor, nodes):
            self._link(n, prev, prev._next)
            prev = n

    def move_after(self, anchor: Node | None, nodes: Sequence[Node]) -> None:
        """Move nodes of this graph, in order, right after `anchor` (None: to the front).

        Inputs and uses stay as they are; only the order changes (the caller keeps it
        valid: rewrites use this to put readers after a replacement they now read).
        """
        if anchor is not None:
            self._check_member(anchor)
        batch = list(nodes)
        for n in batch:
            self._check_member(n)
            if n is anchor:
                raise ValueError(f"cannot move {n} after itself")
        for n in batch:
            self._unlink(n)
        prev = anchor
        for n in batch:
            self._link(n, prev, prev._next if prev is not None else self._head)
            prev = n

    def _unlink(self, node: Node) -> None:
        prev, nxt = node._prev, node._next
        if prev is None:
            self._head = nxt
        else:
            prev._next = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt._prev = prev
        node._prev = node._next = None
        node.graph = None
        self._count -= 1

    def erase(self, node: Node, *, force: bool = False) -> None:
        """Remove a node. Its outputs must be unused unless `force` (then uses dangle)."""
        self._check_member(node)
        if not force:
            for v in node.outputs:
                if v._uses or v in self.outputs:
                    raise ValueError(
                        f"cannot erase {node}: output {v.index} is still used; "
                        "replace its uses first"
                    )
        node.drop_inputs()
        self._unlink(node)

    def _check_member(self, node: Node) -> None:
        if node.graph is not self:
            raise ValueError(f"{node} is not in graph {self.name}")

    # -- values ----------------------------------------------------------------------

    def add_input(self, name: str, type: TensorType) -> Value:
        if any(v.name == name for v in self.inputs):
            raise ValueError(f"graph already has an input named {name!r}")
        v = Value(type, name)
        self.inputs.append(v)
        return v

    def add_param(self, param: Param) -> Param:
        if param.name in self.params:
            raise ValueError(f"graph already has a param named {param.name!r}")
        self.params[param.name] = param
        return param

    def remove_param(self, name: str) -> Param:
        p = self.params[name]
        if p._uses:
            raise ValueError(f"param {name} is still used by {p.users[0]}")
        del self.params[name]
        return p

    def set_outputs(self, values: Sequence[Value], names: Sequence[str]) -> None:
        """Declare the graph outputs and their interface names."""
        if len(values) != len(names):
            raise ValueError(f"{len(values)} outputs but {len(names)} names")
        self.outputs = list(values)
        self.output_names = list(names)
        for v, n in zip(values, names, strict=True):
            if v.name is None:
                v.name = n

    def add_output(self, value: Value, name: str) -> None:
        if name in self.output_names:
            raise ValueError(f"graph already has an output named {name!r}")
        self.outputs.append(value)
        self.output_names.append(name)
        if value.name is None:
            value.name = name

    def replace_all_uses_with(self, old: Value, new: Value) -> int:
        """Make every reader of `old` read `new` (graph outputs included). Returns the count."""
        if old is new:
            return 0
        count = 0
        for node, i in list(old._uses):
            node.set_input(i, new)
            count += 1
        for i, v in enumerate(self.outputs):
            if v is old:
                self.outputs[i] = new  # the output keeps its name (output_names[i])
                count += 1
        return count

    def value_by_name(self, name: str) -> Value:
        for v in self.inputs:
            if v.name == name:
                return v
        if name in self.params:
            return self.params[name]
        for n in self:
            for v in n.outputs:
                if v.name == name:
                    return v
        raise KeyError(name)

    def nodes_by_op(self, op: str) -> list[Node]:
        return [n for n in self if n.op == op]

    def topological_sort(self) -> None:
        """Reorder nodes so every value is defined before use (stable for valid orders).

        Raises ValueError naming a node on a cycle if there is one.
        """
        nodes = list(self)
        indeg: dict[Node, int] = {}
        for n in nodes:
            indeg[n] = len({v.producer for v in n.inputs
                            if v is not None and v.producer is not None and v.producer.graph is self})
        ready = [n for n in nodes if indeg[n] == 0]
        order: list[Node] = []
        pos = {n: i for i, n in enumerate(nodes)}
        heap = [(pos[n], id(n), n) for n in ready]
        heapq.heapify(heap)
        while heap:
            _, _, n = heapq.heappop(heap)
            order.append(n)
            for user in dict.fromkeys(u for v in n.outputs for u, _ in v._uses):
                if user.graph is self:
                    indeg[user] -= 1
                    if indeg[user] == 0:
                        heapq.heappush(heap, (pos[user], id(user), user))
        if len(order) != len(nodes):
            # Walk back through unsorted producers: the first node seen twice is on a cycle
            # (the first stuck node in order may merely read from one).
            stuck = next(n for n in nodes if indeg[n] > 0)
            seen: set[Node] = set()
            while stuck not in seen:
                seen.add(stuck)
                stuck = next(v.producer for v in stuck.inputs if v is not None
                             and v.producer is not None and v.producer.graph is self
                             and indeg[v.producer] > 0)
            raise ValueError(f"graph has a cycle through {stuck}")
        self._head = self._tail = None
        self._count = 0
        for n in order:
            n.graph = None
            self.append(n)

    def __repr__(self) -> str:
        return (
            f"<Graph {self.name}: {len(self)} nodes, {len(self.params)} params, "
            f"{len(self.inputs)} inputs, {len(self.outputs)} outputs>"
        )
