"""`rank_varying`: which values of a rank graph differ between its tensor/expert-parallel ranks.

An IR analysis (no pass: it changes nothing) over the graphs `split` makes. A value differs
between ranks when it is read from a sharded param (a `shard` annotation), produced by a
rank-dependent op (`RANK_OPS`: its attrs or its rank's shard make it so), or computed from such
a value; a collective (`COLLECTIVE_OPS`) makes its outputs replicated again. A pipeline stage's
inputs are as the whole rank graph had them: the cut (`pipeline-stages`) records those that
differ (`rank_varying_inputs` of the stage metadata), since a stage cannot see that its input
was, say, a sequence shard.

Its users: the pipeline cut (`pipeline_stages`), which records it per stage, and the Paddle
lowering (`backends/paddle/layer.py`), whose tensor-parallel training puts every replicated
value a rank-varying node reads through Megatron's "f" (identity forward, all-reduce backward).
"""

from __future__ import annotations

from ernie_ir.ir import Graph, Param
from ernie_ir.ir.mapping import SHARD, stage_info

COLLECTIVE_OPS = frozenset({"all_reduce", "all_gather", "all_gather_sequence"})
"""Ops whose outputs are the same on every rank (a whole value made of every rank's part)."""

RANK_OPS = frozenset({"vocab_parallel_embedding", "moe_local_experts", "reduce_scatter", "scatter_sequence"})
"""Ops whose outputs differ per rank even from replicated inputs (their attrs or their rank's shard)."""


def rank_varying(graph: Graph) -> set[int]:
    """ids of the values of a rank graph that differ between ranks: read from a sharded param
    (`shard` annotation), produced by a rank-dependent op, or computed from such a value;
    collectives make their outputs replicated again. A pipeline stage's inputs are as the
    whole rank graph had them (`rank_varying_inputs` of its pipeline metadata)."""
    varying: set[int] = set()
    info = stage_info(graph.metadata)
    if info is not None:
        named = set(info.get("rank_varying_inputs", []))
        varying.update(id(v) for v in graph.inputs if v.name in named)
    for node in graph:
        if node.op in COLLECTIVE_OPS:
            continue
        if node.op in RANK_OPS or any(
                v is not None and (id(v) in varying or (isinstance(v, Param) and SHARD in v.annotations))
                for v in node.inputs):
            varying.update(id(o) for o in node.outputs)
    return varying
