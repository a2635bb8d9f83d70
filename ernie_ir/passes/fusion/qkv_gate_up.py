"""fuse-qkv / unfuse-qkv, fuse-gate-up / unfuse-gate-up: projections that read one value.

    q = x Wq + bq, k = x Wk + bk, v = x Wv + bv      <->   [q | k | v] = x [Wq | Wk | Wv] + [bq | bk | bv]
    silu(x Wg) * (x Wu)                              <->   g, u = split(x [Wg | Wu]); silu(g) * u

Found from the dataflow, not from names, so graphs built any way qualify:
q, k, v are the projections whose outputs, reshaped into heads (through
rope or a cast), are an attention's q, k and v; gate and up are the
projections in `act(gate(x)) * up(x)` (act silu or gelu). Column orders are
the published ones: `[Q | K | V]` (ERNIE 4.5 `qkv_proj`) and `[gate | up]`
(`up_gate_proj`); `fuse-qkv{order=per_head}` writes GPT's and
ERNIE-3.5-SE's per-head interleave `[q_h k_h v_h]` instead (it needs as many
kv heads as heads). `unfuse-*` reads every one of those forms. Fused names
follow the checkpoints: `<attention>.qkv_proj`, `<mlp>.up_gate_proj`;
unfused ones `q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`.

Quantized and LoRA layers fuse as `column_row_fusion` describes; a match
that cannot be fused exactly is refused, and `ernie-ir explain fuse-qkv
MODEL` says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ernie_ir.ir import Graph, Node, Param, Value

from ..infra.base import PassContext, PassOptions
from ..infra.dataflow_rule import DataflowRule, Plan, Refusal, Steps, UnfusePass
from ..infra.registry import register_pass
from ..infra.rewrite import RewritePass, RuleSet
from .column_row_fusion import ColumnFusion, ColumnOrder, ColumnSplit, Edit
from .projection import LINEAR_LIKE, Adapter, Projection, projection_of

PASS_THROUGH = ("rope", "cast")
"""Ops between a projection's heads and attention (elementwise per head)."""
ACTIVATIONS = ("silu", "gelu")


# -- names -------------------------------------------------------------------------------------------


def parent(module: str) -> str:
    return module.rpartition(".")[0]


def sibling(module: str, name: str) -> str:
    """`a.b.q_proj`, `qkv_proj` -> `a.b.qkv_proj`."""
    head = parent(module)
    return f"{head}.{name}" if head else name


def part_names(module: str, fused: Sequence[str], parts: Sequence[str]) -> list[str]:
    """Names of the parts of a fused module: `x.qkv_proj` -> `x.q_proj`, ... (else `module.q`)."""
    head, _, last = module.rpartition(".")
    for token in fused:
        if token in last:
            return [f"{head}.{last.replace(token, p)}" if head else last.replace(token, p) for p in parts]
    return [f"{module}.{p}" for p in parts]


def linear_scopes(fused: Projection, modules: Sequence[str]) -> list[str]:
    """Scopes of the parts' linears: their modules where the fused one follows that convention."""
    return list(modules) if fused.node.scope == fused.module else [fused.node.scope] * len(modules)


# -- what feeds an attention or a gated FFN ----------------------------------------------------------


def back_through(v: Value) -> tuple[Value, list[Node]]:
    """`v` followed back through rope/cast nodes: (the value before them, those nodes)."""
    chain: list[Node] = []
    while v.producer is not None and v.producer.op in PASS_THROUGH:
        chain.append(v.producer)
        nxt = v.producer.inputs[0]
        assert nxt is not None
        v = nxt
    return v, chain


def _where(node: Node | None) -> str:
    if node is None:
        return "a graph input or param"
    return f"{node.op} at {node.scope or '<root>'}"


def head_projection(v4: Value, what: str) -> tuple[Node, Projection, list[Node]]:
    """An attention input as a separate projection reshaped into heads: (reshape, projection, chain)."""
    v, chain = back_through(v4)
    r = v.producer
    if r is not None and r.op == "split":
        raise Refusal(f"{what} is a piece of a per-head split: q, k and v are one fused projection already")
    if r is None or r.op != "reshape":
        raise Refusal(f"{what} comes from {_where(r)}, not from a reshape into heads")
    y = r.inputs[0]
    assert y is not None
    if y.producer is not None and y.producer.op == "split":
        raise Refusal(f"{what} is a column piece of a split: q, k and v are one fused projection already")
    if tuple(v.type.shape[:-2]) != tuple(y.type.shape[:-1]):
        raise Refusal(f"{what}: the reshape into heads also moves leading dims")
    return r, projection_of(y, what), chain


