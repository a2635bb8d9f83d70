"""The process groups of a paddle.distributed run: listed per kind of parallelism, created by one
helper.

    wanted = data_parallel_group_ranks(dp=2, world=2)   # [(("mp", 0), [0, 1]), ..., (("dp", 1), [1, 3])]
    mine = create_groups(process, wanted)               # {("mp", 0): group, ("dp", 0): group} on process 0

Paddle numbers groups by creation, so every process creates every group of the run, in the same
order, whether it belongs to the group or not; and each creation is followed by gloo's barrier:
two gloo groups that rendezvous at once can pair the wrong peers and hang (seen with [0, 2] and
[1, 3] on Paddle 3.3). `create_groups` does both, for data parallelism
(ernie_ir.training.data_parallel) and pipeline parallelism (ernie_ir.backends.paddle.pipeline)
alike; the listings (`data_parallel_group_ranks`, `pipeline_group_ranks`) are plain data, in the
order the processes create them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GroupKey = tuple[str | int, ...]
"""A group's name in a listing: its kind, then the indices that tell it from the others of its kind
(("dp", m): the dp group of model-parallel rank m)."""

GroupRanks = tuple[GroupKey, list[int]]
"""(key, the global ranks of its processes) of one group."""


def data_parallel_group_ranks(dp: int, world: int) -> list[GroupRanks]:
    """The groups of `dp` replicas of `world` model-parallel ranks (process g: replica g // world,
    rank graph g % world): ("mp", d) the ranks of replica d (world > 1 only; otherwise a rank's
    model-parallel group is itself), ("dp", m) the replicas of model-parallel rank m."""
    wanted: list[GroupRanks] = []
    if world > 1:
        wanted += [(("mp", d), list(range(d * world, (d + 1) * world))) for d in range(dp)]
    wanted += [(("dp", m), [m + d * world for d in range(dp)]) for m in range(world)]
    return wanted


def pipeline_group_ranks(stages: int, world: int) -> list[GroupRanks]:
    """The groups of `stages` pipeline stages of `world` model-parallel ranks (process g: stage
    g // world, rank g % world): ("mp", s) the ranks of stage s (world > 1 only), ("edge", s, q)
    the 2-rank group of rank q's edge from stage s to s + 1 (Paddle's gloo p2p tags count per
    group, so each edge gets its own), ("ring", q) rank q's stages (more than 2 stages only: with
    2 the edge is the ring)."""
    wanted: list[GroupRanks] = []
    if world > 1:
        wanted += [(("mp", s), list(range(s * world, (s + 1) * world))) for s in range(stages)]
    wanted += [(("edge", s, q), [s * world + q, (s + 1) * world + q])
               for s in range(stages - 1) for q in range(world)]
    if stages > 2:
        wanted += [(("ring", q), [s * world + q for s in range(stages)]) for q in range(world)]
    return wanted


def create_groups(process: int, wanted: Sequence[GroupRanks]) -> dict[GroupKey, Any]:
    """Create every group of `wanted` (`dist.new_group`), in order, each followed by a barrier
    (the module docstring says why); the groups process `process` belongs to, by key. Every
    process of the run must call it with the same listing."""
    import paddle.distributed as dist

    mine: dict[GroupKey, Any] = {}
    for key, ranks in wanted:
        group = dist.new_group(ranks)
        dist.barrier()
        if process in ranks:
            mine[key] = group
    return mine
