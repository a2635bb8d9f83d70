"""What one rank graph holds in memory: params by kind, activations, KV cache.

Everything here is read from a compiled (possibly meta) rank graph: param types after
quantization, LoRA, the split and legalization; node output shapes with the symbolic `B`, `S`
bound to numbers. The per-op model of what a training step keeps for backward (`saved_for_backward`)
and the inference liveness walk (`inference_peak`) are written out in docs/planning.md; this module
is their single implementation.

Conventions
- A *weight view* is a value computed from params only (dequantize, unpack_weight, stack,
  fake-quant of a weight): device kernels read the stored layout, so a view is not an activation.
  Exception: a `dequantize` the kernel plan lists as a portable fallback materialises its output
  (counted in the inference peak while it is live).
- Bytes of a tensor are its storage bytes: int4 two per byte (`ceil(n / 2)`, as the artifact's
  safetensors files store it), everything else `n * bits / 8`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ernie_ir.ir import DType, ErnieIRError, Graph, Node, Param, TensorType, Value
from ernie_ir.ir.types import Dim, _factor
from ernie_ir.ir.weights import packed_int4_shape
from ernie_ir.training.vocab_parallel import logits_gather


class PlanError(ErnieIRError):
    """A plan that cannot be made (bad option, impossible combination): one line, exit 2."""


LORA_OPS = {"lora": (2, 3), "moe_experts_lora": (5, 6, 7, 8)}
"""Input positions of the adapter params of each LoRA op."""
LINEAR_OPS = ("linear", "weight_only_linear", "weight_only_linear_packed", "weight_only_linear_xpu",
              "fp8_linear", "lm_head")
NO_SAVE_OPS = frozenset({"add", "split", "concat", "reshape", "transpose", "cast", "rope", "all_reduce",
                         "all_gather", "position_ids", "moe_local_experts", "stack", "dequantize",
                         "unpack_weight", "unpack_weight_xpu", "fake_quant", "fake_quant_fp8",
                         "fake_quant_moving_average"})
"""Ops whose backward needs none of their tensors (linear maps, views, collectives, masks; QAT
fake-quant is a straight-through estimator)."""
_QUANT_STATE = (".weight_scale", ".input_scale", ".activation_scale")
_LAYER = re.compile(r"^(.*?\.layers\.\d+)(?:\.|$)")


def tensor_bytes(t: TensorType, env: Mapping[str, int] | None = None) -> int:
    """Storage bytes of a tensor of type `t` with symbolic dims bound by `env`."""
    shape = [eval_dim(d, env or {}) for d in t.shape]
    if t.dtype == DType.I4:
        return math.prod(packed_int4_shape(shape)) if shape else 1
    return math.prod(shape) * t.dtype.bits // 8


def eval_dim(d: Dim, env: Mapping[str, int]) -> int:
    if isinstance(d, int):
        return d
    coeff, symbols = _factor(d)
    missing = sorted(set(symbols) - set(env))
    if missing:
        raise PlanError(f"the graph has a symbolic dim {d!r} ({', '.join(missing)} unknown): the planner "
                        "binds B (batch) and S (sequence) only")
    return coeff * math.prod(env[s] ** n for s, n in symbols.items())


def numel(t: TensorType, env: Mapping[str, int] | None = None) -> int:
    return math.prod(eval_dim(d, env or {}) for d in t.shape)


def lora_params(graph: Graph) -> set[str]:
    """Names of the params that are LoRA adapters (by the op slot they feed, or by name)."""
    names = {p.name for p in graph.params.values() if p.name.endswith((".lora_A", ".lora_B"))}
    for node in graph:
        for i in LORA_OPS.get(node.op, ()):
            v = node.inputs[i] if i < len(node.inputs) else None
            if isinstance(v, Param):
                names.add(v.name)
    return names


def full_parameter_trainable(graph: Graph) -> set[str]:
    """The params a full-parameter fine-tune updates: every float param except quantization state
    (scales) and the MoE routing statistics. Integer (weight-only quantized) weights cannot be
    updated: PlanError naming the way out."""
    ints = [p for p in graph.params.values() if not p.type.dtype.is_float]
    if ints:
        raise PlanError(f"full-parameter training cannot update weight-only INT8/INT4 weights "
                        f"({ints[0].name} is {ints[0].type.dtype}): add --lora-rank R (LoRA over the "
                        "quantized base), or plan --quant none, fp8 or qat-int8")
    return {p.name for p in graph.params.values()
            if not p.name.endswith(_QUANT_STATE) and "moe_statics" not in p.name
            and "qat_state" not in p.annotations}


@dataclass
class GraphFacts:
    """Dataflow facts of one graph the activation models share."""

    graph: Graph
    trainable: set[str]
    views: set[int] = field(default_factory=set)
    """id() of weight views (values computed from params only), params included."""
    grads: set[int] = field(default_factory=set)
    """id() of values that need a gradient (depend on a trainable param)."""
    fallback_scopes: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        for p in self.graph.params.values():
            self.views.add(id(p))
            if p.name in self.trainable:
                self.grads.add(id(p))
        for node in self.graph:
            ins = [v for v in node.inputs if v is not None]
            if ins and all(id(v) in self.views for v in ins):
                self.views.update(id(o) for o in node.outputs)
            if any(id(v) in self.grads for v in ins):
                self.grads.update(id(o) for o in node.outputs if o.dtype.is_float)
        plan = self.graph.metadata.get("kernel_plan", {}) or {}
        self.fallback_scopes = {str(f.get("scope")) for f in plan.get("fallbacks", [])}

    def root(self, v: Value) -> Value:
        """The tensor whose memory `v` is: a reshape is a view of its input (same bytes)."""
        while v.producer is not None and v.producer.op == "reshape" and v.producer.inputs[0] is not None:
            v = v.producer.inputs[0]
        return v

    def is_act(self, v: Value | None) -> bool:
        return v is not None and id(v) not in self.views

    def needs_grad(self, v: Value | None) -> bool:
        return v is not None and id(v) in self.grads

    def backward_runs(self, node: Node) -> bool:
        return any(id(o) in self.grads for o in node.outputs)


# -- MoE internals ------------------------------------------------------------------------------------


def moe_dims(node: Node, env: Mapping[str, int], capacity_factor: float) -> tuple[int, int, int, int]:
    """(slots, H, I, r) of a moe_experts(_lora) node on this rank: slots = tokens * k * E_local /
    E_global * capacity_factor (routing assumed balanced over the experts), H the hidden size,
    I the rank's intermediate size per expert, r the adapters' rank (0 without LoRA)."""
    x, w, _, ug, dn = node.inputs[:5]
    assert x is not None and w is not None and ug is not None and dn is not None
    tokens = numel(x.type, env) // eval_dim(x.shape[-1], env)
    k = eval_dim(w.shape[-1], env)
    e_local = eval_dim(ug.shape[0], env)
    e_global = _global_experts(node) or e_local
    slots = math.ceil(tokens * k * e_local / e_global * capacity_factor)
    h = eval_dim(x.shape[-1], env)
    inter = eval_dim(dn.shape[1], env)
    a = node.inputs[5] if len(node.inputs) > 5 else None
    r = eval_dim(a.shape[-1], env) if a is not None else 0
    return slots, h, inter, r


def _global_experts(node: Node) -> int | None:
    """The router's expert count (its weight [H, E]) upstream of a moe_experts node's weights."""
    v = node.inputs[1]
    for _ in range(4):  # moe_gate -> (moe_local_experts) -> moe_experts
        p = v.producer if v is not None else None
        if p is None:
            return None
        if p.op == "moe_gate":
            wt = p.inputs[1]
            return wt.shape[-1] if wt is not None and isinstance(wt.shape[-1], int) else None
        v = p.inputs[0]
    return None


# -- training: what backward keeps ---------------------------------------------------------------------


@dataclass
class Saved:
    """Tensors a node keeps for backward: activations (deduplicated by value) and internals."""

    values: list[Value] = field(default_factory=list)
    internal: list[tuple[str, int]] = field(default_factory=list)
    """(what, bytes) of tensors that are not graph values (MoE slots, attention logsumexp)."""


def saved_for_backward(node: Node, facts: GraphFacts, env: Mapping[str, int],
                       capacity_factor: float = 1.0) -> Saved:
    """What `node` keeps for backward (nothing when no output needs a gradient). The per-op rules
    are the table in docs/planning.md section 3."""
    s = Saved()
    if not facts.backward_runs(node):
        return s
    ins = node.inputs
    act = facts.is_act
    need = facts.needs_grad

    def keep(v: Value | None) -> None:
        if act(v) and v is not None:
            s.values.append(facts.root(v))

    op = node.op
    if op in NO_SAVE_OPS:
        return s
    if op in LINEAR_OPS:
        if need(ins[1]):  # dW = x^T g needs x; dx = g W^T needs only the weight
            keep(ins[0])
    elif op == "lora":
        x, a, b = ins[1:4]
        if need(a):
            keep(x)
        if need(b) and x is not None and a is not None:  # dB = (x A)^T g
            s.internal.append((f"{node.scope} x@A", _rows(x, env) * eval_dim(a.shape[-1], env)
                               * x.dtype.bits // 8))
    elif op in ("embedding", "vocab_parallel_embedding"):
        if need(ins[1]):
            keep(ins[0])
    elif op in ("rms_norm", "layer_norm"):
        keep(ins[0])
        x = ins[0]
        if x is not None:  # 1/rms (and the mean) per row, float32
            stats = 2 if op == "layer_norm" else 1
            s.internal.append((f"{node.scope} norm stats", _rows(x, env) * 4 * stats))
    elif op == "attention":
        # memory-efficient (flash) attention: q, k, v, the output and a float32 logsumexp [B, H, S]
        for v in (*ins[:3], node.outputs[0]):
            keep(v)
        if len(ins) > 3:
            keep(ins[3])
        q = ins[0]
        if q is not None:
            s.internal.append((f"{node.scope} logsumexp", _rows(q, env) * 4))
    elif op in ("silu", "gelu", "pact"):
        keep(ins[0])
    elif op == "softmax":
        keep(node.outputs[0])
    elif op == "mul":
        if need(ins[0]):
            keep(ins[1])
        if need(ins[1]):
            keep(ins[0])
    elif op == "moe_gate":
        x, w = ins[0], ins[1]
        if need(w):
            keep(x)
        if x is not None and w is not None:  # softmax backward reads the float32 probabilities
            s.internal.append((f"{node.scope} router probs", _rows(x, env) * eval_dim(w.shape[-1], env) * 4))
    elif op in ("moe_experts", "moe_experts_lora"):
        _moe_saved(node, facts, env, capacity_factor, s)
    else:  # an op without a rule (a plugin): keep every activation input, the safe side
        for v in ins:
            keep(v)
    return s


def _rows(v: Value, env: Mapping[str, int]) -> int:
    return numel(v.type, env) // max(eval_dim(v.shape[-1], env), 1)


def _moe_saved(node: Node, facts: GraphFacts, env: Mapping[str, int], capacity_factor: float,
               s: Saved) -> None:
    x, w = node.inputs[0], node.inputs[1]
    assert x is not None
    slots, h, inter, r = moe_dims(node, env, capacity_factor)
    item = x.dtype.bits // 8
    adapters = list(node.inputs[5:9]) + [None] * (9 - len(node.inputs))
    ug_a, ug_b, dn_a, dn_b = adapters[:4]
    need = facts.needs_grad
    if facts.is_act(w) and w is not None:
        s.values.append(facts.root(w))  # routing weights scale every slot's gradient
    if need(node.inputs[3]) or need(ug_a):
        s.internal.append((f"{node.scope} dispatched x", slots * h * item))
    s.internal.append((f"{node.scope} up_gate out", slots * 2 * inter * item))  # swiglu backward
    if need(node.inputs[4]) or need(dn_a):
        s.internal.append((f"{node.scope} swiglu out", slots * inter * item))
    if need(w):
        s.internal.append((f"{node.scope} expert outputs", slots * h * item))  # d(routing weight)
    if need(ug_b):
        s.internal.append((f"{node.scope} x@A (up_gate)", slots * r * item))
    if need(dn_b):
        s.internal.append((f"{node.scope} x@A (down)", slots * r * item))


def backward_transient(node: Node, facts: GraphFacts, env: Mapping[str, int],
                       capacity_factor: float = 1.0, loss_inputs: set[int] | None = None,
                       region: set[int] | None = None, sp: int = 1) -> int:
    """Bytes alive only while `node`'s backward runs: the gradients of its outputs and of its
    activation inputs, plus (MoE) the gradients of the dispatched tokens and the up_gate output.
    The gradient of what the loss reads (`loss_inputs`, value ids; None: the graph's outputs) is
    the loss's, formed in the softmax buffer the loss keeps. With sequence parallelism (`sp` > 1,
    `region` the `sequence_parallel_values`) those gradients are sequence shards (/ sp), except at
    a linear or LoRA op, whose input gradient is whole before its reduce-scatter."""
    if not facts.backward_runs(node):
        return 0
    outputs = loss_inputs if loss_inputs is not None else (
        {id(v) for v in node.graph.outputs} if node.graph is not None else set())
    cut = sp if sp > 1 and region and node.op not in (*LINEAR_OPS, "lora") else 1

    def size(v: Value) -> int:
        b = tensor_bytes(v.type, env)
        return -(-b // cut) if cut > 1 and id(v) in (region or ()) else b

    total = sum(size(o) for o in node.outputs if facts.needs_grad(o) and id(o) not in outputs)
    total += sum(size(v) for v in dict.fromkeys(node.inputs)
                 if facts.is_act(v) and facts.needs_grad(v) and v is not None)
    if node.op in ("moe_experts", "moe_experts_lora"):
        x = node.inputs[0]
        assert x is not None
        slots, h, inter, _ = moe_dims(node, env, capacity_factor)
        total += slots * (h + 2 * inter) * x.dtype.bits // 8
    return total


def layer_of(node: Node) -> str | None:
    """The decoder layer a node belongs to (`ernie.layers.3`), from its scope; None outside layers."""
    m = _LAYER.match(node.scope or "")
    return m.group(1) if m else None


SP_READERS = frozenset({"rms_norm", "layer_norm", "moe_gate"})
"""Ops whose f32 per-row internals (norm stats, router probabilities) are sequence shards under SP."""


def sequence_parallel_values(graph: Graph, facts: GraphFacts) -> set[int]:
    """id() of the activations sequence parallelism keeps on token shards: the residual stream
    outside the tensor-parallel blocks. Seeded by the outputs of the embedding and of `all_reduce`
    (the reduction after every row-parallel linear, MoE block and the vocabulary-parallel
    embedding: under SP a reduce-scatter), then every `add`, norm, `cast` or `reshape` whose
    activation inputs are all in the region (the residual adds, the norms and their outputs)."""
    region: set[int] = set()
    for node in graph:
        if node.op in ("all_reduce", "embedding", "vocab_parallel_embedding"):
            region.update(id(o) for o in node.outputs)
            continue
        if node.op not in ("add", "rms_norm", "layer_norm", "cast", "reshape"):
            continue
        ins = [v for v in (node.inputs[:1] if node.op in ("rms_norm", "layer_norm") else node.inputs)
               if facts.is_act(v)]
        if ins and all(id(v) in region for v in ins):
            region.update(id(o) for o in node.outputs)
    return region


@dataclass
class TrainingActivations:
    peak_bytes: int
    """The most activation memory alive at once during the step (the planned figure)."""
    saved_bytes: int
    """Kept from the end of forward into backward (with recompute: outside-layer saves + layer inputs)."""
    recomputed_bytes: int
    """With recompute: the largest saved set one layer rebuilds for its backward."""
    transient_bytes: int
    """The largest backward working set of one op (its output and input gradients)."""
    layers: int
    recompute: bool
    saved_by_layer: dict[str, int] = field(default_factory=dict)
    """`saved_bytes` by the layer of the op that keeps each tensor ("<pre>" / "<post>": outside the
    layers, before / after them): the per-layer activation figure pipeline stages balance on."""


def training_activations(graph: Graph, facts: GraphFacts, env: Mapping[str, int], *, recompute: bool,
                         capacity_factor: float = 1.0, vocab_parallel: bool = True, sp: int = 1,
                         include: Callable[[Node], bool] | None = None,
                         loss: bool = True) -> TrainingActivations:
    """Activation memory of one training step (forward + backward) of `graph` at `env`.

    Each op keeps its saved set (`saved_for_backward`) from forward until its own backward has run;
    a tensor several ops keep lives until the first of them (in forward order) is done. The loss
    keeps its softmax over the graph's float outputs, and forms their gradient in that buffer; with
    `vocab_parallel` (the training runtime's default, training/vocab_parallel.py) a tensor-parallel
    rank graph's gathered logits are not formed: the loss reads, keeps and differentiates this
    rank's vocabulary shard (the all_gather's input) and the all_gather does not run. With
    `recompute` (full, per decoder layer) a layer keeps only its inputs; its saved set is rebuilt
    when its backward starts and freed op by op. The peak is found by walking backward from the
    loss: alive = what is still kept (+ the layer being recomputed) + the op's backward working set.

    `sp` > 1: sequence parallelism over that many tensor-parallel ranks: the
    `sequence_parallel_values` (residual stream, norms, their outputs) are kept as token shards
    (bytes / sp, rounded up), and so are the norms' and the router's per-row f32 internals; a
    linear (`LINEAR_OPS`: the column-parallel ones read the region) keeps its all-gathered input
    whole, as a separate tensor from the shard. `include`: only the nodes it accepts (a pipeline
    stage); `loss`: whether this part holds the loss (the last stage)."""
    nodes = [n for n in graph if include is None or include(n)]
    layer = [layer_of(n) for n in nodes]
    region = sequence_parallel_values(graph, facts) if sp > 1 else set()
    kept = _Kept(env, region, sp)  # kept from forward into backward (with recompute: the layer inputs)
    kept_internal = [0] * len(nodes)
    layer_vals: dict[str, _Kept] = {}  # with recompute: what each layer's backward rebuilds
    layer_internal = [0] * len(nodes)
    transient = [0] * len(nodes)
    index = {id(n): i for i, n in enumerate(nodes)}
    gather = logits_gather(graph) if vocab_parallel else None
    loss_reads = ([gather.inputs[0] if gather is not None and v is gather.outputs[0] else v
                   for v in graph.outputs] if loss else [])
    loss_ids = {id(v) for v in loss_reads if v is not None}
    for i, node in enumerate(nodes):
        saved = saved_for_backward(node, facts, env, capacity_factor)
        transient[i] = 0 if node is gather else backward_transient(node, facts, env, capacity_factor,
                                                                   loss_ids, region, sp)
        internal = sum(b for _, b in saved.internal)
        if region and node.op in SP_READERS and id(node.inputs[0]) in region:
            internal = -(-internal // sp)
        inner = layer[i] if recompute else None
        if inner is None:
            for v in saved.values:
                kept.keep(v, i, node.op)
            kept_internal[i] = internal
            continue
        layer_internal[i] = internal
        table = layer_vals.setdefault(inner, _Kept(env, region, sp))
        for v in saved.values:
            table.keep(v, i, node.op)
        for v in node.inputs:  # the layer's inputs stay for its recompute
            src = v.producer if v is not None else None
            j = index.get(id(src)) if src is not None else None
            if facts.is_act(v) and v is not None and (j is None or layer[j] != inner):
                kept.keep(facts.root(v), i)
    for v in loss_reads:  # the loss's softmax
        if v is not None and v.dtype.is_float and facts.is_act(v) and v.producer is not None:
            kept.keep(v, index[id(v.producer)])
    free = [kept_internal[i] + layer_internal[i] for i in range(len(nodes))]
    for b, i in kept.table.values():
        free[i] += b
    rebuilt: dict[str, int] = {}
    for name, vals in layer_vals.items():
        rebuilt[name] = sum(layer_internal[i] for i in range(len(nodes)) if layer[i] == name)
        for vid, (b, i) in vals.table.items():
            if vid not in kept.table:
                rebuilt[name] += b
                free[i] += b
    saved_bytes = sum(b for b, _ in kept.table.values()) + sum(kept_internal)
    peak = _backward_peak(layer if recompute else [None] * len(nodes), saved_bytes, rebuilt, free, transient)
    return TrainingActivations(peak_bytes=peak, saved_bytes=saved_bytes,
                               recomputed_bytes=max(rebuilt.values(), default=0),
                               transient_bytes=max(transient, default=0),
                               layers=len({x for x in layer if x is not None}), recompute=recompute,
                               saved_by_layer=_saved_by_layer(kept, kept_internal, layer))


@dataclass
class _Kept:
    """Tensors kept for backward: value key -> [bytes, index of the op after whose backward it
    goes]. A sequence-parallel value (`region`) is kept as a token shard (/ sp, rounded up), except
    by a linear, which keeps its all-gathered copy (a separate tensor)."""

    env: Mapping[str, int]
    region: set[int]
    sp: int
    table: dict[object, list[int]] = field(default_factory=dict)

    def keep(self, v: Value, i: int, reader: str | None = None) -> None:
        key: object = id(v)
        b = tensor_bytes(v.type, self.env)
        if id(v) in self.region:
            if reader in LINEAR_OPS:
                key = (id(v), "gathered")  # the all-gathered copy a column-parallel linear keeps
            else:
                b = -(-b // self.sp)
        entry = self.table.get(key)
        if entry is None:
            self.table[key] = [b, i]
        else:
            entry[1] = min(entry[1], i)


def _saved_by_layer(kept: _Kept, kept_internal: list[int], layer: list[str | None]) -> dict[str, int]:
    """The saved bytes by the layer of the op that keeps each tensor ("<pre>" / "<post>": outside
    the layers, before / after them)."""
    first_layer = next((i for i, x in enumerate(layer) if x is not None), len(layer))
    by_layer: dict[str, int] = {}

    def owner(i: int) -> str:
        return layer[i] or ("<pre>" if i < first_layer else "<post>")

    for b, i in kept.table.values():
        by_layer[owner(i)] = by_layer.get(owner(i), 0) + b
    for i, b in enumerate(kept_internal):
        if b:
            by_layer[owner(i)] = by_layer.get(owner(i), 0) + b
    return by_layer


def _backward_peak(recomputed: list[str | None], alive: int, rebuilt: Mapping[str, int], free: list[int],
                   transient: list[int]) -> int:
    """The most activation memory alive at once, walking backward from the loss: `alive` (the
    saved set at the end of forward) + the layer being recomputed (`rebuilt`, added as its backward
    starts; `recomputed[i]`: op i's layer under recompute, else None) + op i's backward working set
    (`transient`); after op i's backward, `free[i]` goes."""
    peak = alive
    entered: set[str] = set()
    for i in range(len(free) - 1, -1, -1):
        name = recomputed[i]
        if name is not None and name not in entered:
            entered.add(name)
            alive += rebuilt.get(name, 0)
        peak = max(peak, alive + transient[i])
        alive -= free[i]
    return peak


# -- inference ----------------------------------------------------------------------------------------


def _after_head(graph: Graph) -> set[int]:
    """id() of the values computed from lm_head's output (serving evaluates them for the last
    position of each sequence only)."""
    out: set[int] = set()
    for node in graph:
        if node.op == "lm_head" or any(v is not None and id(v) in out for v in node.inputs):
            out.update(id(o) for o in node.outputs)
    return out


def inference_peak(graph: Graph, facts: GraphFacts, prefill_tokens: int, batch: int,
                   capacity_factor: float = 1.0) -> int:
    """Peak live activation bytes of one forward step over `prefill_tokens` tokens (one sequence
    prefilled at once, B=1, S=prefill_tokens), with lm_head and what follows evaluated for the
    last position of `batch` sequences. A value lives from its producer to its last reader (graph
    outputs to the end); a node's peak is what is live plus its outputs plus its internal workspace
    (MoE: dispatched tokens, up_gate output, swiglu output of the rank's slots)."""
    env = {"B": 1, "S": prefill_tokens}
    head_env = {"B": batch, "S": 1}
    head = _after_head(graph)
    order = {id(n): i for i, n in enumerate(graph)}
    last_use: dict[int, int] = {}
    for node in graph:
        for v in node.inputs:
            if v is not None:
                last_use[id(v)] = order[id(node)]
    end = len(order)
    for v in graph.outputs:
        last_use[id(v)] = end

    def counted(v: Value) -> bool:
        if facts.is_act(v):
            return True
        # a portable-fallback dequantize materialises its weight while its reader runs
        p = v.producer
        return p is not None and p.op == "dequantize" and p.scope in facts.fallback_scopes

    def size(v: Value) -> int:
        return tensor_bytes(v.type, head_env if id(v) in head else env)

    live: dict[int, int] = {}
    for v in graph.inputs:
        live[id(v)] = size(v)
    current = sum(live.values())
    peak = current
    for i, node in enumerate(graph):
        outs = [o for o in node.outputs if counted(o)]
        out_bytes = sum(size(o) for o in outs)
        work = 0
        if node.op in ("moe_experts", "moe_experts_lora"):
            x = node.inputs[0]
            assert x is not None
            slots, h, inter, r = moe_dims(node, env, capacity_factor)
            work = slots * (h + 3 * inter + 2 * r) * x.dtype.bits // 8
        peak = max(peak, current + out_bytes + work)
        for o in outs:
            if last_use.get(id(o), i) > i:
                live[id(o)] = size(o)
                current += live[id(o)]
        for v in dict.fromkeys(node.inputs):
            if v is not None and last_use.get(id(v)) == i and id(v) in live:
                current -= live.pop(id(v))
    return peak


def kv_cache_bytes(graph: Graph, seq_len: int, batch: int, dtype: DType | None = None) -> int:
    """KV cache of `batch` sequences of `seq_len` tokens: per attention op, its k and v inputs'
    per-token size on this rank ([B, T, KV_local, D]) times batch * seq_len, in `dtype` (default:
    k's dtype, the activation dtype; a C8 cache's, u8, where k is `kv_cache_dequantize`d)."""
    total = 0
    for node in graph:
        if node.op != "attention":
            continue
        for v in node.inputs[1:3]:
            assert v is not None
            per_token = math.prod(eval_dim(d, {}) for d in v.shape[2:])
            stored = v
            if v.producer is not None and v.producer.op == "kv_cache_dequantize":  # C8: the cache is u8
                stored = v.producer.inputs[0]  # type: ignore[assignment]
            bits = (dtype or stored.dtype).bits
            total += batch * seq_len * per_token * bits // 8
    return total
