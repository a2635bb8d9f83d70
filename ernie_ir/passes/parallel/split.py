"""split: the global graph into per-rank graphs for tensor and expert parallelism.

    ranks = split_graph(graph, Mapping.create(tp=2))      # one Graph per rank

The cut is derived from the dataflow, not from parameter names, so it applies
to any graph of the op set (every frontend, GraphBuilder graphs, `.ir`
files). One forward walk gives each value a layout:

- `R`, replicated: every rank holds the whole value;
- `S`, sharded along one axis as a list of segments: the axis is the
  concatenation of parts (e.g. `[Q | K | V]`, `[gate | up]`, ERNIE-3.5-SE's
  `[QKV | X1 | X2]`), each part cut into whole units (heads, or single
  columns), and a rank holds its chunk of every part, in order. A part with
  fewer units than ranks (KV heads when tp > num_key_value_heads and tp % nkv
  == 0) is replicated by groups of tp / nkv ranks, as FastDeploy does;
- `P`, partial: every rank holds a summand (a row-parallel product, its
  experts' share, its vocabulary rows); the first reader that needs the
  whole value gets an `all_reduce` (a pending bias is added after it, once),
  and `add(P, P)` stays partial so that an MoE layer's routed and shared
  experts share one all_reduce;
- `Tokens` (sequence parallelism, `sp`): rank r holds its contiguous shard of
  the flattened B*S tokens. A partial value meeting the token-sharded residual
  (or read by a norm) is `reduce_scatter`ed (its bias added after), a whole
  token-shaped one is sliced (`scatter_sequence`), and a reader that needs the
  whole value (a column-parallel block) gets its `all_gather_sequence`.

A linear reading a replicated value is column-parallel: its output axis is cut
into the parts its readers split it into, in units of heads where a reader
reshapes it into heads. A linear reading a sharded value is row-parallel: its
weight rows are cut exactly as its input is (ERNIE-3.5-SE's `o_proj` over
`concat([ffn, attn])` gets `[FFN_r ; ATT_r]`). Weight-only weights cut the
same way; a row-parallel layer keeps its per-output-channel scales whole (they
were computed over the whole input axis, so the split quantized model equals
the unsplit one); LoRA A/B follow their base (column: B cut; row: A cut).
Routed experts are cut by `Mapping`: whole experts per EP group (global
indices kept, `moe_local_experts` routes to the held ones), each expert's
`[gate | up]` and `down` cut `moe_tp` ways. The embedding whose ids are the
graph input is vocabulary-parallel; `lm_head` is column-split (logits
all-gathered) or replicated; a tied head shares the embedding's cut.

Params keep their global names (as FastDeploy's pre-sharded checkpoints do),
hold lazy slices of the global sources (no bytes are read here), and carry a
`shard` annotation that says which slice of the global tensor they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ernie_ir.ir import ErnieIRError, Graph, Node, Param, TensorType, Value
from ernie_ir.ir.mapping import SHARD, Mapping, MappingError, RankLayout
from ernie_ir.ir.mapping import shard_of as annotation_of
from ernie_ir.ir.weights import ConcatSource, WeightSource

from ..infra.base import Pass, PassContext, PassOptions
from ..infra.registry import register_pass


def shard_of(p: Param) -> dict[str, Any] | None:
    """The `shard` annotation of a rank param (see `ernie_ir.ir.mapping.SHARD`), or None."""
    return annotation_of(p.annotations)


def row_cut(p: Param) -> bool:
    """Whether a weight's input rows (axis -2 of [..., K, N]) are cut on this rank."""
    shard = shard_of(p)
    rank = len(p.type.shape)
    return shard is not None and rank >= 2 and any(c.get("axis") == rank - 2 for c in shard["cuts"])


class SplitError(ErnieIRError):
    """A graph that cannot be cut for this layout: names the numbers and what would work."""


class DegreeError(SplitError):
    """A size that does not divide by the degree asked for; the message gets the layouts that
    work for the whole graph appended (`with_working_layouts`)."""


# -- layouts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seg:
    """One part of a sharded axis: `size` elements in `units` whole units."""

    size: int
    units: int
    replicate: bool = False
    """Fewer units than ranks: groups of ranks hold the same unit (KV heads)."""

    def local(self, parts: int) -> int:
        return self.size // self.units if self.replicate else self.size // parts

    def chunk(self, parts: int, index: int) -> tuple[int, int]:
        """[start, stop) within this part for the rank at `index` of `parts`."""
        if self.replicate:
            unit = self.size // self.units
            c = index // (parts // self.units)
            return c * unit, (c + 1) * unit
        n = self.size // parts
        return index * n, (index + 1) * n


@dataclass(frozen=True)
class Sharded:
    """A value cut along `axis`: the concatenation of `segs`, each cut over the ranks."""

    axis: int  # negative: counted from the end, so it survives leading-dim changes
    segs: tuple[Seg, ...]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segs)

    def local(self, parts: int) -> int:
        return sum(s.local(parts) for s in self.segs)

    def ranges(self, parts: int, index: int) -> list[tuple[int, int]]:
        """The global [start, stop) ranges a rank holds, in its local order."""
        out, base = [], 0
        for s in self.segs:
            a, b = s.chunk(parts, index)
            out.append((base + a, base + b))
            base += s.size
        return out

    @property
    def has_replicas(self) -> bool:
        return any(s.replicate for s in self.segs)


@dataclass
class Partial:
    """A summand of the whole value on every rank (the sum over ranks is the value)."""

    bias: Value | None = None  # added once, after the all_reduce


@dataclass(frozen=True)
class Tokens:
    """Sequence parallelism: rank r holds its contiguous shard [T / tp] of the flattened [T, ...]
    tokens (T = B * S, the graph input's dims) of a token-shaped value."""


Layout = Literal["R"] | Sharded | Partial | Tokens


@dataclass
class _Local:
    """A value of the rank graph and how it relates to the global value it stands for."""

    value: Value
    layout: Layout = "R"


