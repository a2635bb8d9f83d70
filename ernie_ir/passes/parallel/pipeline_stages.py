"""Pipeline parallelism's cut: one (rank) graph into `pp` stage graphs at decoder-layer boundaries.

Each node belongs to the stage of its decoder layer (`...layers.N` in its scope); a node outside
the layers joins the latest stage among its producers (the embedding and anything computed from
the inputs alone: stage 0; the final norm, lm_head and the logits' gather: the last). What a
later stage reads from an earlier one crosses each boundary in between: stage s's outputs are
exactly stage s+1's inputs (`act{i}`, in definition order; a graph input keeps its name), so the
runtime sends them in that order. A value that is only passed through (the rope tables, the
input ids) is re-sent at every boundary rather than recomputed: the cut never duplicates work.

`stage_bounds` balances the stages by the bytes of the weights each holds (the embedding on the
first stage, the final norm and lm_head on the last: a tied embedding counts on both), with
`min_max_partition`, which the memory planner shares with its own (memory) cost.

The pass, `pipeline-stages{pp=N}`, is a fan-out pass: under the pass manager's `run_ranks` it
takes every rank graph (those `split` made, or the one graph) and returns pp x world stage graphs,
graph g being stage g // world of rank g % world; `compile --pp N` appends it after the
target's legalization. Run on one graph (`run`), the graph becomes stage `stage`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from copy import deepcopy

from ernie_ir.ir import ErnieIRError, Graph, Node, Param, Value
from ernie_ir.ir.mapping import PIPELINE_STAGE, stage_info

from ..infra.base import Pass, PassContext, PassOptions
from ..infra.registry import register_pass
from .rank_varying import rank_varying
from .split import _replace_contents

LAYER = re.compile(r"^(.*?\.layers\.(\d+))(?:\.|$)")


class StageError(ErnieIRError):
    """A pipeline layout the model cannot take: names the model's layers and what works."""


def decoder_layer(node: Node) -> int | None:
    """The index of the decoder layer `node` belongs to (from its scope), None outside the layers."""
    m = LAYER.match(node.scope or "")
    return int(m.group(2)) if m else None


def layer_count(graph: Graph) -> int:
    """Decoder layers of `graph` (their indices must be 0..n-1)."""
    found = {x for x in (decoder_layer(n) for n in graph) if x is not None}
    return len(found)


