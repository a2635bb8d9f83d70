"""The reference interpreter: runs a graph on numpy inputs with the ops' kernels.

This is the truth every pass is checked against. Floats are computed in
float32: params stored in bf16/f16 are widened exactly, kernels see float32.
With `emulate=bf16` (or f16) every float result whose declared type is that
dtype is rounded to it after its node, which mimics a model that keeps
activations in bf16. Integer tensors keep their dtype. A value's array is
dropped after its last use, so peak memory follows the live set, not the graph.

Weights derived from params are computed once per `Interpreter`, like the params themselves:
the results of nodes that read only params (`dequantize`, `unpack_weight`, ...) and the float32
weight a weight-only linear dequantizes (`DequantizedLinear.float_weight`) are kept between
runs, up to `weight_cache_bytes` (default `WEIGHT_CACHE_BYTES`); past it they are computed on
every run as before. The numbers are the same either way (the same kernels on the same
inputs); once every derived weight is kept, the quantized params only they read are let go,
so a quantized model holds about what its float model would, and the nodes that only fed the
kept ones (an `unpack_weight` before its `dequantize`) are skipped: an observer no longer sees
them.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Any

import numpy as np

from ernie_ir.ir import DType, ErnieIRError, Graph, Node, Param, TensorType, Value
from ernie_ir.ir.types import Dim
from ernie_ir.ops.weight_only_linear import DequantizedLinear

_EMULATABLE = (DType.BF16, DType.F16)
COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_gather_sequence",
                         "scatter_sequence"})
"""Ops that need every rank's input (`OpDef.collective`)."""
WEIGHT_CACHE_BYTES = 16 << 30
"""Bytes of weights derived from params (float32 dequantized weights) one Interpreter keeps
between runs: 16 GiB, the float32 weights of a 4B-parameter model."""


def _widen(array: np.ndarray, dtype: DType) -> np.ndarray:
    """Float tensors as float32 (exact from bf16/f16/fp8), others unchanged."""
    if dtype.is_float and array.dtype != np.float32:
        return array.astype(np.float32)
    return array