@dataclass
class Piece:
    """Where a part sits in a fused graph: an output of the split that cut the fused layer."""

    value: Value
    split: Node
    adapter: Adapter | None = None
    """The part's own LoRA adapter on its piece."""
    flat: Node | None = None
    """Heads with an own adapter: the reshape from heads back to columns that the adapter reads."""
    heads: Node | None = None
    """Plain q/k/v: the reshape of the piece into heads."""


def _own_adapter(lora: Node, what: str) -> Adapter:
    a, b = lora.inputs[2], lora.inputs[3]
    base = lora.inputs[0]
    if not isinstance(a, Param) or not isinstance(b, Param):
        raise Refusal(f"{what}: its LoRA weights are computed, not params")
    if base is None or base.num_uses() != 1:
        raise Refusal(f"{what}: the value under its LoRA adapter has other readers")
    return Adapter(lora, a, b)


def column_piece(v: Value, what: str) -> Piece:
    """A value read as a part (an FFN operand, or a column piece before a reshape into heads)."""
    node = v.producer
    adapter = None
    if node is not None and node.op == "lora":
        adapter = _own_adapter(node, what)
        v = node.inputs[0]  # type: ignore[assignment]
        node = v.producer
    if node is not None and node.op in LINEAR_LIKE:
        raise Refusal(f"{what} comes from its own projection, not from a fused one")
    if node is None or node.op != "split":
        raise Refusal(f"{what} comes from {_where(node)}, not from a split of a fused projection")
    return Piece(v, node, adapter)


def heads_piece(v4: Value, what: str) -> Piece:
    """An attention input in a fused graph: a per-head piece, or a reshaped column piece."""
    v, _ = back_through(v4)
    node = v.producer
    if node is not None and node.op == "split":
        return Piece(v, node)
    if node is None or node.op != "reshape":
        raise Refusal(f"{what} comes from {_where(node)}, not from a fused projection")
    inner = node.inputs[0]
    assert inner is not None
    lora = inner.producer
    if lora is not None and lora.op == "lora":
        base = lora.inputs[0]
        assert base is not None
        flat = base.producer
        if flat is not None and flat.op == "reshape" and flat.inputs[0] is not None and \
                flat.inputs[0].producer is not None and flat.inputs[0].producer.op == "split":
            return Piece(flat.inputs[0], flat.inputs[0].producer, _own_adapter(lora, what), flat=flat)
    piece = column_piece(inner, what)
    piece.heads = node
    return piece


def fused_input(pieces: Sequence[Piece], what: str) -> tuple[Node, list[Value]]:
    """The split all pieces come from (one piece per output, in order)."""
    split = pieces[0].split
    if any(p.split is not split for p in pieces):
        raise Refusal(f"{what}: the parts come from different splits")
    if [p.value for p in pieces] != list(split.outputs):
        raise Refusal(f"{what}: the split has {len(split.outputs)} pieces, read in another order or "
                      "by other nodes")
    if split.attrs.axis not in (-1, split.inputs[0].type.rank - 1):  # type: ignore[union-attr]
        raise Refusal(f"{what}: the split is not along the last axis")
    return split, list(split.outputs)


def fused_projection(y: Value, what: str, readers: int = 1) -> Projection:
    """The fused projection whose output `y` the glue reads (and nothing else)."""
    if y.num_uses() != readers:
        raise Refusal(f"{what}: the fused output has other readers")
    return projection_of(y, what)


def check_adapters_read(pieces: Sequence[Piece], x: Value, what: str) -> None:
    for p in pieces:
        if p.adapter is not None and p.adapter.node.inputs[1] is not x:
            raise Refusal(f"{what}: a part's LoRA adapter reads another input than the fused layer")


# -- rules -----------------------------------------------------------------------------------------


class _FuseRule(DataflowRule):
    """A rule whose plan is a `ColumnFusion` (plan.data["fusion"]) applied in one edit."""

    def apply_plan(self, graph: Graph, plan: Plan) -> list[Node]:
        edit = Edit(graph)
        plan.data["fusion"].apply(graph, edit)
        edit.finish()
        return []


class _UnfuseRule(DataflowRule):
    """A rule whose plan is a `ColumnSplit` (plan.data["unfuse"]) applied in one edit."""

    def apply_plan(self, graph: Graph, plan: Plan) -> list[Node]:
        edit = Edit(graph)
        plan.data["unfuse"].apply(graph, edit, plan.data["scopes"])
        edit.finish()
        return []


