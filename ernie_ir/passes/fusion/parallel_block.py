"""fuse-parallel-block / unfuse-parallel-block: ERNIE-3.5-SE's fused attention + FFN projections.

A parallel block is one value x (a normalisation's output) read by an
attention's q, k, v projections and by a gated FFN's gate and up
projections, whose output projections (attention's o_proj, the FFN's down)
are summed into one residual:

    h + o(attn(q(x), k(x), v(x))) + down(act(gate(x)) * up(x))
      = h + concat([ffn, attn]) @ W_o + b_o,      [ffn, attn] from  x @ W_in + b_in

fused into ERNIE-3.5-SE's two linears (REFERENCE.md section 3):
`qkv_gate_up_proj` [H, 3H + 2I] with columns [qkv per head ([nh, 3 hd]) | X1
(gate) | X2 (up)], and `o_proj` [I + H, H] with the FFN rows first, biases
folded (the sum's one bias is kept). The unfused form is what ERNIE-3.5-SE
writes for its attention-only and FFN-only layers: `self_attn.{q,k,v,o}_proj`
and `mlp.{gate,up,down}_proj`, summed by `add(o, down)`; the fused bias of
o_proj stays one param, on o_proj. Unfusing an imported model and fusing it
again gives the imported graph back, params included (the same lazy sources).

The block is found from the dataflow (an attention node is the root), so any
graph qualifies; `ernie-ir explain fuse-parallel-block MODEL` says which
step failed where it does not. On a split graph (tensor parallel rank graphs)
the fused params are exactly what `split` makes of the fused global params,
and the block keeps its one all_reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from ernie_ir.ir import Graph, Node, Param, Value

from ..infra.dataflow_rule import DataflowRule, Plan, Refusal, Steps, UnfusePass
from ..infra.registry import register_pass
from ..infra.rewrite import RewritePass
from .column_row_fusion import ColumnFusion, ColumnOrder, ColumnSplit, Edit, RowFusion, RowSplit
from .projection import LINEAR_LIKE, Adapter, Projection, projection_at, projection_of
from .qkv_gate_up import (
    ACTIVATIONS,
    back_through,
    check_adapters_read,
    column_piece,
    fused_input,
    fused_projection,
    gated_operands,
    head_projection,
    heads_piece,
    linear_scopes,
    parent,
)

BLOCK = "self_attn_mlp"


def _common(a: str, b: str) -> str:
    out = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _merge_reshape(att: Node) -> tuple[Value, list[Node]]:
    """Attention's output merged back to [..., heads * head_dim]: (that value, the nodes on the way)."""
    v, chain = att.outputs[0], []
    while v.num_uses() == 1 and v.users[0].op == "cast":
        chain.append(v.users[0])
        v = v.users[0].outputs[0]
    want = (*v.type.shape[:-2], v.type.shape[-2] * v.type.shape[-1]) \
        if all(isinstance(d, int) for d in v.type.shape[-2:]) else None
    merges = [u for u in v.users if u.op == "reshape" and tuple(u.outputs[0].type.shape) == want]
    if len(merges) != 1 or v.num_uses() != 1:
        raise Refusal("the attention output is not merged back into [..., heads * head_dim] by one reshape")
    chain.append(merges[0])
    return merges[0].outputs[0], chain


def _reader_projection(v: Value, what: str) -> Node:
    linears = [u for u in v.users if u.op in (*LINEAR_LIKE, "fp8_linear") and u.inputs[0] is v]
    if len(linears) != 1:
        raise Refusal(f"{what} is read by {len(linears)} linears, not by one output projection")
    return linears[0]


@dataclass
class _Sum:
    """How the two output projections reach the residual: add(o, d), or add(add(h, o), d)."""

    node: Node
    inner: Node | None = None
    residual: Value | None = None


