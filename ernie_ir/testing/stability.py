"""Where two float32 implementations of one graph can be compared: the positions whose discrete
decisions (a quantizer's rounding, a router's top-k) no last-bit difference can flip.

Two correct implementations of a matmul (numpy's OpenBLAS and Paddle's kernels; Haswell and
SkylakeX code paths; two ONNX providers) sum in different orders, so their float32 results
differ in the last bits. Continuous ops carry that difference along unchanged in size, but a
quantizer of activations (fp8, int8 QAT) or a router's top-k turns it into a whole quantization
step or another expert whenever a value sits within that difference of a decision boundary, and
everything downstream of it then differs by O(1). Whether that happens depends on the machine,
not on either implementation being wrong: a comparison of logits is meaningful only where no
decision is that close.

`stable_positions(graph, inputs)` finds those places from the reference interpreter alone. It
runs the graph once, then re-runs each node on its own recorded inputs twice, with every float
activation input (a value computed from the graph's inputs) moved by +d and by -d elementwise
(d = `rel` x (|x| + mean|x|), one random sign pattern and its negative, so every element moves
both ways):

- a node whose result is continuous in its inputs changes linearly, so the two results'
  mean equals the unperturbed one up to float rounding (a second difference of O(d^2));
- a node with a decision within d of flipping (a rounding boundary, a top-k tie) jumps in one
  of the two runs: its second difference is a whole step, or its integer outputs change.

Every (row, position) of such a jump is unstable. Causal attention carries a position's value
only to later positions of its row, so the logits of a row agree to float tolerance before its
first unstable position (`StablePositions.prefix`). A node whose earlier positions move when
only the last position's inputs move (a per-tensor dynamic scale, an abs-max over the sequence)
mixes positions: once any position is unstable, no position is comparable (`prefix` all 0).

`rel` bounds the difference between the two implementations at any node, relative to the
magnitude of its inputs: float32 rounding is 6e-8 per op; through the 3-4 layers of the built-in
tiny models two BLAS kernels were measured to differ by up to ~1e-6 (an attention output 12
ulps apart on an AMD EPYC with OpenBLAS's Haswell kernels), so the default 1e-5 is ten times that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ernie_ir.ir import ErnieIRError, Graph, Node, Param, Value
from ernie_ir.runtime import Interpreter

DEFAULT_REL = 1e-5
"""Relative size of the last-bit difference two implementations may have at any node."""


@dataclass(frozen=True)
class StablePositions:
    """Where logits of [B, S] inputs are comparable across implementations."""

    prefix: np.ndarray
    """[B] int: in row b, positions < prefix[b] are comparable (S where all are)."""
    unstable: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per node (scope and op), the (row, position) pairs where a decision is within `rel`."""
    mixing: list[str] = field(default_factory=list)
    """Nodes whose earlier positions depend on later ones (what makes `prefix` all 0)."""

    @property
    def compared(self) -> int:
        """How many (row, position) pairs are comparable."""
        return int(self.prefix.sum())

    def mask(self, seq_len: int) -> np.ndarray:
        """[B, S] bool: True where the logits are comparable."""
        return np.arange(seq_len)[None, :] < self.prefix[:, None]


def _node_name(node: Node) -> str:
    return f"{node.op} at {node.scope or node.outputs[0].name}"


def _positions(arr_shape: tuple[int, ...], flat: np.ndarray, batch: int, seq: int) -> list[tuple[int, int]]:
    """(row, position) of each flagged element, from the element's index in an output of
    `arr_shape`: leading [B, S], a flattened [B*S, ...] token axis, or [B, H, S, ...];
    any other layout flags position 0 of every row (nothing of it can be compared)."""
    idx = np.argwhere(flat.reshape(arr_shape))
    if len(arr_shape) >= 2 and arr_shape[:2] == (batch, seq):
        pairs = idx[:, :2]
    elif len(arr_shape) >= 1 and arr_shape[0] == batch * seq:
        pairs = np.stack(np.divmod(idx[:, 0], seq), axis=1)
    elif len(arr_shape) >= 3 and arr_shape[0] == batch and arr_shape[2] == seq:
        pairs = idx[:, [0, 2]]
    else:
        return [(b, 0) for b in range(batch)]
    return sorted({(int(b), int(s)) for b, s in pairs})


def _as_f32(results: list[np.ndarray]) -> list[np.ndarray]:
    """Float results widened to float32 (as the interpreter stores them); integers as they are."""
    return [r if r.dtype.kind in "iub" else r.astype(np.float32)
            for r in (np.asarray(x) for x in results)]