class Interpreter:
    """Runs one graph repeatedly; params are read once and cached (as float32 for floats), and
    so are the weights derived from them (see the module docstring)."""

    def __init__(self, graph: Graph, *, emulate: DType | None = None,
                 check_shapes: bool = True, weight_cache_bytes: int = WEIGHT_CACHE_BYTES) -> None:
        if emulate is not None and emulate not in _EMULATABLE:
            raise ValueError(f"can only emulate {', '.join(map(str, _EMULATABLE))}, not {emulate}")
        self.graph = graph
        self.emulate = emulate
        self.check_shapes = check_shapes
        self._params: dict[str, np.ndarray] = {}
        self._plan = self._last_uses()
        self._weights = _DerivedWeights(graph, weight_cache_bytes)

    def _last_uses(self) -> dict[Node, list[Value]]:
        """For each node, the values whose last reader it is (to free them after it)."""
        last: dict[Value, Node] = {}
        for node in self.graph:
            for v in node.inputs:
                if v is not None and not isinstance(v, Param):
                    last[v] = node
            for v in node.outputs:  # a result nobody reads is dropped right after its node
                last.setdefault(v, node)
        keep = set(self.graph.outputs)
        plan: dict[Node, list[Value]] = {}
        for v, node in last.items():
            if v not in keep:
                plan.setdefault(node, []).append(v)
        return plan

    def param(self, p: Param) -> np.ndarray:
        arr = self._params.get(p.name)
        if arr is None:
            arr = self._params[p.name] = _widen(np.asarray(p.read()), p.type.dtype)
        return arr

    def _bind(self, v: Value, arr: np.ndarray, symbols: dict[str, int], what: str) -> None:
        t = v.type
        if arr.ndim != t.rank:
            raise ErnieIRError(f"{what}: expected rank {t.rank} ({t}), got shape {list(arr.shape)}")
        for axis, (d, n) in enumerate(zip(t.shape, arr.shape, strict=True)):
            if isinstance(d, int):
                if d != n:
                    raise ErnieIRError(f"{what}: dim {axis} must be {d} ({t}), got {n}")
            elif "*" not in d and symbols.setdefault(d, n) != n:
                raise ErnieIRError(
                    f"{what}: dim {axis} ({d}) is {n} but {d} = {symbols[d]} elsewhere"
                )

    def run(self, inputs: Mapping[str, np.ndarray],
            observer: Callable[[Node, list[np.ndarray]], Any] | None = None,
            ) -> dict[str, np.ndarray]:
        """Outputs by name. `observer(node, results)` is called after each node."""
        steps = self.steps(inputs, observer)
        try:
            node, args = next(steps)
            while True:  # a collective of this graph alone: its kernel runs it (world 1) or says why not
                node, args = steps.send(node.opdef.kernel(args, node.attrs))
        except StopIteration as done:
            return done.value

    def steps(self, inputs: Mapping[str, np.ndarray],
              observer: Callable[[Node, list[np.ndarray]], Any] | None = None,
              ) -> Generator[tuple[Node, list[np.ndarray | None]], list[np.ndarray],
                             dict[str, np.ndarray]]:
        """Run as a generator that stops at every collective node: it yields `(node, args)` and
        is sent that node's results; it returns the outputs by name. The SPMD interpreter drives
        one such generator per rank in lockstep."""
        g = self.graph
        env: dict[Value, np.ndarray] = {}
        symbols: dict[str, int] = {}
        names = {v.name for v in g.inputs}
        unknown = sorted(set(inputs) - names)
        if unknown:
            raise ErnieIRError(f"unknown graph input(s) {unknown}; inputs are {sorted(names)}")
        for v in g.inputs:
            if v.name not in inputs:
                raise ErnieIRError(f"missing graph input {v.name!r} ({v.type})")
            arr = np.asarray(inputs[v.name])
            if v.type.dtype.is_int and not np.issubdtype(arr.dtype, np.integer):
                raise ErnieIRError(f"input {v.name}: expected integers ({v.type}), got {arr.dtype}")
            self._bind(v, arr, symbols, f"input {v.name}")
            env[v] = _widen(arr, v.type.dtype) if v.type.dtype.is_float else \
                arr.astype(v.type.dtype.numpy)
        weights = self._weights
        for node in g:
            if weights.skip(node):  # feeds only derived weights that are all kept
                continue
            kept = weights.kept.get(node)
            if kept is None:
                args = [None if v is None else (self.param(v) if isinstance(v, Param) else env[v])
                        for v in node.inputs]
            if kept is not None and node in weights.linears:  # x @ the kept float32 weight
                bias = node.inputs[3] if len(node.inputs) > 3 else None
                results = DequantizedLinear.apply(
                    env[node.inputs[0]], kept[0], None if bias is None else self._arg(bias, env))
            elif kept is not None:
                results = kept
            elif node in weights.linears:
                opdef = node.opdef
                assert isinstance(opdef, DequantizedLinear)
                w = opdef.float_weight(args[1], args[2], node.attrs)
                weights.keep(node, [w], self._params)
                results = opdef.apply(args[0], w, args[3] if len(args) > 3 else None)
            elif node.op in COLLECTIVES:
                results = yield node, args
            else:
                results = node.opdef.kernel(args, node.attrs)
            for v, arr in zip(node.outputs, results, strict=True):
                arr = self._normalise(v.type, arr)
                if self.check_shapes:
                    self._bind(v, arr, symbols, f"{node.op} at {node.scope or '<root>'}")
                env[v] = arr
            if kept is None and node in weights.frontier:
                weights.keep(node, [env[v] for v in node.outputs], self._params)
            if observer is not None:
                observer(node, [env[v] for v in node.outputs])
            for v in self._plan.get(node, ()):
                env.pop(v, None)
        out: dict[str, np.ndarray] = {}
        for name, v in zip(g.output_names, g.outputs, strict=True):
            out[name] = self.param(v) if isinstance(v, Param) else env[v]
        return out

    def _arg(self, v: Value, env: dict[Value, np.ndarray]) -> np.ndarray:
        return self.param(v) if isinstance(v, Param) else env[v]

    def _normalise(self, t: TensorType, arr: np.ndarray) -> np.ndarray:
        arr = np.asarray(arr)
        if t.dtype.is_float:
            if self.emulate is not None and t.dtype == self.emulate:
                return arr.astype(self.emulate.numpy).astype(np.float32)
            return arr.astype(np.float32, copy=False)
        return arr.astype(t.dtype.numpy, copy=False)