# -- options and the pass -----------------------------------------------------------------


class SplitOptions(PassOptions):
    tp: int = 1
    ep: int = 1
    rank: int = 0
    """Which rank's graph the pass leaves in place (`compile` keeps every rank)."""
    lm_head: Literal["split", "replicate"] = "split"
    """Column-split the vocabulary projection (logits all-gathered) or keep it whole."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1): the residual stream and norms on token shards, a
    reduce_scatter after each row-parallel block, an all_gather_sequence before each column one."""


def model_dims(graph: Graph) -> tuple[int | None, int | None]:
    """(routed experts, vocabulary size) of a graph, read from its ops."""
    experts = vocab = None
    for node in graph:
        if node.op == "moe_gate":
            e = node.inputs[1].type.shape[1]
            experts = e if isinstance(e, int) else experts
        elif node.op in ("embedding",) and graph.inputs and node.inputs[0] is graph.inputs[0]:
            v = node.inputs[1].type.shape[0]
            vocab = v if isinstance(v, int) else vocab
    return experts, vocab


def mapping_for(graph: Graph, tp: int = 1, ep: int = 1) -> Mapping:
    """The Mapping of `graph` for tp x ep (MappingError names what would work)."""
    experts, vocab = model_dims(graph)
    if vocab is not None and tp > 1 and vocab % tp:
        raise MappingError(f"--tp {tp}: the vocabulary of {vocab} rows does not divide into {tp} "
                           f"parts; {_working(graph, tp, ep)}")
    return Mapping.create(tp, ep, num_experts=experts, vocab_size=vocab)


_CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


def working_layouts(graph: Graph, tp: int, ep: int, *, lm_head: str = "split") -> list[str]:
    """The layouts near tp x ep (same ep with another tp, or the same tp with another ep) that
    this graph can really be cut into: each candidate is split (rank 0) and kept if that works."""
    experts, vocab = model_dims(graph)
    tried: list[tuple[int, int]] = [(t, ep) for t in _CANDIDATES if t != tp]
    if experts is not None:
        tried += [(tp, e) for e in _CANDIDATES if e != ep]
    works = []
    for t, e in tried:
        if (vocab is not None and t > 1 and vocab % t) or (e > 1 and (experts is None or experts % e)):
            continue
        try:
            mapping = Mapping.create(t, e, num_experts=experts, vocab_size=vocab)
            if not mapping.is_single:
                _RankBuilder(graph, mapping, 0, lm_head).build()
        except ErnieIRError:
            continue
        works.append(f"--tp {t}" + (f" --ep {e}" if e > 1 else ""))
    return works


def _working(graph: Graph, tp: int, ep: int, lm_head: str = "split") -> str:
    works = working_layouts(graph, tp, ep, lm_head=lm_head)
    return f"layouts that work: {', '.join(works)}" if works else "no nearby layout works"


@register_pass
class SplitPass(Pass):
    """Cut the graph for tensor/expert parallelism; the graph becomes rank `rank`'s graph."""

    name = "split"
    description = ("tensor/expert parallel split (tp, ep): the graph becomes one rank's graph with "
                   "collectives; compile writes every rank")
    Options = SplitOptions
    produces = frozenset({"split"})
    fans_out = True

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        o: SplitOptions = self.options  # type: ignore[assignment]
        mapping = _layout(graph, o)
        if mapping.is_single:
            return False
        if not 0 <= o.rank < mapping.world_size:
            raise SplitError(f"split: rank {o.rank} is outside the world of {mapping.world_size}")
        ranked = split_rank(graph, mapping, o.rank, lm_head=o.lm_head, sp=mapping.sp)
        _replace_contents(graph, ranked)
        return True

    def fan_out(self, graph: Graph, ctx: PassContext) -> list[Graph]:
        """Every rank's graph (the global graph is left as it is)."""
        o: SplitOptions = self.options  # type: ignore[assignment]
        mapping = _layout(graph, o)
        if mapping.is_single:
            return [graph]
        ctx.mapping = mapping  # the later passes and the caller read the layout from the context
        return split_graph(graph, mapping, lm_head=o.lm_head, sp=mapping.sp)


def _sp(o: SplitOptions, mapping: Mapping) -> bool:
    if o.sp and mapping.tp < 2:
        raise SplitError(f"split: sequence parallelism (sp) needs tp > 1, got tp {mapping.tp}")
    return o.sp


def _layout(graph: Graph, o: SplitOptions) -> Mapping:
    """The split's Mapping, sequence parallelism included (the rank graphs record it)."""
    mapping = mapping_for(graph, o.tp, o.ep)
    return mapping.model_copy(update={"sp": True}) if _sp(o, mapping) else mapping


def split_graph(graph: Graph, mapping: Mapping, *, lm_head: str = "split", sp: bool = False) -> list[Graph]:
    """Every rank's graph (rank order). The global graph is left as it is."""
    _check_splittable(graph)
    return [split_rank(graph, mapping, r, lm_head=lm_head, sp=sp) for r in range(mapping.world_size)]


def split_rank(graph: Graph, mapping: Mapping, rank: int, *, lm_head: str = "split",
               sp: bool = False) -> Graph:
    """Rank `rank`'s graph of `graph` under `mapping` (`sp`: sequence parallelism, tp > 1)."""
    _check_splittable(graph)
    if sp and mapping.tp < 2:
        raise SplitError(f"split: sequence parallelism (sp) needs tp > 1, got tp {mapping.tp}")
    try:
        return _RankBuilder(graph, mapping, rank, lm_head, sp).build()
    except DegreeError as e:
        raise DegreeError(f"{e}; {_working(graph, mapping.tp, mapping.ep, lm_head)}") from None


def _check_splittable(graph: Graph) -> None:
    for node in graph:
        if node.op in _REFUSED:
            raise SplitError(f"split: {node.op} at {node.scope or '<root>'} cannot be split: "
                             f"{_REFUSED[node.op]}")