def check_pipeline(pp: int, layers: int, model: str = "the model") -> None:
    """Refuse (StageError, one line) `pp` stages that some stage would get no layer of."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise StageError(f"--pp {pp}: the number of pipeline stages must be an integer >= 1")
    if layers == 0 and pp > 1:
        raise StageError(f"--pp {pp}: {model} has no decoder layers (no `layers.N` scopes) to cut into "
                         "stages: use --pp 1")
    if pp > layers:
        raise StageError(f"--pp {pp}: {model} has {layers} decoder layer(s) and every stage needs at least "
                         f"one: give --pp {layers} or less")


def min_max_partition(n: int, parts: int, cost: Callable[[int, int, int], int]) -> list[tuple[int, int]]:
    """Contiguous ranges [i, j) of 0..n, `parts` of them, each non-empty, minimising the largest
    `cost(part, i, j)` (dynamic programming, O(parts x n^2) calls; ties: the earliest cuts)."""
    big = 1 << 126
    best = [[big] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for st in range(parts):
        for j in range(st + 1, n - (parts - st - 1) + 1):
            for i in range(st, j):
                if best[st][i] == big:
                    continue
                v = max(best[st][i], cost(st, i, j))
                if v < best[st + 1][j]:
                    best[st + 1][j], cut[st + 1][j] = v, i
    bounds = [n]
    for st in range(parts, 0, -1):
        bounds.append(cut[st][bounds[-1]])
    bounds.reverse()
    return [(bounds[s], bounds[s + 1]) for s in range(parts)]


def _weight_bytes(graph: Graph) -> tuple[list[int], int, int]:
    """(bytes of the params each layer reads, of those read before the layers, after them)."""
    layers = [0] * layer_count(graph)
    pre = post = 0
    seen_layer = False
    counted: set[tuple[str, str]] = set()
    for node in graph:
        layer = decoder_layer(node)
        seen_layer = seen_layer or layer is not None
        where = str(layer) if layer is not None else ("post" if seen_layer else "pre")
        for v in node.inputs:
            if not isinstance(v, Param) or (v.name, where) in counted:
                continue
            counted.add((v.name, where))
            b = math.prod(int(d) for d in v.type.shape) * v.type.dtype.bits // 8
            if layer is not None and layer < len(layers):
                layers[layer] += b
            elif where == "pre":
                pre += b
            else:
                post += b
    return layers, pre, post


def stage_bounds(graph: Graph, pp: int) -> tuple[tuple[int, int], ...]:
    """`pp` contiguous decoder-layer ranges [first, stop) balancing the weight bytes each stage
    holds (StageError when the model cannot take `pp` stages)."""
    n = layer_count(graph)
    check_pipeline(pp, n, graph.name or "the model")
    layers, pre, post = _weight_bytes(graph)
    prefix = [0]
    for b in layers:
        prefix.append(prefix[-1] + b)

    def cost(st: int, i: int, j: int) -> int:
        return prefix[j] - prefix[i] + (pre if st == 0 else 0) + (post if st == pp - 1 else 0)

    return tuple(min_max_partition(n, pp, cost))


def _node_stages(graph: Graph, bounds: Sequence[tuple[int, int]]) -> tuple[dict[int, int], dict[int, int]]:
    """(stage of each node, stage that defines each value), by id()."""
    stage_of_layer = {layer: s for s, (a, b) in enumerate(bounds) for layer in range(a, b)}
    defined: dict[int, int] = {id(v): 0 for v in graph.inputs}
    nodes: dict[int, int] = {}
    for node in graph:
        low = max((defined[id(v)] for v in node.inputs if v is not None and not isinstance(v, Param)),
                  default=0)
        layer = decoder_layer(node)
        s = low if layer is None else stage_of_layer.get(layer)
        if s is None:
            raise StageError(f"{graph.name}: layer {layer} (at {node.scope}) is in no stage of "
                             f"{list(bounds)}: the stages must cover layers 0..{len(stage_of_layer) - 1}")
        if s < low:
            raise StageError(f"{graph.name}: {node.op} at {node.scope} (layer {layer}, stage {s}) reads a "
                             f"value of stage {low}: this model's layers are not a chain a pipeline can "
                             "cut; use --pp 1")
        nodes[id(node)] = s
        for o in node.outputs:
            defined[id(o)] = s
    return nodes, defined


def _needs_grad(graph: Graph) -> set[int]:
    """id() of the float values a trainable param reaches (their gradient flows back)."""
    out: set[int] = set()
    for node in graph:
        if any(v is not None and (id(v) in out or (isinstance(v, Param) and v.trainable))
               for v in node.inputs):
            out.update(id(o) for o in node.outputs if o.type.dtype.is_float)
    return out


def cut_stages(graph: Graph, bounds: Sequence[tuple[int, int]], *,
               tensor_parallel: bool = False) -> list[Graph]:
    """The stage graphs of `graph` for the layer ranges `bounds` (`stage_bounds`). Params are
    shared (each stage graph holds the params its nodes read, with the same sources, no byte
    copied); a param two stages read (a tied embedding) is in both. A trainable one must be read
    by the first and the last stage alone (StageError otherwise): both record it (`tied`), and
    the runtime sums its two gradients over those stages before each step (Megatron's
    shared-weight all-reduce: ernie_ir.backends.paddle.pipeline.TiedWeights).
    `tensor_parallel`: `graph` is one of several rank graphs; the inputs of a stage that differ
    between its ranks (`rank_varying`, the analysis that decides where gradients are summed over
    the ranks) are recorded (`rank_varying_inputs`), since a stage cannot see that its input
    was, say, a sequence shard."""
    pp = len(bounds)
    node_stage, defined = _node_stages(graph, bounds)
    last_use: dict[int, int] = {}
    for node in graph:
        for v in node.inputs:
            if v is not None and not isinstance(v, Param):
                last_use[id(v)] = max(last_use.get(id(v), 0), node_stage[id(node)])
    for v in graph.outputs:
        last_use[id(v)] = pp  # the model's outputs leave from the last stage
    values: list[Value] = [*graph.inputs, *(o for n in graph for o in n.outputs)]
    boundary = [[v for v in values if id(v) in last_use and defined[id(v)] <= s < last_use[id(v)]]
                for s in range(pp - 1)]
    graph_inputs = {id(v) for v in graph.inputs}
    names = {id(v): v.name for v in graph.inputs}
    for cross in boundary:
        for v in cross:
            names.setdefault(id(v), f"act{len(names) - len(graph.inputs)}")
    grad = _needs_grad(graph)
    varying = rank_varying(graph) if tensor_parallel else set()
    readers: dict[str, set[int]] = {}
    for node in graph:
        for v in node.inputs:
            if isinstance(v, Param) and v.trainable:
                readers.setdefault(v.name, set()).add(node_stage[id(node)])
    tied = sorted(n for n, st in readers.items() if len(st) > 1)
    odd = next((n for n in tied if readers[n] != {0, pp - 1}), None)
    if odd is not None:
        raise StageError(f"{graph.name}: trainable param {odd} is read by stages {sorted(readers[odd])}: "
                         "the pipeline sums a shared weight's gradients between the first and the last "
                         "stage only (a tied embedding); train it with --pp 1 or keep it frozen")
    stages: list[Graph] = []
    for s in range(pp):
        g = Graph(graph.name)
        env: dict[int, Value] = {}
        ins = graph.inputs if s == 0 else boundary[s - 1]
        for v in ins:
            env[id(v)] = g.add_input(str(names[id(v)]), v.type)
        for node in graph:
            if node_stage[id(node)] != s:
                continue
            args: list[Value | None] = []
            for v in node.inputs:
                if v is None:
                    args.append(None)
                elif isinstance(v, Param):
                    args.append(g.params.get(v.name) or g.add_param(_copy_param(v)))
                else:
                    args.append(env[id(v)])
            copy = Node(node.op, args, node.attrs, scope=node.scope,
                        output_types=[o.type for o in node.outputs],
                        output_names=[o.name for o in node.outputs] if any(o.name for o in node.outputs)
                        else None)
            g.append(copy)
            for o, c in zip(node.outputs, copy.outputs, strict=True):
                env[id(o)] = c
        if s == pp - 1:
            g.set_outputs([env[id(v)] for v in graph.outputs], list(graph.output_names))
        else:
            g.outputs = [env[id(v)] for v in boundary[s]]
            g.output_names = [str(names[id(v)]) for v in boundary[s]]
        g.metadata = deepcopy(graph.metadata)
        g.metadata[PIPELINE_STAGE] = {
            "stage": s, "pp": pp, "layers": list(bounds[s]), "stages": [list(b) for b in bounds],
            "needs_grad": [str(names[id(v)]) for v in ins if id(v) in grad and id(v) not in graph_inputs],
            "outputs_need_grad": [] if s == pp - 1 else [str(names[id(v)]) for v in boundary[s]
                                                         if id(v) in grad],
            "grad_edges": [any(id(v) in grad for v in cross) for cross in boundary],
            "rank_varying_inputs": [str(names[id(v)]) for v in ins if id(v) in varying],
            "tied": tied if s in (0, pp - 1) else []}
        stages.append(g)
    return stages


def _copy_param(p: Param) -> Param:
    copy = Param(p.name, p.type, None, trainable=p.trainable, annotations=deepcopy(p.annotations))
    copy.source = p.source  # shared: no byte copied (and no re-check of a meta source)
    copy.digest = p.digest
    return copy


def pipeline_ranks(ranks: Sequence[Graph], pp: int) -> tuple[list[Graph], tuple[tuple[int, int], ...]]:
    """Every model-parallel rank graph cut into `pp` stages at the same layer boundaries (those
    `stage_bounds` balances on rank 0): graph g = stage g // len(ranks) of rank g % len(ranks)."""
    _check_uncut(ranks)
    bounds = stage_bounds(ranks[0], pp)
    cut = [cut_stages(r, bounds, tensor_parallel=len(ranks) > 1) for r in ranks]
    return [cut[r][s] for s in range(pp) for r in range(len(ranks))], bounds


