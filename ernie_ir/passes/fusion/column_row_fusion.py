"""Fusing projections that read one value (columns) or feed one sum (rows), and the inverses.

Columns (q/k/v, gate/up, ERNIE-3.5-SE's qkv_gate_up):

    y_i = x @ W_i + b_i      ->   y = x @ W + b,   y_i = the columns of y that W_i became

Rows (ERNIE-3.5-SE's o_proj over [ffn, attn]):

    sum_i (x_i @ W_i + b_i)  ->   concat(x_1, x_2, ...) @ [W_1; W_2; ...] + (b_1 + b_2 + ...)

Both are exact (the same products, summed in another order for rows). Every
fused or cut param is a lazy view of the params it came from
(`weight_views`); a param that passes through whole (a shared LoRA A, a
row layer's per-channel scales, the one bias of a row sum) is kept as it is,
name included, so unfusing and fusing again reproduces the graph.

Quantization: weight-only int values are joined or cut like float weights;
per-output-channel scales join and cut with their columns, and so do
group-wise scales ([K / g, N], along N). Rows need one scale per output
column over all rows: per-channel scales must be one shared param (as
unfusing a fused row layer leaves them), group-wise scales stack along K
when every part is whole groups. Fake-quant (QAT) weights join by columns
when their scales are per output channel; a per-tensor scale, mixed
quantizations, or fake-quant over rows are refused with the reason.

LoRA: an adapter stays with the projection it was trained for. Parts whose
adapters share one A (the per-part form of one fused adapter) fuse into one
adapter, A with B joined; parts with adapters of their own keep them, each
applied to its columns of the fused output (rows: each to its own input), so
nothing is retrained or re-factored and the result is exact. The block
diagonal form (A joined, B = diag(B_1, B_2, ...)) is not used: training it
would fill the zero blocks and turn r-rank adapters into one 3r-rank adapter.

Rank graphs (after `split`): parts cut for tensor parallelism fuse into the
param `split` makes of the fused global weight: same global name, same
`shard` annotation, the same values; unfusing a cut weight is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ernie_ir.ir import DType, Graph, GraphBuilder, Node, Param, TensorType, Value
from ernie_ir.ir.printer import format_dict

from ..infra.dataflow_rule import Refusal
from ..parallel.split import SHARD, shard_of
from .projection import Adapter, Projection
from .weight_views import SumSource, concat_view, gather_view, slice_view, zeros

# -- the order of parts in a fused axis ------------------------------------------------------------


@dataclass(frozen=True)
class ColumnOrder:
    """Where each part's columns sit in the fused axis.

    The first `interleave` parts alternate per head (ERNIE-3.5-SE's and GPT's
    per-head qkv: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], heads of `head_dim`),
    then the other parts follow whole, in order ([Q | K | V], [gate | up]).
    """

    widths: tuple[int, ...]
    interleave: int = 0
    head_dim: int = 0

    @property
    def total(self) -> int:
        return sum(self.widths)

    def pieces(self) -> list[tuple[int, int, int]]:
        """(part, start, stop) of each run of fused columns, in fused order."""
        out: list[tuple[int, int, int]] = []
        g, hd = self.interleave, self.head_dim
        if g:
            for h in range(self.widths[0] // hd):
                out.extend((j, h * hd, (h + 1) * hd) for j in range(g))
        out.extend((i, 0, self.widths[i]) for i in range(g, len(self.widths)))
        return out

    def ranges(self) -> list[list[tuple[int, int]]]:
        """Per part, the fused-axis ranges that hold its columns (in the part's order)."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.widths]
        offset = 0
        for i, a, b in self.pieces():
            rs = out[i]
            if rs and rs[-1][1] == offset:
                rs[-1] = (rs[-1][0], offset + b - a)
            else:
                rs.append((offset, offset + b - a))
            offset += b - a
        return out

    def groups(self) -> list[int]:
        """Widths of the fused axis's contiguous groups: [interleaved parts], then each other part."""
        g = self.interleave
        return ([sum(self.widths[:g])] if g else []) + list(self.widths[g:])


# -- params --------------------------------------------------------------------------------------


def _annotations(params: Sequence[Param], what: str) -> dict[str, Any]:
    """The annotations the parts share (without their shard); Refusal if they differ."""
    first = {k: v for k, v in params[0].annotations.items() if k != SHARD}
    for p in params[1:]:
        other = {k: v for k, v in p.annotations.items() if k != SHARD}
        if format_dict(other) != format_dict(first):
            raise Refusal(f"{what}: @{params[0].name} and @{p.name} are annotated differently "
                          f"({format_dict(first) or '{}'} vs {format_dict(other) or '{}'})")
    return first


def _trainable(params: Sequence[Param], what: str) -> bool:
    flags = {p.trainable for p in params}
    if len(flags) > 1:
        raise Refusal(f"{what}: some parts are trainable and others are not")
    return flags.pop()


def _join_shard(params: Sequence[Param | None], axis: int, order: ColumnOrder, what: str
                ) -> dict[str, Any] | None:
    """The `shard` annotation of the joined param, from its parts' (None: not a rank graph)."""
    present = [p for p in params if p is not None]
    infos = [shard_of(p) for p in present]
    if all(i is None for i in infos):
        return None
    if len(present) != len(params):
        raise Refusal(f"{what}: some parts have a bias and others not, on a split graph")
    widths, cut_ranges, other = [], [], None
    for p, info in zip(present, infos, strict=True):
        shape = list(info["global_shape"]) if info else list(p.type.shape)
        ranges = [(0, shape[axis])]
        for c in info["cuts"] if info else []:
            if c["axis"] != axis:
                raise Refusal(f"{what}: @{p.name} is cut along axis {c['axis']} too")
            ranges = [(int(a), int(b)) for a, b in c["ranges"]]
        rest = shape[:axis] + shape[axis + 1:]
        if other is not None and rest != other:
            raise Refusal(f"{what}: the parts' global shapes differ off the fused axis")
        other = rest
        widths.append(int(shape[axis]))
        cut_ranges.append(ranges)
    g, hd = order.interleave, order.head_dim
    fused: list[tuple[int, int]] = []
    if g:
        heads = cut_ranges[0]
        if any(r != heads for r in cut_ranges[1:g]):
            raise Refusal(f"{what}: the interleaved parts hold different heads on this rank")
        if any(a % hd or b % hd for a, b in heads):
            raise Refusal(f"{what}: a rank cut splits a head")
        fused = [(a // hd * g * hd, b // hd * g * hd) for a, b in heads]
    offset = sum(widths[:g])
    for w, ranges in zip(widths[g:], cut_ranges[g:], strict=True):
        fused.extend((offset + a, offset + b) for a, b in ranges)
        offset += w
    global_shape = list(other or [])
    global_shape.insert(axis, offset)
    merged: list[tuple[int, int]] = []  # adjacent ranges as one, as `split` records them
    for a, b in fused:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    fused = merged
    if fused == [(0, offset)]:
        return None
    return {"global_shape": global_shape, "cuts": [{"axis": axis, "ranges": [list(r) for r in fused]}]}


def joined_param(name: str, params: Sequence[Param | None], axis: int, order: ColumnOrder, what: str,
                 dtype: DType | None = None) -> Param:
    """The parts joined along `axis` in `order` (None parts are zeros of `dtype`), as a lazy view."""
    present = [p for p in params if p is not None]
    dt = dtype or present[0].type.dtype
    if any(p.type.dtype != dt for p in present):
        raise Refusal(f"{what}: the parts' dtypes differ "
                      f"({', '.join(str(p.type.dtype) for p in present)})")
    rank = present[0].type.rank
    axis %= rank
    sources = []
    for p, w in zip(params, order.widths, strict=True):
        if p is None:
            shape = list(present[0].type.shape)
            shape[axis] = w
            sources.append(zeros(dt, shape) if all(q.has_data for q in present) else None)
        else:
            sources.append(p.source)
    src = None
    if all(s is not None for s in sources):
        src = concat_view([slice_view(sources[i], axis, a, b) for i, a, b in order.pieces()], axis)
    shape = list(present[0].type.shape)
    shape[axis] = order.total
    ann = _annotations(present, what)
    shard = _join_shard(params, axis, order, what)
    if shard is not None:
        ann[SHARD] = shard
    return Param(name, TensorType(dt, shape), src, trainable=_trainable(present, what), annotations=ann)


def cut_param(name: str, fused: Param, axis: int, ranges: Sequence[tuple[int, int]]) -> Param:
    """`fused`'s ranges along `axis`, joined, as a lazy view under a new name."""
    if SHARD in fused.annotations:
        raise Refusal(f"@{fused.name} is one rank's shard of a split graph: unfuse before split")
    axis %= fused.type.rank
    shape = list(fused.type.shape)
    shape[axis] = sum(b - a for a, b in ranges)
    return Param(name, TensorType(fused.type.dtype, shape), gather_view(fused.source, axis, ranges),
                 trainable=fused.trainable, annotations=dict(fused.annotations))


def names(module: str, kind: str) -> dict[str, str]:
    """A layer's param names (FastDeploy's for weight-only, paddleformers' for LoRA)."""
    return {"weight": f"{module}.quant_weight" if kind == "weight_only" else f"{module}.weight",
            "scale": f"{module}.weight_scale", "bias": f"{module}.bias",
            "lora_A": f"{module}.lora_A", "lora_B": f"{module}.lora_B"}


# -- one rewrite: new nodes before an anchor, new params, old nodes and params removed ----------


class Edit:
    """Collects a rewrite's new params and dead nodes; `finish` erases, adds and orders them.

    New params are added after the old ones are gone (a fused param may take a part's name)
    and listed where the first replaced param was, in the order of the params they stand for."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.before = list(graph.params)
        self.new: list[tuple[Param, Param | None]] = []
        self.dead: list[Node] = []
        self.replaced: list[Param] = []

    def builder(self, anchor: Node) -> GraphBuilder:
        b = GraphBuilder(self.graph)
        b.insert_point = anchor
        return b

    def param(self, p: Param, like: Param | None = None) -> Param:
        self.new.append((p, like))
        return p

    def drop(self, nodes: Sequence[Node], params: Sequence[Param] = ()) -> None:
        self.dead.extend(nodes)
        self.replaced.extend(params)

    def finish(self) -> None:
        g = self.graph
        pending = list(dict.fromkeys(self.dead))
        while pending:
            free = [n for n in pending if not any(v.num_uses() or v in g.outputs for v in n.outputs)]
            if not free:
                raise AssertionError(f"fusion left readers of {pending[0]}")  # a bug, not bad input
            for n in free:
                if n.graph is g:
                    g.erase(n)
                pending.remove(n)
        removed = set()
        for p in self.replaced:
            if not p.num_uses() and g.params.get(p.name) is p:
                g.remove_param(p.name)
                removed.add(p.name)
        new = [(p, like) for p, like in self.new if p.num_uses()]
        for p, _ in new:
            g.add_param(p)
        # Each new param takes the place of the removed param it stands for (others go where the
        # first removed param was), so unfusing and fusing again restores the printed order too.
        index = {n: i for i, n in enumerate(self.before)}
        first = min((index[n] for n in removed), default=len(self.before))
        slots: dict[int, list[str]] = {}
        for p, like in new:
            slot = index[like.name] if like is not None and like.name in removed else first
            slots.setdefault(slot, []).append(p.name)
        order: list[str] = []
        for i, n in enumerate([*self.before, None]):
            order.extend(slots.get(i, ()))
            if n is not None and n in g.params and n not in order:
                order.append(n)
        order.extend(n for n in g.params if n not in order)
        g.params = {n: g.params[n] for n in order}


def first_in_graph(graph: Graph, nodes: Sequence[Node]) -> Node:
    wanted = set(nodes)
    for n in graph:
        if n in wanted:
            return n
    raise AssertionError("nodes are not in the graph")


def _flat_shape(rank: int, width: int) -> tuple[int, ...]:
    return (0,) * (rank - 1) + (width,)


def _heads_shape(rank: int, heads: int, head_dim: int) -> tuple[int, ...]:
    return (0,) * (rank - 1) + (heads, head_dim)


def _scope(parts: Sequence[Projection], module: str) -> str:
    """The fused linear's scope: its module, where the parts follow that convention."""
    if all(p.node.scope == p.module for p in parts):
        return module
    return _common_prefix([p.node.scope for p in parts])


def _common_prefix(scopes: Sequence[str]) -> str:
    split = [s.split(".") for s in scopes if s]
    if not split:
        return ""
    out = []
    for comps in zip(*split, strict=False):
        if len(set(comps)) != 1:
            break
        out.append(comps[0])
    return ".".join(out)


def _same_quantization(parts: Sequence[Projection], what: str) -> None:
    kinds = {p.kind for p in parts}
    if len(kinds) > 1:
        listed = ", ".join(p.describe() for p in parts)
        raise Refusal(f"{what}: mismatched quantization ({listed})")
    p0 = parts[0]
    for p in parts[1:]:
        if p.weight.type.dtype != p0.weight.type.dtype:
            raise Refusal(f"{what}: mismatched weights ({p0.describe()} vs {p.describe()})")
        if p.group_size != p0.group_size:
            raise Refusal(f"{what}: mismatched quantization group sizes ({p0.describe()} vs {p.describe()})")
        if p.scale is not None and p0.scale is not None and p.scale.type.dtype != p0.scale.type.dtype:
            raise Refusal(f"{what}: the scales' dtypes differ ({p0.scale.type} vs {p.scale.type})")
        if p.fake_quant is not None and p0.fake_quant is not None and \
                p.fake_quant.attrs != p0.fake_quant.attrs:
            raise Refusal(f"{what}: the parts are fake-quantized differently")


def _channel_fake_quant(p: Projection, what: str) -> None:
    assert p.fake_quant is not None
    axes = tuple(a % 2 for a in p.fake_quant.attrs.axes)
    if axes != (1,):
        how = "one per-tensor (abs_max) scale" if not axes else f"scales along axes {list(axes)}"
        raise Refusal(f"{what}: {p.module}'s weight is fake-quantized with {how}; only per-output-channel "
                      "scales concatenate")


def _merged_adapter(adapters: Sequence[Adapter | None], shared: str) -> Adapter | None:
    """The adapter to fuse when every part's adapter shares one `shared` param ('a' or 'b')."""
    if not adapters or any(a is None for a in adapters):
        return None
    first = adapters[0]
    assert first is not None
    for a in adapters[1:]:
        assert a is not None
        if getattr(a, shared) is not getattr(first, shared) or a.key != first.key:
            return None
    return first


def _lora(b: GraphBuilder, base: Value, x: Value, a: Param, bb: Param, like: Adapter,
          scope: str | None = None) -> Value:
    """An adapter with `like`'s scale and dropout (scope: `like`'s unless given)."""
    with b.at_scope(like.node.scope if scope is None else scope):
        return b.lora(base, x, a, bb, scale=like.node.attrs.scale, dropout=like.node.attrs.dropout)


def _like(p: Projection, key: str) -> Param | None:
    """The param of `p` that a new param of role `key` stands for (orders the new params)."""
    if key in ("lora_A", "lora_B"):
        return None if p.adapter is None else (p.adapter.a if key == "lora_A" else p.adapter.b)
    return {"weight": p.weight, "scale": p.scale, "bias": p.bias}[key]


def _layer(b: GraphBuilder, p0: Projection, x: Value, w: Param, scale: Param | None, bias: Param | None,
           scope: str) -> Value:
    """The linear node of a projection of p0's kind over new params."""
    with b.at_scope(scope):
        if p0.kind == "weight_only":
            return b.weight_only_linear(x, w, scale, bias, group_size=p0.group_size)
        weight: Value = w
        if p0.fake_quant is not None:
            weight = b.fake_quant(w, **p0.fake_quant.attrs.model_dump())
        return b.linear(x, weight, bias) if bias is not None else b.linear(x, weight)


# -- columns -------------------------------------------------------------------------------------


@dataclass
class ColumnFusion:
    """Join `parts` (reading one x) into one projection over `order`'s columns."""

    parts: list[Projection]
    order: ColumnOrder
    module: str
    glue_scope: str
    heads: int = 0
    """Heads of each interleaved part (its width / head_dim)."""
    head_readers: list[list[Node]] = field(default_factory=list)
    params: dict[str, Param | None] = field(default_factory=dict)
    merged: Adapter | None = None

    def check(self, graph: Graph) -> ColumnFusion:
        what = f"fusing {', '.join(p.module for p in self.parts)}"
        x = self.parts[0].x
        if any(p.x is not x for p in self.parts):
            raise Refusal(f"{what}: the projections read different values (each has its own input, "
                          "e.g. an activation fake-quant per linear: fuse before qat-insert)")
        if len({id(p.node) for p in self.parts}) != len(self.parts):
            raise Refusal(f"{what}: one linear plays two parts")
        _same_quantization(self.parts, what)
        for p in self.parts:
            if p.fake_quant is not None:
                _channel_fake_quant(p, what)
        o = self.order
        if o.interleave:
            if len(set(o.widths[:o.interleave])) != 1 or o.widths[0] % o.head_dim:
                raise Refusal(f"{what}: a per-head layout needs parts of equal width in whole heads "
                              f"({list(o.widths[:o.interleave])}, head dim {o.head_dim})")
            self.heads = o.widths[0] // o.head_dim
            for p in self.parts[:o.interleave]:
                readers = [u for u in p.out.users if u.op == "reshape" and
                           tuple(u.outputs[0].type.shape) ==
                           (*p.out.type.shape[:-1], self.heads, o.head_dim)]
                self.head_readers.append(readers)
        kind = self.parts[0].kind
        n = names(self.module, kind)
        self.params["weight"] = joined_param(n["weight"], [p.weight for p in self.parts], 1, o, what)
        if kind == "weight_only":
            scales = [p.scale for p in self.parts]
            self.params["scale"] = joined_param(n["scale"], scales, -1, o, what)
        biases = [p.bias for p in self.parts]
        self.params["bias"] = None
        if any(b is not None for b in biases):
            self.params["bias"] = joined_param(n["bias"], biases, 0, o, f"{what} (biases)")
        self.merged = _merged_adapter([p.adapter for p in self.parts], "a")
        if self.merged is not None:
            bs = [p.adapter.b for p in self.parts]  # type: ignore[union-attr]
            self.params["lora_B"] = joined_param(n["lora_B"], bs, -1, o, f"{what} (LoRA B)")
        _check_new_names(graph, self.params.values(), self.parts)
        return self

    def apply(self, graph: Graph, edit: Edit) -> Value:
        """Build the fused layer before the first part and rewire the parts' readers."""
        parts, o = self.parts, self.order
        p0 = parts[0]
        x = p0.x
        # before the first part's linear (which reads x); a fake_quant of a weight may sit earlier
        b = edit.builder(first_in_graph(graph, [p.node for p in parts]))
        w, scale, bias = (self.params.get(k) for k in ("weight", "scale", "bias"))
        assert w is not None
        for key, p in self.params.items():
            if p is not None:
                edit.param(p, _like(p0, key))
        scope = _scope(parts, self.module)
        y = _layer(b, p0, x, w, scale, bias, scope)
        if self.merged is not None:
            bb = self.params["lora_B"]
            assert bb is not None
            y = _lora(b, y, x, self.merged.a, bb, self.merged, scope)
        rank = y.type.rank
        with b.at_scope(self.glue_scope):
            groups = o.groups()
            pieces = list(b.split(y, axis=-1, sizes=tuple(groups))) if len(groups) > 1 else [y]
            heads4: list[Value] = []
            if o.interleave:
                width = o.interleave * o.head_dim
                per_head = b.reshape(pieces[0], shape=_heads_shape(rank, self.heads, width))
                heads4 = list(b.split(per_head, axis=-1, sizes=(o.head_dim,) * o.interleave))
        for i, p in enumerate(parts):
            own = p.adapter if self.merged is None else None
            if i < o.interleave:
                h4 = heads4[i]
                if own is None:
                    for r in self.head_readers[i]:
                        graph.replace_all_uses_with(r.outputs[0], h4)
                        edit.drop([r])
                    if set(p.out.users) - set(self.head_readers[i]):  # readers of the flat value
                        with b.at_scope(self.glue_scope):
                            flat = b.reshape(h4, shape=_flat_shape(rank, o.widths[i]))
                        graph.replace_all_uses_with(p.out, flat)
                    continue
                with b.at_scope(self.glue_scope):
                    flat = b.reshape(h4, shape=_flat_shape(rank, o.widths[i]))
            else:
                flat = pieces[i - o.interleave + (1 if o.interleave else 0)]
            new = _lora(b, flat, x, own.a, own.b, own) if own is not None else flat
            graph.replace_all_uses_with(p.out, new)
        for p in parts:
            edit.drop(p.nodes, p.params)
        return y


@dataclass
class ColumnSplit:
    """Cut the fused projection `fused` into parts over `order`'s columns (inverse of ColumnFusion).

    `pieces[i]` is what stands for part i in the fused graph: a column piece ([..., N_i]) or, for
    an interleaved part, its heads ([..., heads, head_dim]); `adapters[i]` the part's own adapter
    on it (reached through a flat reshape for heads), if any; `glue` the nodes that cut the
    fused output (erased once unused)."""

    fused: Projection
    order: ColumnOrder
    modules: list[str]
    glue_scope: str
    pieces: list[Value]
    adapters: list[Adapter | None]
    glue: list[Node]
    params: list[dict[str, Param | None]] = field(default_factory=list)

    def check(self, graph: Graph) -> ColumnSplit:
        f, o = self.fused, self.order
        what = f"unfusing {f.module}"
        if f.fake_quant is not None:
            _channel_fake_quant(f, what)
        if f.adapter is not None and any(a is not None for a in self.adapters):
            raise Refusal(f"{what}: it has a fused adapter and per-part adapters at once")
        ranges = o.ranges()
        for i, module in enumerate(self.modules):
            n = names(module, f.kind)
            ps: dict[str, Param | None] = {"weight": cut_param(n["weight"], f.weight, 1, ranges[i])}
            if f.scale is not None:
                ps["scale"] = cut_param(n["scale"], f.scale, -1, ranges[i])
            ps["bias"] = cut_param(n["bias"], f.bias, 0, ranges[i]) if f.bias is not None else None
            if f.adapter is not None:
                ps["lora_B"] = cut_param(n["lora_B"], f.adapter.b, -1, ranges[i])
            self.params.append(ps)
        _check_new_names(graph, [p for ps in self.params for p in ps.values()], [f])
        return self

    def apply(self, graph: Graph, edit: Edit, scopes: Sequence[str]) -> list[Value]:
        """Build the parts at the fused layer; returns each part's output."""
        f, o = self.fused, self.order
        b = edit.builder(f.node)
        outs = []
        for i, ps in enumerate(self.params):
            for key, p in ps.items():
                if p is not None:
                    edit.param(p, _like(f, key))
            y = _layer(b, f, f.x, ps["weight"], ps.get("scale"), ps["bias"], scopes[i])  # type: ignore[arg-type]
            own = self.adapters[i]
            if f.adapter is not None:
                bb = ps["lora_B"]
                assert bb is not None
                y = _lora(b, y, f.x, f.adapter.a, bb, f.adapter, scopes[i])
            elif own is not None:
                y = _lora(b, y, f.x, own.a, own.b, own)
            outs.append(y)
            # each part whole before the next (ERNIE-3.5-SE's own unfused layers read so)
            if own is not None:
                graph.replace_all_uses_with(own.node.outputs[0], y)
                flat = [own.node.inputs[0].producer] if i < o.interleave else []
                edit.drop([own.node, *flat], [])  # type: ignore[list-item]
            elif i < o.interleave:
                with b.at_scope(self.glue_scope):
                    h = b.reshape(y, shape=_heads_shape(y.type.rank, o.widths[i] // o.head_dim, o.head_dim))
                graph.replace_all_uses_with(self.pieces[i], h)
            else:
                graph.replace_all_uses_with(self.pieces[i], y)
        edit.drop([*self.glue, *f.nodes], f.params)
        return outs


# -- rows ------------------------------------------------------------------------------------------


@dataclass
class RowFusion:
    """Replace sum_i parts[i](x_i) by one projection over concat(x_i) (parts' rows in order)."""

    parts: list[Projection]
    module: str
    glue_scope: str
    params: dict[str, Param | None] = field(default_factory=dict)
    merged: Adapter | None = None

    def check(self, graph: Graph) -> RowFusion:
        parts = self.parts
        what = f"fusing {', '.join(p.module for p in parts)} by rows"
        _same_quantization(parts, what)
        p0 = parts[0]
        if p0.kind == "qat":
            raise Refusal(f"{what}: fake-quant weight scales run over all input rows, so joining rows "
                          "changes them: fuse before qat-insert")
        if len({p.out_features for p in parts}) > 1:
            raise Refusal(f"{what}: the parts have different output widths")
        order = ColumnOrder(tuple(p.in_features for p in parts))
        n = names(self.module, p0.kind)
        self.params["weight"] = joined_param(n["weight"], [p.weight for p in parts], 0, order, what)
        if p0.kind == "weight_only":
            if p0.group_size == -1:
                if any(p.scale is not p0.scale for p in parts):
                    raise Refusal(f"{what}: each part has its own per-output-channel scales (quantized "
                                  "apart); a fused row layer has one scale per output column over all its "
                                  "rows: fuse before quantizing")
                self.params["scale"] = p0.scale
            else:
                g = p0.group_size
                if any(p.in_features % g for p in parts):
                    raise Refusal(f"{what}: a part's rows are not whole quantization groups of {g}")
                groups = ColumnOrder(tuple(p.in_features // g for p in parts))
                self.params["scale"] = joined_param(n["scale"], [p.scale for p in parts], 0, groups, what)
        biases = [p.bias for p in parts if p.bias is not None]
        self.params["bias"] = biases[0] if len(biases) == 1 else None
        if len(biases) > 1:
            if any(b.type.dtype != DType.F32 for b in biases) or len(biases) > 2:
                raise Refusal(f"{what}: {len(biases)} parts have {biases[0].type.dtype} biases; their sum "
                              "is exact only in f32 (keep one bias, or fold them in f32 first)")
            if any(shard_of(b) is not None for b in biases):
                raise Refusal(f"{what}: biases of a split graph are added after the all_reduce")
            src = (SumSource(biases[0].source, biases[1].source, DType.F32)
                   if biases[0].source is not None and biases[1].source is not None else None)
            self.params["bias"] = Param(n["bias"], biases[0].type, src,
                                        trainable=_trainable(biases, what),
                                        annotations=_annotations(biases, what))
        self.merged = _merged_adapter([p.adapter for p in parts], "b")
        if self.merged is not None:
            a_order = ColumnOrder(tuple(p.in_features for p in parts))
            self.params["lora_A"] = joined_param(n["lora_A"], [p.adapter.a for p in parts],  # type: ignore[union-attr]
                                                 0, a_order, f"{what} (LoRA A)")
        kept = {id(p) for p in (p0.scale, *biases)}
        _check_new_names(graph, [p for p in self.params.values() if p is not None and id(p) not in kept],
                         parts)
        return self

    def apply(self, graph: Graph, edit: Edit, anchor: Node) -> Value:
        """Build concat + the fused layer (+ adapters) before `anchor`; returns the fused sum.
        The caller replaces the sum with it, then the parts' nodes are dropped."""
        parts = self.parts
        p0 = parts[0]
        b = edit.builder(anchor)
        kept = {id(p0.scale), *(id(p.bias) for p in parts if p.bias is not None)}
        for key, p in self.params.items():
            if p is not None and id(p) not in kept:
                edit.param(p, _like(p0, key))
        with b.at_scope(self.glue_scope):
            c = b.concat(*(p.x for p in parts), axis=-1)
        w = self.params["weight"]
        assert w is not None
        scope = _scope(parts, self.module)
        y = _layer(b, p0, c, w, self.params.get("scale"), self.params["bias"], scope)
        if self.merged is not None:
            a = self.params["lora_A"]
            assert a is not None
            y = _lora(b, y, c, a, self.merged.b, self.merged, scope)
        else:
            for p in parts:
                if p.adapter is not None:
                    y = _lora(b, y, p.x, p.adapter.a, p.adapter.b, p.adapter)
        for p in parts:
            edit.drop(p.nodes, p.params)
        return y


@dataclass
class RowSplit:
    """Cut the fused row projection over concat(x_i) into one projection per x_i, summed."""

    fused: Projection
    concat: Node
    modules: list[str]
    bias_part: int
    """The part that keeps the fused bias (added once)."""
    adapters: list[Adapter]
    """Per-part adapters chained after the fused layer (lora(y, x_i, A_i, B_i)), if any."""
    params: list[dict[str, Param | None]] = field(default_factory=list)

    @property
    def xs(self) -> list[Value]:
        return [v for v in self.concat.inputs if v is not None]

    def check(self, graph: Graph) -> RowSplit:
        f = self.fused
        what = f"unfusing {f.module} by rows"
        if f.kind == "qat":
            raise Refusal(f"{what}: fake-quant weight scales run over all input rows; cutting the rows "
                          "changes them")
        widths = []
        for x in self.xs:
            w = x.type.shape[-1]
            if not isinstance(w, int):
                raise Refusal(f"{what}: an input has a symbolic width")
            widths.append(w)
        order = ColumnOrder(tuple(widths))
        ranges = order.ranges()
        if f.kind == "weight_only" and f.group_size != -1 and any(w % f.group_size for w in widths):
            raise Refusal(f"{what}: a part's rows are not whole quantization groups of {f.group_size}")
        for i, module in enumerate(self.modules):
            n = names(module, f.kind)
            ps: dict[str, Param | None] = {"weight": cut_param(n["weight"], f.weight, 0, ranges[i])}
            if f.scale is not None:
                g = f.group_size
                ps["scale"] = f.scale if g == -1 else cut_param(
                    n["scale"], f.scale, 0, [(a // g, b // g) for a, b in ranges[i]])
            ps["bias"] = f.bias if i == self.bias_part else None
            if f.adapter is not None:
                ps["lora_A"] = cut_param(n["lora_A"], f.adapter.a, 0, ranges[i])
            self.params.append(ps)
        kept = {id(f.scale), id(f.bias)}
        _check_new_names(graph, [p for ps in self.params for p in ps.values() if id(p) not in kept], [f])
        return self

    def apply(self, graph: Graph, edit: Edit, scopes: Sequence[str], sum_scope: str) -> Value:
        f = self.fused
        b = edit.builder(self.concat)
        kept = {id(f.scale), id(f.bias)}
        outs = []
        for i, (x, ps) in enumerate(zip(self.xs, self.params, strict=True)):
            for key, p in ps.items():
                if p is not None and id(p) not in kept:
                    edit.param(p, _like(f, key))
            y = _layer(b, f, x, ps["weight"], ps.get("scale"), ps["bias"], scopes[i])  # type: ignore[arg-type]
            if f.adapter is not None:
                a = ps["lora_A"]
                assert a is not None
                y = _lora(b, y, x, a, f.adapter.b, f.adapter, scopes[i])
            for ad in self.adapters:
                if ad.node.inputs[1] is x:
                    y = _lora(b, y, x, ad.a, ad.b, ad)
            outs.append(y)
        with b.at_scope(sum_scope):
            total = outs[0]
            for y in outs[1:]:
                total = b.add(total, y)
        last = self.adapters[-1].node.outputs[0] if self.adapters else f.out
        graph.replace_all_uses_with(last, total)
        edit.drop([self.concat, *f.nodes, *(a.node for a in self.adapters)], f.params)
        return total


def _check_new_names(graph: Graph, new: Any, parts: Sequence[Projection]) -> None:
    """A new param may take the name of a param it replaces, never of another one."""
    replaced = {p.name for part in parts for p in part.params}
    seen: set[str] = set()
    for p in new:
        if p is None:
            continue
        if p.name in seen or (p.name in graph.params and p.name not in replaced):
            raise Refusal(f"a param named @{p.name} already exists")
        seen.add(p.name)