class FuseQkv(_FuseRule):
    """q, k, v projections of one attention -> one projection over [Q | K | V] (or per head)."""

    name = "fuse-qkv"
    root = "attention"
    steps = 8

    def __init__(self, order: Literal["plain", "per_head"] = "plain") -> None:
        self.order = order

    def plan(self, node: Node, steps: Steps) -> Plan:
        qkv = node.inputs[:3]
        steps.passed()
        heads = []
        for v, what in zip(qkv, ("q", "k", "v"), strict=True):
            assert v is not None
            heads.append(head_projection(v, what))
            steps.passed()
        parts = [p for _, p, _ in heads]
        steps.passed(3)
        hd = qkv[0].type.shape[-1]  # type: ignore[union-attr]
        if self.order == "per_head":
            if len({v.type.shape[-2] for v in qkv}) != 1:  # type: ignore[union-attr]
                raise Refusal(f"the per-head order needs as many kv heads as heads (q has "
                              f"{qkv[0].type.shape[-2]}, k {qkv[1].type.shape[-2]})")  # type: ignore[union-attr]
            order = ColumnOrder(tuple(p.out_features for p in parts), 3, int(hd))
        else:
            order = ColumnOrder(tuple(p.out_features for p in parts))
        glue = heads[0][0].scope
        fusion = ColumnFusion(parts, order, sibling(parts[0].module, "qkv_proj"), glue).check(node.graph)  # type: ignore[arg-type]
        steps.passed()
        return Plan([n for p in parts for n in p.nodes] + [r for r, _, _ in heads], {"fusion": fusion})


class UnfuseQkv(_UnfuseRule):
    """One projection over [Q | K | V] (or per head) -> separate q, k, v projections."""

    name = "unfuse-qkv"
    root = "attention"
    steps = 6

    def plan(self, node: Node, steps: Steps) -> Plan:
        qkv = node.inputs[:3]
        steps.passed()
        pieces = [heads_piece(v, what) for v, what in zip(qkv, ("q", "k", "v"), strict=True)]  # type: ignore[arg-type]
        steps.passed()
        split, _ = fused_input(pieces, "q, k, v")
        steps.passed()
        per_head = pieces[0].heads is None  # a per-head split piece (maybe under its own adapter)
        y = split.inputs[0]
        assert y is not None
        glue = [split]
        if per_head:
            reshape = y.producer
            if reshape is None or reshape.op != "reshape":
                raise Refusal(f"the per-head split reads {_where(reshape)}, not a reshape of a projection")
            if reshape.outputs[0].num_uses() != 1:
                raise Refusal("the per-head reshape has other readers")
            y = reshape.inputs[0]  # type: ignore[assignment]
            assert y is not None
            if y.producer is not None and y.producer.op == "split":
                raise Refusal("the fused projection also holds other columns (an ERNIE-3.5-SE parallel "
                              "block): use unfuse-parallel-block")
            glue.append(reshape)
            hd = int(qkv[0].type.shape[-1])  # type: ignore[union-attr]
            n = int(qkv[0].type.shape[-2]) * hd  # type: ignore[union-attr]
            order = ColumnOrder((n, n, n), 3, hd)
        else:
            order = ColumnOrder(tuple(int(p.value.type.shape[-1]) for p in pieces))
        fused = fused_projection(y, "the fused qkv projection")
        steps.passed()
        check_adapters_read(pieces, fused.x, "q, k, v")
        modules = part_names(fused.module, ("qkv",), ("q", "k", "v"))
        glue_scope = glue[-1].scope
        unfuse = ColumnSplit(fused, order, modules, glue_scope, [p.value for p in pieces],
                             [p.adapter for p in pieces], glue).check(node.graph)  # type: ignore[arg-type]
        steps.passed()
        return Plan([*fused.nodes, *glue], {"unfuse": unfuse, "scopes": linear_scopes(fused, modules)})


def gated_operands(mul: Node) -> list[tuple[Node, Value, Value]]:
    """(act, gate operand, up operand) readings of `mul` as act(gate) * up, in both orders."""
    out = []
    a, b = mul.inputs[0], mul.inputs[1]
    for act_in, up in ((a, b), (b, a)):
        if act_in is not None and up is not None and act_in.producer is not None \
                and act_in.producer.op in ACTIVATIONS:
            gate = act_in.producer.inputs[0]
            assert gate is not None
            out.append((act_in.producer, gate, up))
    return out