def _sum(o: Projection, d: Projection) -> _Sum:
    yo, yd = o.out, d.out
    if yo.num_uses() != 1 or yd.num_uses() != 1:
        raise Refusal("the output projections' results have other readers than their sum")
    so, sd = yo.users[0], yd.users[0]
    if so is sd and so.op == "add":
        return _Sum(so)
    for inner, outer, y in ((so, sd, yo), (sd, so, yd)):
        if inner.op == "add" and outer.op == "add" and inner.outputs[0].num_uses() == 1 \
                and inner.outputs[0].users[0] is outer:
            h = inner.inputs[1] if inner.inputs[0] is y else inner.inputs[0]
            return _Sum(outer, inner, h)
    raise Refusal("o_proj's and down_proj's results are not summed (add(o, down), or both added into "
                  "one residual)")


def _gated_ffn(x: Value, exclude: set[Node]) -> tuple[Projection, Projection, Node, Node]:
    """The gated FFN act(gate(x)) * up(x) on x: (gate, up, act, mul)."""
    found = []
    for u in x.users:
        if u.op not in LINEAR_LIKE or u in exclude:
            continue
        try:
            gate = projection_at(u)
        except Refusal:
            continue
        for act in gate.out.users:
            if act.op not in ACTIVATIONS:
                continue
            for mul in act.outputs[0].users:
                if mul.op != "mul":
                    continue
                for a, _, up_v in gated_operands(mul):
                    if a is not act:
                        continue
                    try:
                        up = projection_of(up_v, "the up operand")
                    except Refusal:
                        continue
                    if up.x is x and up.node is not gate.node:
                        found.append((gate, up, act, mul))
    if not found:
        raise Refusal("no gated FFN (act(gate(x)) * up(x)) reads the attention's input: not a parallel "
                      "block")
    if len(found) > 1:
        raise Refusal(f"{len(found)} gated FFNs read the attention's input")
    return found[0]


def _rescope(nodes: list[Node], old: str, new: str) -> None:
    for n in nodes:
        if n.scope == old:
            n.scope = new


class FuseParallelBlock(DataflowRule):
    """q/k/v/gate/up over one x and o/down into one sum -> ERNIE-3.5-SE's two fused linears."""

    name = "fuse-parallel-block"
    root = "attention"
    steps = 11

    def plan(self, node: Node, steps: Steps) -> Plan:
        qkv = [v for v in node.inputs[:3] if v is not None]
        steps.passed()
        heads = [head_projection(v, what) for v, what in zip(qkv, ("q", "k", "v"), strict=True)]
        steps.passed(3)
        q, k, v = (p for _, p, _ in heads)
        x = q.x
        steps.need(k.x is x and v.x is x, "q, k and v read different values")
        gate, up, act, mul = _gated_ffn(x, {n for p in (q, k, v) for n in p.nodes})
        steps.passed()
        a, att_chain = _merge_reshape(node)
        o = projection_at(_reader_projection(a, "the merged attention output"))
        steps.passed()
        d = projection_at(_reader_projection(mul.outputs[0], "the FFN product"))
        steps.passed()
        total = _sum(o, d)
        steps.passed()
        nh = {t.type.shape[-2] for t in qkv}
        steps.need(len(nh) == 1, f"ERNIE-3.5-SE's per-head [q_h k_h v_h] columns need as many kv heads as "
                                 f"heads (q has {qkv[0].type.shape[-2]}, k {qkv[1].type.shape[-2]})")
        hd = int(qkv[0].type.shape[-1])  # type: ignore[arg-type]
        attn_module, ffn_module = parent(q.module), parent(gate.module)
        block = _join(_common(parent(attn_module), parent(ffn_module)), BLOCK)
        order = ColumnOrder(tuple(p.out_features for p in (q, k, v, gate, up)), 3, hd)
        graph = node.graph
        assert graph is not None
        col = ColumnFusion([q, k, v, gate, up], order, f"{block}.qkv_gate_up_proj", block).check(graph)
        row = RowFusion([d, o], f"{block}.o_proj", block).check(graph)
        steps.passed()
        attn_nodes = [n for _, _, chain in heads for n in chain] + [node] + att_chain
        nodes = [n for p in (q, k, v, gate, up, o, d) for n in p.nodes] + [r for r, _, _ in heads]
        return Plan(nodes, {"col": col, "row": row, "sum": total, "attn": (attn_nodes, attn_module),
                            "ffn": ([act, mul], ffn_module), "block": block})

    def apply_plan(self, graph: Graph, plan: Plan) -> list[Node]:
        data = plan.data
        edit = Edit(graph)
        data["col"].apply(graph, edit)
        total: _Sum = data["sum"]
        y = data["row"].apply(graph, edit, total.node)
        if total.inner is None:
            graph.replace_all_uses_with(total.node.outputs[0], y)
            edit.drop([total.node])
        else:
            b = edit.builder(total.node)
            with b.at_scope(total.node.scope):
                new = b.add(total.residual, y)
            graph.replace_all_uses_with(total.node.outputs[0], new)
            edit.drop([total.node, total.inner])
        for key in ("attn", "ffn"):
            nodes, module = data[key]
            _rescope(nodes, module, data["block"])
        edit.finish()
        return []