class _DerivedWeights:
    """Which nodes of a graph derive weights from params alone, and those kept between runs.

    `frontier`: nodes computed from params only whose results a non-derived node reads (e.g.
    `dequantize(q, scale)` before a matmul); `linears`: weight-only linears whose weight and
    scale are params (their float32 weight is kept). Nodes that only feed the frontier (an
    `unpack_weight` before a `dequantize`) are skipped once every kept result is in.
    """

    def __init__(self, graph: Graph, budget: int) -> None:
        derived: set[Node] = set()
        made: set[Value] = set()
        readers: dict[Value, list[tuple[Node, int]]] = {}
        for node in graph:
            ins = [v for v in node.inputs if v is not None]
            for i, v in enumerate(node.inputs):
                if v is not None:
                    readers.setdefault(v, []).append((node, i))
            if ins and node.op not in COLLECTIVES and all(isinstance(v, Param) or v in made for v in ins):
                derived.add(node)
                made.update(node.outputs)
        outputs = set(graph.outputs)
        self.frontier = {n for n in derived
                         if any(v in outputs or any(r not in derived for r, _ in readers.get(v, ()))
                                for v in n.outputs)}
        self.inner = derived - self.frontier
        self.linears = {n for n in graph if isinstance(n.opdef, DequantizedLinear)
                        and len(n.inputs) > 2 and isinstance(n.inputs[1], Param)
                        and isinstance(n.inputs[2], Param)} - derived
        # params read only to make kept weights (a linear's weight and scale, not its bias): not
        # needed once every result is kept
        self._only_derived = [p.name for p, rs in readers.items() if isinstance(p, Param) and all(
            r in derived or (r in self.linears and i in (1, 2)) for r, i in rs)]
        self.kept: dict[Node, list[np.ndarray]] = {}
        self._budget = budget
        self._complete = not (self.frontier or self.linears)

    def skip(self, node: Node) -> bool:
        return self._complete and node in self.inner

    def keep(self, node: Node, results: list[np.ndarray], params: dict[str, np.ndarray]) -> None:
        """Keep `node`'s results if they fit the budget; once all are kept, drop the params only
        they were made from."""
        size = sum(int(a.nbytes) for a in results)
        if size > self._budget:
            return
        self._budget -= size
        self.kept[node] = results
        if len(self.kept) == len(self.frontier) + len(self.linears):
            self._complete = True
            for name in self._only_derived:
                params.pop(name, None)


def run_graph(graph: Graph, inputs: Mapping[str, np.ndarray], *,
              emulate: DType | None = None) -> dict[str, np.ndarray]:
    """Run a graph once with the reference kernels; returns outputs by name."""
    return Interpreter(graph, emulate=emulate).run(inputs)


def symbol_values(t: TensorType, shape: tuple[int, ...]) -> dict[Dim, int]:
    """Which concrete size each symbolic dim of `t` takes in `shape`."""
    return {d: n for d, n in zip(t.shape, shape, strict=True) if isinstance(d, str)}
