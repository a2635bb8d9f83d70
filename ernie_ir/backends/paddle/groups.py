"""The process groups of a paddle.distributed run: listed per kind of parallelism, created by one
helper.

    wanted = data_parallel_group_ranks(dp=2, world=2)   # [(("mp", 0), [0, 1]), ..., (("dp", 1), [1, 3])]
    mine = create_groups(process, wanted)               # {("mp", 0): group, ("dp", 0): group} on process 0

Paddle numbers groups by creation, so every process creates every group of the run, in the same
order, whether it belongs to the group or not; and each creation is followed by gloo's barrier:
two gloo groups that rendezvous at once can pair the wrong peers and hang (seen with [0, 2] and
[1, 3] on Paddle 3.3). `create_groups` does both, for data parallelism
(ernie_ir.training.data_parallel) and pipeline parallelism (ernie_ir.backends.paddle.pipeline)
alike; the listings are plain data, in the order the processes create them, and live with the
layout (ernie_ir.ir.mapping: `Mapping.process_groups`, `data_parallel_group_ranks`,
`pipeline_group_ranks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ernie_ir.ir.mapping import GroupKey, GroupRanks, data_parallel_group_ranks, pipeline_group_ranks

__all__ = ["GroupKey", "GroupRanks", "create_groups", "data_parallel_group_ranks", "pipeline_group_ranks"]

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