def _jumps(base: list[np.ndarray], up: list[np.ndarray], down: list[np.ndarray]) -> list[np.ndarray]:
    """Per output, a bool array: where the node did not respond linearly to +d / -d."""
    flags = []
    for b, u, d in zip(base, up, down, strict=True):
        if b.dtype.kind in "iub":
            flags.append((u != b) | (d != b))
            continue
        b64, u64, d64 = (np.asarray(a, np.float64) for a in (b, u, d))
        mag = np.abs(b64) + (np.abs(b64).mean() if b64.size else 0.0)
        # float rounding of the node's own kernel is ~1e-7 of its magnitude; a flipped decision
        # moves a result by a quantization step or an expert's output, orders of magnitude more
        flags.append(np.abs(u64 + d64 - 2 * b64) > 1e-5 * mag + 1e-30)
    return flags


def stable_positions(graph: Graph, inputs: Mapping[str, np.ndarray], *, rel: float = DEFAULT_REL,
                     seed: int = 0) -> StablePositions:
    """Where the logits of `graph` on `inputs` (an `input_ids` [B, S] among them) can be compared
    between two float32 implementations whose values differ by at most `rel` (see the module)."""
    ids = np.asarray(inputs["input_ids"])
    if ids.ndim != 2:
        raise ErnieIRError(f"input_ids must be [B, S], got shape {list(ids.shape)}")
    batch, seq = ids.shape
    interp = Interpreter(graph)
    values: dict[int, np.ndarray] = {}
    for v in graph.inputs:
        values[id(v)] = np.asarray(inputs[v.name])

    def record(node: Node, results: list[np.ndarray]) -> None:
        for v, r in zip(node.outputs, results, strict=True):
            values[id(v)] = r

    interp.run(inputs, observer=record)

    def arg(v: Value | None) -> np.ndarray | None:
        if v is None:
            return None
        return interp.param(v) if isinstance(v, Param) else values[id(v)]

    # only activations differ between implementations; params and values computed from params
    # alone (dequantized weights, their scales) are the same bytes in both
    activations = {id(v) for v in graph.inputs}
    rng = np.random.default_rng(seed)
    unstable: dict[str, list[tuple[int, int]]] = {}
    mixing: list[str] = []
    for node in graph:
        if any(v is not None and id(v) in activations for v in node.inputs):
            activations.update(id(v) for v in node.outputs)
        args = [arg(v) for v in node.inputs]
        moved = [i for i, v in enumerate(node.inputs)
                 if v is not None and id(v) in activations and v.type.dtype.is_float
                 and args[i] is not None and np.asarray(args[i]).size]
        if not moved:
            continue
        base = _as_f32([values[id(v)] for v in node.outputs])
        runs = []
        signs = {i: rng.choice(np.array([-1.0, 1.0], np.float32), size=np.shape(args[i])) for i in moved}
        for direction in (1.0, -1.0):
            a = list(args)
            for i in moved:
                x = np.asarray(args[i], np.float32)
                d = np.float32(rel) * (np.abs(x) + np.abs(x).mean()) * signs[i]
                a[i] = x + np.float32(direction) * d
            runs.append(_as_f32(node.opdef.kernel(a, node.attrs)))
        pairs: set[tuple[int, int]] = set()
        for out, flag in zip(base, _jumps(base, runs[0], runs[1]), strict=True):
            if flag.any():
                pairs.update(_positions(out.shape, flag, batch, seq))
        if pairs:
            unstable[_node_name(node)] = sorted(pairs)
        if seq > 1 and _mixes_positions(node, args, moved, base, batch, seq):
            mixing.append(_node_name(node))
    prefix = np.full(batch, seq, dtype=np.int64)
    for pairs in unstable.values():
        for b, s in pairs:
            prefix[b] = min(prefix[b], s)
    if mixing and unstable:
        prefix[:] = 0
    return StablePositions(prefix=prefix, unstable=unstable, mixing=mixing)


def _mixes_positions(node: Node, args: list[np.ndarray | None], moved: list[int],
                     base: list[np.ndarray], batch: int, seq: int) -> bool:
    """Whether moving only the last position of each row changes an earlier position's result."""
    a = list(args)
    touched = False
    for i in moved:
        x = np.array(args[i], np.float32)
        if x.ndim >= 2 and x.shape[:2] == (batch, seq):
            x[:, -1] = x[:, -1] * np.float32(1.5) + np.float32(0.5)
        elif x.ndim >= 1 and x.shape[0] == batch * seq:
            x.reshape(batch, seq, *x.shape[1:])[:, -1] *= np.float32(1.5)
        else:
            continue
        a[i], touched = x, True
    if not touched:
        return False
    for b, r in zip(base, _as_f32(node.opdef.kernel(a, node.attrs)), strict=True):
        if b.ndim >= 2 and b.shape[:2] == (batch, seq):
            if not np.array_equal(b[:, :-1], r[:, :-1]):
                return True
        elif b.ndim >= 1 and b.shape[0] == batch * seq:
            early = np.ones(b.shape[0], bool).reshape(batch, seq)
            early[:, -1] = False
            if not np.array_equal(b[early.reshape(-1)], r[early.reshape(-1)]):
                return True
    return False