_REFUSED = {
    "all_reduce": "the graph is already split",
    "all_gather": "the graph is already split",
    "reduce_scatter": "the graph is already split",
    "all_gather_sequence": "the graph is already split",
    "scatter_sequence": "the graph is already split",
    "fake_quant": "QAT computes its weight scales at run time over the whole input axis; "
                  "train QAT on one rank (drop --tp/--ep)",
    "fake_quant_moving_average": "QAT activation scales are per device state; train QAT on one rank",
    "pact": "QAT is trained on one rank here (drop --tp/--ep)",
    "fp8_linear": "FP8 weights are quantized tensor-wise over the whole weight; serve fp8 on one rank",
    "fake_quant_fp8": "FP8 QAT is trained on one rank here",
    "weight_only_linear_packed": "split before legalization (compile does; put split before "
                                 "legalize-* in --pipeline)",
    "weight_only_linear_xpu": "split before legalization (compile does)",
    "unpack_weight": "split before legalization (compile does)",
    "unpack_weight_xpu": "split before legalization (compile does)",
}

_PASSTHROUGH = frozenset({"silu", "gelu", "cast", "rope"})
_LINEARS = frozenset({"linear", "weight_only_linear"})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]


def _replace_contents(graph: Graph, other: Graph) -> None:
    """Make `graph` (which a pass mutates in place) hold `other`'s nodes, params and interface."""
    for node in reversed(list(graph)):
        graph.erase(node, force=True)
    nodes = list(other)
    other._head = other._tail = None  # hand the chain over whole: nodes keep their inputs
    other._count = 0
    for node in nodes:
        node.graph = None
        node._prev = node._next = None
        graph.append(node)
    graph.inputs = other.inputs
    graph.params = other.params
    graph.outputs, graph.output_names = other.outputs, other.output_names
    graph.metadata = other.metadata


# -- the walk -------------------------------------------------------------------------------