def _row_adapters(y: Value, xs: list[Value]) -> list[Adapter]:
    """Per-part adapters chained after a fused row layer: lora(y, x_i, A_i, B_i), lora(..., x_j, ...)."""
    out: list[Adapter] = []
    while y.num_uses() == 1 and y.users[0].op == "lora" and y.users[0].inputs[0] is y \
            and y.users[0].inputs[1] in xs:
        node = y.users[0]
        a, b = node.inputs[2], node.inputs[3]
        if not isinstance(a, Param) or not isinstance(b, Param):
            raise Refusal("an output projection's LoRA weights are computed, not params")
        out.append(Adapter(node, a, b))
        y = node.outputs[0]
    return out


class UnfuseParallelBlock(DataflowRule):
    """ERNIE-3.5-SE's fused qkv_gate_up_proj and o_proj -> separate q/k/v/gate/up/o/down projections."""

    name = "unfuse-parallel-block"
    root = "attention"
    steps = 9

    def plan(self, node: Node, steps: Steps) -> Plan:
        qkv = [v for v in node.inputs[:3] if v is not None]
        steps.passed()
        pieces = [heads_piece(v, what) for v, what in zip(qkv, ("q", "k", "v"), strict=True)]
        if any(p.heads is not None for p in pieces):
            raise Refusal("q, k and v are column pieces ([Q | K | V]), not ERNIE-3.5-SE's per-head layout: "
                          "use unfuse-qkv")
        s4, _ = fused_input(pieces, "q, k, v")
        steps.passed()
        reshape = s4.inputs[0].producer  # type: ignore[union-attr]
        p0 = reshape.inputs[0] if reshape is not None and reshape.op == "reshape" else None
        s0 = p0.producer if p0 is not None else None
        if s0 is None or s0.op != "split" or len(s0.outputs) != 3 or s0.outputs[0] is not p0:
            raise Refusal("q, k and v are the whole fused projection, not the first part of "
                          "[qkv | gate | up]: not a parallel block (use unfuse-qkv)")
        if reshape.outputs[0].num_uses() != 1 or p0.num_uses() != 1:  # type: ignore[union-attr]
            raise Refusal("the per-head reshape of the fused qkv columns has other readers")
        steps.passed()
        x1, x2 = s0.outputs[1], s0.outputs[2]
        gate_seen = x1
        if x1.num_uses() == 1 and x1.users[0].op == "lora":
            gate_seen = x1.users[0].outputs[0]
        acts = [u for u in gate_seen.users if u.op in ACTIVATIONS]
        muls = [m for a in acts for m in a.outputs[0].users if m.op == "mul"]
        if len(acts) != 1 or len(muls) != 1:
            raise Refusal("the fused gate columns do not feed one act(gate) * up product")
        act, mul = acts[0], muls[0]
        reading = [(g, u) for a, g, u in gated_operands(mul) if a is act]
        g_piece = column_piece(reading[0][0], "the gate operand")
        u_piece = column_piece(reading[0][1], "the up operand")
        if g_piece.value is not x1 or u_piece.value is not x2:
            raise Refusal("the FFN product does not read the fused [gate | up] columns in order")
        steps.passed()
        fused_in = fused_projection(s0.inputs[0], "the fused qkv_gate_up projection")  # type: ignore[arg-type]
        check_adapters_read([*pieces, g_piece, u_piece], fused_in.x, "the parallel block")
        steps.passed()
        a, att_chain = _merge_reshape(node)
        f = mul.outputs[0]
        concats = [u for u in a.users if u.op == "concat" and set(u.inputs) == {a, f} and len(u.inputs) == 2]
        if len(concats) != 1 or concats[0].attrs.axis not in (-1, a.type.rank - 1):
            raise Refusal("the attention and FFN outputs are not joined by one concat along the last axis")
        concat = concats[0]
        steps.passed()
        out_node = _reader_projection(concat.outputs[0], "the joined [ffn, attn]")
        if concat.outputs[0].num_uses() != 1 + sum(1 for u in concat.outputs[0].users if u.op == "lora"):
            raise Refusal("the joined [ffn, attn] has other readers than the output projection")
        fused_out = projection_at(out_node, adapter=False)
        row_adapters = _row_adapters(fused_out.base, [a, f])
        if not row_adapters:
            fused_out = projection_at(out_node)
        steps.passed()
        block = parent(fused_in.module)
        layer = parent(block) if block.rpartition(".")[2] == BLOCK else block
        attn, ffn = _join(layer, "self_attn"), _join(layer, "mlp")
        hd = int(qkv[0].type.shape[-1])  # type: ignore[arg-type]
        width = int(qkv[0].type.shape[-2]) * hd  # type: ignore[arg-type]
        sizes = tuple(int(s) for s in s0.attrs.sizes)
        if sizes[0] != 3 * width:
            raise Refusal(f"the fused qkv columns ({sizes[0]}) are not 3 x {width}")
        in_modules = [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj", f"{ffn}.gate_proj",
                      f"{ffn}.up_proj"]
        order = ColumnOrder((width, width, width, sizes[1], sizes[2]), 3, hd)
        graph = node.graph
        assert graph is not None
        col = ColumnSplit(fused_in, order, in_modules, attn, [p.value for p in (*pieces, g_piece, u_piece)],
                          [p.adapter for p in (*pieces, g_piece, u_piece)], [s4, reshape, s0]).check(graph)  # type: ignore[list-item]
        out_modules = [f"{ffn}.down_proj" if v is f else f"{attn}.o_proj" for v in concat.inputs]
        attn_part = list(concat.inputs).index(a)
        row = RowSplit(fused_out, concat, out_modules, attn_part, row_adapters).check(graph)
        steps.passed()
        attn_nodes = [n for v in qkv for n in back_through(v)[1]] + [node] + att_chain
        nodes = [*fused_in.nodes, s0, reshape, s4, concat, *fused_out.nodes]  # type: ignore[list-item]
        return Plan(nodes, {"col": col, "row": row, "in_scopes": linear_scopes(fused_in, in_modules),
                            "out_scopes": linear_scopes(fused_out, out_modules), "layer": layer,
                            "attn": (attn_nodes, attn), "ffn": ([act, mul], ffn), "block": block})

    def apply_plan(self, graph: Graph, plan: Plan) -> list[Node]:
        data = plan.data
        edit = Edit(graph)
        data["col"].apply(graph, edit, data["in_scopes"])
        data["row"].apply(graph, edit, data["out_scopes"], data["layer"])
        for key in ("attn", "ffn"):
            nodes, module = data[key]
            _rescope(nodes, data["block"], module)
        edit.finish()
        return []


@register_pass
class FuseParallelBlockPass(RewritePass):
    """Fuse every parallel attention + FFN block into ERNIE-3.5-SE's qkv_gate_up_proj and o_proj."""

    name = "fuse-parallel-block"
    description = ("q/k/v/gate/up reading one norm and o/down summed into one residual -> ERNIE-3.5-SE's "
                   "fused [qkv per head|gate|up] and [ffn;attn] linears")
    rules = (FuseParallelBlock(),)


@register_pass
class UnfuseParallelBlockPass(UnfusePass):
    """Cut every ERNIE-3.5-SE parallel block into separate q/k/v/o and gate/up/down projections."""

    name = "unfuse-parallel-block"
    description = "ERNIE-3.5-SE's fused parallel block -> separate q/k/v/o_proj and gate/up/down_proj"
    rules = (UnfuseParallelBlock(),)