class FuseGateUp(_FuseRule):
    """act(gate(x)) * up(x) -> act(g) * u with g, u = split(x @ [Wg | Wu])."""

    name = "fuse-gate-up"
    root = "mul"
    steps = 4

    def plan(self, node: Node, steps: Steps) -> Plan:
        readings = gated_operands(node)
        steps.need(bool(readings), f"neither input of the mul is {' or '.join(ACTIVATIONS)}(...)")
        last: Refusal | None = None
        for act, gate_v, up_v in readings:
            try:
                gate = projection_of(gate_v, "the gate operand")
                steps.passed()
                up = projection_of(up_v, "the up operand")
                steps.passed()
            except Refusal as r:
                last = r
                continue
            module = sibling(gate.module, "up_gate_proj")
            order = ColumnOrder((gate.out_features, up.out_features))
            fusion = ColumnFusion([gate, up], order, module, act.scope).check(node.graph)  # type: ignore[arg-type]
            steps.passed()
            return Plan([*gate.nodes, *up.nodes], {"fusion": fusion})
        assert last is not None
        raise last


class UnfuseGateUp(_UnfuseRule):
    """act(g) * u with g, u = split(x @ [Wg | Wu]) -> act(gate(x)) * up(x)."""

    name = "unfuse-gate-up"
    root = "mul"
    steps = 4

    def plan(self, node: Node, steps: Steps) -> Plan:
        readings = gated_operands(node)
        steps.need(bool(readings), f"neither input of the mul is {' or '.join(ACTIVATIONS)}(...)")
        last: Refusal | None = None
        for act, gate_v, up_v in readings:
            try:
                pieces = [column_piece(gate_v, "the gate operand"), column_piece(up_v, "the up operand")]
                steps.passed()
                if len(pieces[0].split.outputs) == 3 and pieces[0].split.outputs[0].num_uses():
                    raise Refusal("the fused projection also holds q, k and v (an ERNIE-3.5-SE parallel "
                                  "block): use unfuse-parallel-block")
                split, _ = fused_input(pieces, "gate, up")
                steps.passed()
            except Refusal as r:
                last = r
                continue
            fused = fused_projection(split.inputs[0], "the fused gate/up projection")  # type: ignore[arg-type]
            check_adapters_read(pieces, fused.x, "gate, up")
            modules = part_names(fused.module, ("up_gate", "gate_up"), ("gate", "up"))
            order = ColumnOrder(tuple(int(p.value.type.shape[-1]) for p in pieces))
            unfuse = ColumnSplit(fused, order, modules, split.scope, [p.value for p in pieces],
                                 [p.adapter for p in pieces], [split]).check(node.graph)  # type: ignore[arg-type]
            steps.passed()
            return Plan([*fused.nodes, split, act], {"unfuse": unfuse,
                                                     "scopes": linear_scopes(fused, modules)})
        assert last is not None
        raise last


# -- passes ------------------------------------------------------------------------------------------


class FuseQkvOptions(PassOptions):
    order: Literal["plain", "per_head"] = "plain"
    """plain: [Q | K | V] (ERNIE 4.5 qkv_proj); per_head: [q_h k_h v_h] per head (GPT, ERNIE-3.5-SE)."""


@register_pass
class FuseQkvPass(RewritePass):
    """Fuse the q, k, v projections of every attention into one."""

    name = "fuse-qkv"
    description = "q, k, v projections reading one value -> one projection over [Q|K|V] (order=per_head)."
    Options = FuseQkvOptions
    rules = (FuseQkv(),)

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        order = self.options.order  # type: ignore[attr-defined]
        return RuleSet([FuseQkv(order)]).apply(graph, ctx) > 0


@register_pass
class UnfuseQkvPass(UnfusePass):
    """Cut every fused qkv projection ([Q|K|V] or per head) into q, k, v projections."""

    name = "unfuse-qkv"
    description = "A fused [Q|K|V] (or per-head) projection -> separate q, k, v projections."
    rules = (UnfuseQkv(),)


@register_pass
class FuseGateUpPass(RewritePass):
    """Fuse the gate and up projections of every gated FFN (shared experts too) into one."""

    name = "fuse-gate-up"
    description = "act(gate(x)) * up(x) -> one projection over [gate|up] (dense MLP, shared experts)."
    rules = (FuseGateUp(),)


@register_pass
class UnfuseGateUpPass(UnfusePass):
    """Cut every fused [gate|up] projection into gate and up projections."""

    name = "unfuse-gate-up"
    description = "A fused [gate|up] projection -> separate gate and up projections."
    rules = (UnfuseGateUp(),)