def _check_uncut(ranks: Sequence[Graph]) -> None:
    for r in ranks:
        info = stage_info(r.metadata)
        if info is not None:
            raise StageError(f"{r.name}: the graph is already pipeline stage {info.get('stage')} of "
                             f"{info.get('pp')}: cut the whole rank graphs once (one pipeline-stages)")


def pipeline_bounds(graph: Graph) -> tuple[tuple[int, int], ...] | None:
    """The layer ranges of every stage, read from a stage graph's metadata (what the cut
    recorded, for the layout: `Mapping.with_pipeline`); None for a graph that is not a stage."""
    info = stage_info(graph.metadata)
    if info is None:
        return None
    return tuple((int(a), int(b)) for a, b in info["stages"])


class PipelineStagesOptions(PassOptions):
    pp: int = 1
    """Pipeline stages: each rank graph is cut into `pp` at decoder-layer boundaries."""
    stage: int = 0
    """Which stage's graph the pass leaves in place when run on one graph (`compile` keeps every
    stage of every rank)."""


@register_pass
class PipelineStagesPass(Pass):
    """Cut every rank graph into pipeline stages; run on one graph, it becomes stage `stage`."""

    name = "pipeline-stages"
    description = ("pipeline-parallel cut (pp) at decoder-layer boundaries, after split: the graph "
                   "becomes one stage's graph; compile --pp writes every stage of every rank")
    Options = PipelineStagesOptions
    fans_out = True

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        o: PipelineStagesOptions = self.options  # type: ignore[assignment]
        if not 0 <= o.stage < max(o.pp, 1):
            raise StageError(f"pipeline-stages: stage {o.stage} is outside the {o.pp} stage(s)")
        stages = self.fan_out_ranks([graph], ctx)
        if stages == [graph]:
            return False
        _replace_contents(graph, stages[o.stage])
        return True

    def fan_out(self, graph: Graph, ctx: PassContext) -> list[Graph]:
        """The stage graphs of `graph` (left as it is)."""
        return self.fan_out_ranks([graph], ctx)

    def fan_out_ranks(self, graphs: list[Graph], ctx: PassContext) -> list[Graph]:
        """pp x len(graphs) stage graphs, stage-major (`pipeline_ranks`); pp 1: `graphs`."""
        o: PipelineStagesOptions = self.options  # type: ignore[assignment]
        _check_uncut(graphs)
        check_pipeline(o.pp, layer_count(graphs[0]), graphs[0].name or "the model")
        if o.pp == 1:
            return list(graphs)
        stages, _ = pipeline_ranks(graphs, o.pp)
        ctx.count("stages", o.pp)
        ctx.count("stage-graphs", len(stages))
        return stages