@dataclass
class _RankBuilder:
    src: Graph
    mapping: Mapping
    rank: int
    lm_head: str
    sp: bool = False
    out: Graph = field(init=False)
    env: dict[Value, _Local] = field(default_factory=dict)
    gathered: dict[Value, Value] = field(default_factory=dict)
    params: dict[tuple[str, Any], Param] = field(default_factory=dict)
    cut_of: dict[str, tuple[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.info: RankLayout = self.mapping.rank(self.rank)
        self.tp = self.mapping.tp
        self.world = self.mapping.world_size
        self.out = Graph(self.src.name)
        self.out.metadata = dict(self.src.metadata)
        self.out.metadata["parallel"] = {"rank": self.rank, **self.mapping.model_dump(mode="json")}
        self.token_dims: tuple[Any, ...] | None = None
        if self.sp:
            self.out.metadata["parallel"]["sp"] = True
            if self.src.inputs:
                self.token_dims = tuple(self.src.inputs[0].type.shape)

    # ---- helpers
    def fail(self, node: Node, why: str, error: type[SplitError] = SplitError) -> SplitError:
        return error(f"split (tp {self.tp}, ep {self.mapping.ep}): {node.op} at "
                     f"{node.scope or '<root>'}: {why}")

    def emit(self, op: str, inputs: Sequence[Value | None], attrs: Any, scope: str) -> tuple[Value, ...]:
        # A global param reaching a node uncut is the whole tensor on this rank.
        ins = [self.param(v) if isinstance(v, Param) and self.src.params.get(v.name) is v else v
               for v in inputs]
        node = Node(op, ins, attrs, scope=scope)
        self.out.append(node)
        return node.outputs

    def param(self, p: Param, cuts: Sequence[tuple[int, list[tuple[int, int]]]] = ()) -> Param:
        """`p` cut along (axis, ranges) pairs: a new Param of this rank graph, shared per cut."""
        cuts = [(a % len(p.type.shape), _merged(rs)) for a, rs in cuts]
        cuts = [(a, rs) for a, rs in cuts if rs != [(0, p.type.shape[a])]]
        key = (p.name, tuple((a, tuple(rs)) for a, rs in cuts))
        hit = self.params.get(key)
        if hit is not None:
            return hit
        if p.name in self.cut_of:
            raise SplitError(f"split: param {p.name} is read with two different cuts on rank "
                             f"{self.rank}; give each reader its own param")
        shape = list(p.type.shape)
        source: WeightSource | None = p.source
        for axis, ranges in cuts:
            shape[axis] = sum(b - a for a, b in ranges)
            if source is not None:
                pieces = [source.sliced(axis, a, b) for a, b in ranges]
                source = pieces[0] if len(pieces) == 1 else ConcatSource(pieces, axis)
        ann = dict(p.annotations)
        if cuts:
            ann[SHARD] = {"global_shape": list(p.type.shape),
                          "cuts": [{"axis": a, "ranges": [list(r) for r in rs]} for a, rs in cuts]}
        new = Param(p.name, TensorType(p.type.dtype, shape), source, trainable=p.trainable,
                    annotations=ann)
        self.out.add_param(new)
        self.params[key] = new
        self.cut_of[p.name] = key
        return new

    def local(self, v: Value | None) -> _Local | None:
        if v is None:
            return None
        if isinstance(v, Param):
            return _Local(v)  # cut (or not) by the reader; emit() makes an uncut one whole
        return self.env[v]

    def whole(self, v: Value, scope: str) -> Value:
        """`v` replicated: all_reduce a partial (then its bias); refuse a sharded value."""
        loc = self.env[v] if not isinstance(v, Param) else _Local(self.param(v))
        if loc.layout == "R":
            return loc.value
        if isinstance(loc.layout, Tokens):
            hit = self.gathered.get(v)
            if hit is None:
                ids = self.env[self.src.inputs[0]].value
                (hit,) = self.emit("all_gather_sequence", [loc.value, ids],
                                   {"dims": len(self.token_dims or ()), "world_size": self.world}, scope)
                self.gathered[v] = hit
            return hit
        if isinstance(loc.layout, Partial):
            (red,) = self.emit("all_reduce", [loc.value], {"world_size": self.world}, scope)
            if loc.layout.bias is not None:
                (red,) = self.emit("add", [red, loc.layout.bias], {}, scope)
            self.env[v] = _Local(red)  # later readers reuse the reduced value
            return red
        raise SplitError(f"split: a value sharded along axis {loc.layout.axis} reaches {scope or '<root>'}"
                         " where the whole value is needed")

    # ---- sequence parallelism
    def token_shaped(self, v: Value) -> bool:
        dims = self.token_dims
        return dims is not None and v.type.rank > len(dims) and tuple(v.type.shape[:len(dims)]) == dims

    def tokens(self, v: Value, scope: str, scatter: bool = False) -> Value | None:
        """`v` on this rank's token shard (a partial one reduce-scattered, then its bias added; a
        replicated one sliced when `scatter`), or None when it is not token-shaped or is not on
        token shards and cannot be put there."""
        loc = self.env.get(v) if not isinstance(v, Param) else None
        if loc is None:
            return None
        if isinstance(loc.layout, Tokens):
            return loc.value
        if isinstance(loc.layout, Partial) and self.token_shaped(v):
            (y,) = self.emit("reduce_scatter", [loc.value],
                             {"dims": len(self.token_dims or ()), "world_size": self.world}, scope)
            if loc.layout.bias is not None:  # the row bias: after the reduce-scatter, once
                (y,) = self.emit("add", [y, loc.layout.bias], {}, scope)
            self.env[v] = _Local(y, Tokens())
            return y
        if scatter and loc.layout == "R" and self.token_shaped(v):
            (y,) = self.emit("scatter_sequence", [loc.value],
                             {"dims": len(self.token_dims or ()), "world_size": self.world}, scope)
            return y  # env keeps the whole value for its other readers
        return None

    def on_tokens(self, node: Node) -> list[_Local] | None:
        """A norm (or other per-token op) on the token shard of its first input; None when that
        input is not on (or cannot be put on) token shards; the other inputs must be whole
        per-feature values (weights, biases)."""
        if not self.sp or not node.inputs or node.inputs[0] is None:
            return None
        x = self.tokens(node.inputs[0], node.scope)
        if x is None:
            return None
        rest = []
        for v in node.inputs[1:]:
            if v is not None and not isinstance(v, Param) and self.token_shaped(v):
                return None
            rest.append(None if v is None else self.whole(v, node.scope))
        outs = self.emit(node.op, [x, *rest], node.attrs, node.scope)
        return [_Local(o, Tokens()) for o in outs]

    def op_rms_norm(self, node: Node) -> list[_Local]:
        return self.on_tokens(node) or self.generic(node)

    op_layer_norm = op_rms_norm

    # ---- the walk
    def build(self) -> Graph:
        for v in self.src.inputs:
            self.env[v] = _Local(self.out.add_input(v.name, v.type))
        for node in self.src:
            handler = getattr(self, "op_" + node.op, None)
            outs = handler(node) if handler is not None else self.generic(node)
            for old, new in zip(node.outputs, outs, strict=True):
                self.env[old] = new
        values, names = [], []
        for v, name in zip(self.src.outputs, self.src.output_names, strict=True):
            loc = self.local(v)
            assert loc is not None
            if isinstance(loc.layout, Sharded):
                if len(loc.layout.segs) != 1 or loc.layout.has_replicas:
                    raise SplitError(f"split: output {name} is sharded in parts; it cannot be gathered")
                (val,) = self.emit("all_gather", [loc.value],
                                   {"axis": loc.layout.axis, "world_size": self.world}, "")
            else:
                val = self.whole(v, "")
            values.append(val)
            names.append(name)
        self.out.set_outputs(values, names)
        return self.out

    def generic(self, node: Node) -> list[_Local]:
        """An op whose inputs must all be whole: cloned as is."""
        ins = [None if v is None else self.whole(v, node.scope) for v in node.inputs]
        return [_Local(o) for o in self.emit(node.op, ins, node.attrs, node.scope)]

    def passthrough(self, node: Node) -> list[_Local]:
        """Elementwise in the sharded dims (activations, casts, rope on heads)."""
        x = self.local(node.inputs[0])
        assert x is not None
        if isinstance(x.layout, Partial):
            return self.generic(node)
        rest = [self.whole(v, node.scope) if v is not None else None for v in node.inputs[1:]]
        (y,) = self.emit(node.op, [x.value, *rest], node.attrs, node.scope)
        return [_Local(y, x.layout)]

    op_silu = op_gelu = op_cast = op_rope = passthrough

    # ---- embeddings and heads
    def op_embedding(self, node: Node) -> list[_Local]:
        ids, table = node.inputs
        vocab_parallel = (self.tp > 1 and ids is self.src.inputs[0] and isinstance(table, Param)
                          and table.type.shape[0] == self.mapping.vocab_size
                          and not (self.lm_head == "replicate" and self._tied(table)))
        if not vocab_parallel:
            return self.generic(node)
        lo, hi = self.info.vocab or (0, 0)
        t = self.param(table, [(0, [(lo, hi)])])
        (y,) = self.emit("vocab_parallel_embedding", [self.whole(ids, node.scope), t],
                         {"vocab_start": lo, "vocab_size": self.mapping.vocab_size}, node.scope)
        return [_Local(y, Partial())]

    def _tied(self, table: Param) -> bool:
        return any(u.op == "lm_head" for u in table.users)

    def op_lm_head(self, node: Node) -> list[_Local]:
        x, w = node.inputs
        if self.tp == 1 or self.lm_head == "replicate" or not isinstance(w, Param):
            return self.generic(node)
        axis = 0 if node.attrs.transpose_weight else 1
        vocab = w.type.shape[axis]
        if vocab % self.tp:
            raise self.fail(node, f"{vocab} vocabulary columns do not divide into tp {self.tp} (or keep "
                                  "the head whole: split{lm_head=replicate})", DegreeError)
        n = vocab // self.tp
        r = self.info.tp_rank
        wp = self.param(w, [(axis, [(r * n, (r + 1) * n)])])
        (y,) = self.emit("lm_head", [self.whole(x, node.scope), wp], node.attrs, node.scope)
        return [_Local(y, Sharded(-1, (Seg(vocab, vocab),)))]

    # ---- linears
    def op_linear(self, node: Node) -> list[_Local]:
        return self._linear(node)

    op_weight_only_linear = op_linear

    def _linear(self, node: Node) -> list[_Local]:
        x = self.local(node.inputs[0])
        assert x is not None
        w = node.inputs[1]
        quant = node.op == "weight_only_linear"
        bias = node.inputs[3 if quant else 2] if len(node.inputs) > (3 if quant else 2) else None
        if not isinstance(w, Param) or (quant and not isinstance(node.inputs[2], Param)):
            return self.generic(node)
        group = node.attrs.group_size if quant else -1
        if isinstance(x.layout, (Partial, Tokens)):
            x = _Local(self.whole(node.inputs[0], node.scope))
        if x.layout == "R":
            if self.tp == 1:
                return self.generic(node)
            spec = self.column_spec(node)
            ranges = spec.ranges(self.tp, self.info.tp_rank)
            wq = self.param(w, [(-1, ranges)])
            ins: list[Value | None] = [x.value, wq]
            if quant:
                ins.append(self.param(node.inputs[2], [(-1, ranges)]))
            ins.append(self.param(bias, [(-1, ranges)]) if isinstance(bias, Param) else
                       (self.whole(bias, node.scope) if bias is not None else None))
            if bias is not None and not isinstance(bias, Param):
                raise self.fail(node, "a computed bias of a column-parallel linear cannot be cut")
            (y,) = self.emit(node.op, ins, node.attrs, node.scope)
            return [_Local(y, spec)]
        assert isinstance(x.layout, Sharded)
        if x.layout.axis != -1 or x.layout.has_replicas:
            raise self.fail(node, "its input is not sharded along its last axis")
        ranges = x.layout.ranges(self.tp, self.info.tp_rank)
        wq = self.param(w, [(-2, ranges)])
        ins = [x.value, wq]
        if quant:
            scale = node.inputs[2]
            assert isinstance(scale, Param)
            if group == -1:
                ins.append(self.param(scale))
            else:
                rows = _group_rows(ranges, group, int(w.type.shape[-2]))
                if rows is None:
                    raise self.fail(node, f"its rank slice of the input axis ({ranges}) is not made of "
                                          f"whole quantization groups of {group} (or use per-channel "
                                          "scales, group_size -1)", DegreeError)
                ins.append(self.param(scale, [(-2, rows)]))
        (y,) = self.emit(node.op, ins, node.attrs, node.scope)
        b = None if bias is None else (self.param(bias) if isinstance(bias, Param) else
                                       self.whole(bias, node.scope))
        return [_Local(y, Partial(b))]

    def column_spec(self, node: Node) -> Sharded:
        """How the output axis of a column-parallel linear is cut: the parts its readers split it
        into, each in whole heads where a reader reshapes it into heads."""
        out = node.outputs[0]
        total = out.type.shape[-1]
        assert isinstance(total, int)
        reader = _through_lora(out)
        parts: list[tuple[int, int, bool]] = []  # (size, unit, feeds attention's k/v)
        split = next((u for u in reader.users if u.op == "split" and u.attrs.axis in (-1, out.type.rank - 1)),
                     None)
        if split is not None:
            for size, piece in zip(split.attrs.sizes, split.outputs, strict=True):
                parts.append((size, *_head_unit(_through_lora(piece))))
        else:
            parts.append((total, *_head_unit(reader)))
        segs = []
        for size, unit, kv in parts:
            units = size // unit
            if units % self.tp == 0:
                segs.append(Seg(size, units))
            elif kv and self.tp % units == 0:
                segs.append(Seg(size, units, replicate=True))
            else:
                what = "heads" if unit > 1 else "columns"
                replicas = f" (KV heads also work when tp is a multiple of {units})" if kv else ""
                raise self.fail(node, f"{units} {what} do not divide into tp {self.tp}{replicas}",
                                DegreeError)
        return Sharded(-1, tuple(segs))

    # ---- LoRA
    def op_lora(self, node: Node) -> list[_Local]:
        base, x, a, b = (self.local(v) for v in node.inputs)
        assert base is not None and x is not None and a is not None and b is not None
        pa, pb = node.inputs[2], node.inputs[3]
        if not isinstance(pa, Param) or not isinstance(pb, Param):
            return self.generic(node)
        if isinstance(base.layout, Sharded) and isinstance(x.layout, Tokens):
            x = _Local(self.whole(node.inputs[1], node.scope))  # the column layer's gathered input
        if isinstance(base.layout, Sharded) and x.layout == "R":
            ranges = base.layout.ranges(self.tp, self.info.tp_rank)
            (y,) = self.emit("lora", [base.value, x.value, self.param(pa), self.param(pb, [(-1, ranges)])],
                             node.attrs, node.scope)
            return [_Local(y, base.layout)]
        if isinstance(base.layout, Partial) and isinstance(x.layout, Sharded):
            ranges = x.layout.ranges(self.tp, self.info.tp_rank)
            (y,) = self.emit("lora", [base.value, x.value, self.param(pa, [(-2, ranges)]), self.param(pb)],
                             node.attrs, node.scope)
            return [_Local(y, base.layout)]
        return self.generic(node)

    # ---- shapes
    def op_split(self, node: Node) -> list[_Local]:
        x = self.local(node.inputs[0])
        assert x is not None
        if not isinstance(x.layout, Sharded):
            return self.generic(node)
        rank = node.inputs[0].type.rank
        axis = node.attrs.axis - rank if node.attrs.axis >= 0 else node.attrs.axis
        if axis != x.layout.axis:
            outs = self.emit("split", [x.value], node.attrs, node.scope)
            return [_Local(o, x.layout) for o in outs]
        segs = list(x.layout.segs)
        groups: list[tuple[Seg, ...]] = []
        for size in node.attrs.sizes:
            take: list[Seg] = []
            while size > 0 and segs:
                s = segs.pop(0)
                take.append(s)
                size -= s.size
            if size != 0:
                raise self.fail(node, f"its sizes {list(node.attrs.sizes)} cross the shard parts "
                                      f"{[s.size for s in x.layout.segs]}")
            groups.append(tuple(take))
        sizes = [sum(s.local(self.tp) for s in g) for g in groups]
        outs = self.emit("split", [x.value], {"axis": node.attrs.axis, "sizes": sizes}, node.scope)
        return [_Local(o, Sharded(axis, g)) for o, g in zip(outs, groups, strict=True)]

    def op_concat(self, node: Node) -> list[_Local]:
        ins = [self.local(v) for v in node.inputs]
        if all(i is not None and i.layout == "R" for i in ins) or \
                any(i is not None and isinstance(i.layout, Tokens) for i in ins):
            return self.generic(node)
        rank = node.inputs[0].type.rank
        axis = node.attrs.axis - rank if node.attrs.axis >= 0 else node.attrs.axis
        if not all(i is not None and isinstance(i.layout, Sharded) and i.layout.axis == axis for i in ins):
            raise self.fail(node, "it joins sharded and whole values (or values sharded along another axis)")
        segs = tuple(s for i in ins for s in i.layout.segs)  # type: ignore[union-attr]
        (y,) = self.emit("concat", [i.value for i in ins], node.attrs, node.scope)  # type: ignore[union-attr]
        return [_Local(y, Sharded(axis, segs))]

    def op_reshape(self, node: Node) -> list[_Local]:
        x = self.local(node.inputs[0])
        assert x is not None
        if not isinstance(x.layout, Sharded):
            return self.generic(node)
        src = node.inputs[0].type.shape
        dst = node.outputs[0].type.shape
        ax = len(src) + x.layout.axis  # positive index of the sharded input axis
        target = list(node.attrs.shape)
        if any(t != 0 for t in target[:ax]) or (len(target) > ax and target[ax] == 0) or len(dst) <= ax:
            raise self.fail(node, "it moves dims in front of the sharded axis")
        in_rest = math.prod(int(d) for d in src[ax + 1:])
        out_rest = math.prod(int(d) for d in dst[ax + 1:])
        segs = []
        for s in x.layout.segs:
            size = s.size * in_rest
            if size % out_rest or (s.size // s.units * in_rest) % out_rest:
                raise self.fail(node, "it cuts a head or unit of the sharded axis apart")
            segs.append(Seg(size // out_rest, s.units, s.replicate))
        layout = Sharded(ax - len(dst), tuple(segs))
        target[ax] = layout.local(self.tp)
        (y,) = self.emit("reshape", [x.value], {"shape": target}, node.scope)
        return [_Local(y, layout)]

    # ---- elementwise
    def op_add(self, node: Node) -> list[_Local]:
        return self._binary(node)

    op_mul = op_add

    def _binary(self, node: Node) -> list[_Local]:
        a, b = (self.local(v) for v in node.inputs)
        assert a is not None and b is not None
        la, lb = a.layout, b.layout
        if la == "R" and lb == "R":
            return self.generic(node)
        if node.op == "add" and isinstance(la, Partial) and isinstance(lb, Partial):
            if la.bias is not None and lb.bias is not None:
                return self.generic(node)
            (y,) = self.emit("add", [a.value, b.value], node.attrs, node.scope)
            return [_Local(y, Partial(la.bias or lb.bias))]
        if isinstance(la, Tokens) or isinstance(lb, Tokens) or (
                self.sp and node.op == "add" and {type(la), type(lb)} == {Partial, str}
                and all(self.token_shaped(v) for v in node.inputs)):
            return self._binary_tokens(node)  # GPT: the token embedding (partial) + the positions
        if isinstance(la, Sharded) and isinstance(lb, Sharded) and la == lb:
            (y,) = self.emit(node.op, [a.value, b.value], node.attrs, node.scope)
            return [_Local(y, la)]
        for sh, other, o_index in ((a, b, 1), (b, a, 0)):
            p = node.inputs[o_index]
            if isinstance(sh.layout, Sharded) and other.layout == "R" and isinstance(p, Param):
                axis = sh.layout.axis
                if p.type.rank >= -axis and p.type.shape[axis] == sh.layout.size:
                    cut = self.param(p, [(axis, sh.layout.ranges(self.tp, self.info.tp_rank))])
                    ins = [sh.value, cut] if o_index == 1 else [cut, sh.value]
                    (y,) = self.emit(node.op, ins, node.attrs, node.scope)
                    return [_Local(y, sh.layout)]
        if isinstance(la, Sharded) or isinstance(lb, Sharded):
            raise self.fail(node, "it combines a sharded value with a whole or differently sharded one")
        return self.generic(node)

    def _binary_tokens(self, node: Node) -> list[_Local]:
        """add/mul with a token-sharded operand: the other one put on token shards too (a partial
        one reduce-scattered: the residual add after a row-parallel block; a whole one sliced), or
        broadcast whole (a per-feature param); otherwise both gathered whole."""
        ins = []
        for v in node.inputs:
            t = self.tokens(v, node.scope, scatter=True)
            if t is None:
                if not isinstance(v, Param) and self.token_shaped(v):
                    return self.generic(node)  # token-shaped but sharded otherwise: both gathered
                t = self.whole(v, node.scope)
            ins.append(t)
        (y,) = self.emit(node.op, ins, node.attrs, node.scope)
        return [_Local(y, Tokens())]

    # ---- attention
    def op_attention(self, node: Node) -> list[_Local]:
        q = self.local(node.inputs[0])
        assert q is not None
        if not isinstance(q.layout, Sharded):
            return self.generic(node)
        ins = []
        for v in node.inputs:
            loc = self.local(v)
            if loc is None:
                ins.append(None)
            elif isinstance(loc.layout, Sharded):
                if loc.layout.axis != -2:
                    raise self.fail(node, "its q/k/v are not sharded along the head axis")
                ins.append(loc.value)
            else:
                raise self.fail(node, "q is sharded by heads but k, v or the mask is not")
        (y,) = self.emit("attention", ins, node.attrs, node.scope)
        return [_Local(y, Sharded(-2, tuple(Seg(s.size, s.units) for s in q.layout.segs)))]

    # ---- experts
    def op_dequantize(self, node: Node) -> list[_Local]:
        readers = node.outputs[0].users
        if readers and all(u.op in ("moe_experts", "moe_experts_lora") for u in readers):
            # emitted by the expert op, which knows the cut of each weight
            return [_Local(node.outputs[0], "R")]
        return self.generic(node)

    op_wint2_dequantize = op_dequantize  # 2-bit expert stacks: cut by wint2_weight

    def op_moe_experts(self, node: Node) -> list[_Local]:
        if self.world == 1:
            return self.generic(node)
        x = self.whole(node.inputs[0], node.scope)
        weights = self.whole(node.inputs[1], node.scope)
        indices = self.whole(node.inputs[2], node.scope)
        up_gate, down = node.inputs[3], node.inputs[4]
        experts = up_gate.type.shape[0]
        assert isinstance(experts, int)
        first, stop = self.info.experts or (0, experts)
        if (first, stop) != (0, experts):
            weights, indices = self.emit("moe_local_experts", [weights, indices],
                                         {"first": first, "count": stop - first}, node.scope)
        moe_tp, index = self.mapping.moe_tp, self.info.moe_tp_rank
        inter = down.type.shape[1]
        assert isinstance(inter, int)
        if inter % moe_tp:
            raise self.fail(node, f"the expert intermediate size {inter} does not divide into "
                                  f"{moe_tp} parts (whole experts per rank, --ep = --tp, need none)",
                            DegreeError)
        e_cut = (0, [(first, stop)])
        gate_up = Sharded(-1, (Seg(inter, inter), Seg(inter, inter))).ranges(moe_tp, index)
        rows = Sharded(-1, (Seg(inter, inter),)).ranges(moe_tp, index)
        ins: list[Value | None] = [x, weights, indices,
                                   self.expert_weight(up_gate, e_cut, (-1, gate_up), column=True),
                                   self.expert_weight(down, e_cut, (-2, rows), column=False)]
        if node.op == "moe_experts_lora":
            extra = list(node.inputs[5:]) + [None] * (9 - len(node.inputs))
            ug_a, ug_b, dn_a, dn_b = extra[:4]
            for p, cut in ((ug_a, None), (ug_b, (-1, gate_up)), (dn_a, (-2, rows)), (dn_b, None)):
                if p is None:
                    ins.append(None)
                    continue
                if not isinstance(p, Param):
                    raise self.fail(node, "its LoRA weights are computed values; split before "
                                          "anything computes them")
                ins.append(self.param(p, [e_cut] + ([cut] if cut else [])))
        (y,) = self.emit(node.op, ins, node.attrs, node.scope)
        return [_Local(y, Partial())]

    op_moe_experts_lora = op_moe_experts

    def op_moe_experts_w4a8(self, node: Node) -> list[_Local]:
        """W4A8 experts (ernie_ir/ops/moe_w4a8.py): cut as moe_experts; each expert's weight scales
        follow its output columns (down's stay whole: per output channel), its input scales
        [E] follow the experts only (every rank quantizes its slice with the global scale)."""
        if self.world == 1:
            return self.generic(node)
        x, weights, indices = (self.whole(v, node.scope) for v in node.inputs[:3])  # type: ignore[arg-type]
        params = node.inputs[3:9]
        if not all(isinstance(p, Param) for p in params):
            raise self.fail(node, "its weights and scales are computed values; split before anything "
                                  "computes them")
        ug, ugs, ugi, dn, dns, dni = params  # type: ignore[misc]
        experts, inter = ug.type.shape[0], dn.type.shape[1]
        assert isinstance(experts, int) and isinstance(inter, int)
        first, stop = self.info.experts or (0, experts)
        if (first, stop) != (0, experts):
            weights, indices = self.emit("moe_local_experts", [weights, indices],
                                         {"first": first, "count": stop - first}, node.scope)
        moe_tp, index = self.mapping.moe_tp, self.info.moe_tp_rank
        block = node.attrs.hadamard_block  # type: ignore[attr-defined]
        if inter % moe_tp or (block and (inter // moe_tp) % block):
            raise self.fail(node, f"the expert intermediate size {inter} does not divide into {moe_tp} "
                                  f"parts of whole Hadamard blocks of {block or 1}", DegreeError)
        e_cut = (0, [(first, stop)])
        gate_up = (-1, Sharded(-1, (Seg(inter, inter), Seg(inter, inter))).ranges(moe_tp, index))
        rows = (-2, Sharded(-1, (Seg(inter, inter),)).ranges(moe_tp, index))
        ins = [x, weights, indices, self.param(ug, [e_cut, gate_up]), self.param(ugs, [e_cut, gate_up]),
               self.param(ugi, [e_cut]), self.param(dn, [e_cut, rows]), self.param(dns, [e_cut]),
               self.param(dni, [e_cut])]
        (y,) = self.emit(node.op, ins, node.attrs, node.scope)
        return [_Local(y, Partial())]

    # ---- C8 KV cache (ernie_ir/ops/kv_cache_int8.py)
    def op_kv_cache_quantize(self, node: Node) -> list[_Local]:
        """The per-channel abs-maxes [KV, D] are cut as the keys' heads: a rank holds the global
        scales of its own heads (replicated heads: the same heads' scales)."""
        x, absmax = self.local(node.inputs[0]), node.inputs[1]
        assert x is not None
        if not isinstance(x.layout, Sharded):
            return self.generic(node)
        if x.layout.axis != -2 or not isinstance(absmax, Param):
            raise self.fail(node, "its keys/values are not sharded along the head axis")
        cut = self.param(absmax, [(-2, x.layout.ranges(self.tp, self.info.tp_rank))])
        (y,) = self.emit(node.op, [x.value, cut], node.attrs, node.scope)
        return [_Local(y, x.layout)]

    op_kv_cache_dequantize = op_kv_cache_quantize

    def expert_weight(self, v: Value, e_cut: tuple[int, list[tuple[int, int]]],
                      cut: tuple[int, list[tuple[int, int]]], *, column: bool) -> Value:
        if isinstance(v, Param):
            return self.param(v, [e_cut, cut])
        node = v.producer
        if node is not None and node.op == "wint2_dequantize" and \
                all(isinstance(i, Param) for i in node.inputs):
            return self.wint2_weight(node, e_cut, cut, column=column)
        if node is None or node.op != "dequantize" or not all(isinstance(i, Param) for i in node.inputs):
            raise SplitError(f"split: expert weight {v} is neither a param nor a dequantized param")
        q, scale = node.inputs
        assert isinstance(q, Param) and isinstance(scale, Param)
        group = node.attrs.group_size
        if column:
            scale_cut = [e_cut, (-1, cut[1])]
        elif group == -1:
            scale_cut = [e_cut]  # per output channel over the whole input axis: kept whole
        else:
            rows = _group_rows(cut[1], group, int(q.type.shape[-2]))
            if rows is None:
                raise DegreeError(f"split: expert down_proj rows {cut[1]} are not whole quantization "
                                  f"groups of {group}; use per-channel scales, or whole experts per "
                                  "rank (--ep equal to the world size)")
            scale_cut = [e_cut, (-2, rows)]
        (w,) = self.emit("dequantize", [self.param(q, [e_cut, cut]), self.param(scale, scale_cut)],
                         node.attrs, node.scope)
        return w

    def wint2_weight(self, node: Node, e_cut: tuple[int, list[tuple[int, int]]],
                     cut: tuple[int, list[tuple[int, int]]], *, column: bool) -> Value:
        """A 2-bit expert stack (ernie_ir/ops/wint2.py): columns (up_gate) cut every param along N;
        rows (down_proj) cut the codes in 4-row units and the scale bytes in 128-row units, the
        per-column super_scales / code_scale / code_zp kept whole. A cut inside a code or a scale
        byte is refused (DegreeError)."""
        qw, ws, ss, cs, zp = node.inputs
        assert all(isinstance(p, Param) for p in (qw, ws, ss, cs, zp))
        if column:
            cols = [e_cut, (-1, cut[1])]
            ins = [self.param(p, cols) for p in (qw, ws, ss, cs, zp)]  # type: ignore[arg-type]
        else:
            k = 4 * int(qw.type.shape[-2])  # type: ignore[union-attr]
            bad = [(a, b) for a, b in _merged(cut[1]) if a % 128 or b % 128]
            if bad:
                raise DegreeError(f"split: the WINT2 down_proj rows {bad[0]} of {k} at "
                                  f"{node.scope or '<root>'} "
                                  "cut a 128-row scale byte (two 64-row group scales) or a 4-row code: "
                                  f"the expert intermediate size per rank must be a multiple of 128 (use a "
                                  "tp that divides it so, or --ep)")
            codes = [(a // 4, b // 4) for a, b in cut[1]]
            scales = [(a // 128, b // 128) for a, b in cut[1]]
            ins = [self.param(qw, [e_cut, (-2, codes)]), self.param(ws, [e_cut, (-2, scales)]),  # type: ignore[arg-type]
                   *(self.param(p, [e_cut]) for p in (ss, cs, zp))]  # type: ignore[arg-type]
        (w,) = self.emit("wint2_dequantize", ins, node.attrs, node.scope)
        return w


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent [start, stop) ranges joined (a rank holding [0, 8) and [8, 16) holds [0, 16))."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _group_rows(ranges: Sequence[tuple[int, int]], group: int, rows: int) -> list[tuple[int, int]] | None:
    """The scale rows (one per group of `group` input rows) of a rank's input rows, or None
    when a range does not start on a group boundary or ends inside a group (the last, partial
    group of an axis that is not a multiple of `group` counts as whole)."""
    out = []
    for a, b in _merged(ranges):
        if a % group or (b % group and b != rows):
            return None
        out.append((a // group, -(-b // group)))
    return out


def _through_lora(v: Value) -> Value:
    """The value readers see: a linear's output, or the LoRA adapter added to it."""
    for u in v.users:
        if u.op == "lora" and u.inputs[0] is v:
            return u.outputs[0]
    return v


def _head_unit(v: Value) -> tuple[int, bool]:
    """(elements per head, whether the heads feed attention's k or v) for a value a reader
    reshapes into [..., heads, head_dim...]; (1, False) when no reader does."""
    for u in v.users:
        if u.op != "reshape":
            continue
        shape = u.outputs[0].type.shape
        rank = v.type.rank
        unit = math.prod(int(d) for d in shape[rank:]) if len(shape) > rank else 1
        return unit, _feeds_kv(u.outputs[0])
    return 1, False


def _feeds_kv(v: Value) -> bool:
    for u in v.users:
        if u.op == "attention" and any(u.inputs[i] is v for i in (1, 2)):
            return True
        if u.op in ("rope", "cast", "kv_cache_quantize", "kv_cache_dequantize") and _feeds_kv(u.outputs[0]):
            return True
    return False
