"""The SPMD interpreter: every rank graph of a parallel layout in lockstep, in one process.

    logits = run_spmd(rank_graphs, {"input_ids": ids})["logits"]   # rank 0's outputs

Each rank runs its own graph with the reference interpreter; at every
collective (all_reduce, all_gather) all ranks stop, the op's reference
`collective` kernel combines their inputs, and each rank resumes with its
result. A split is therefore checked exactly on one CPU, against the unsplit
graph, with no process or network in the way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ernie_ir.ir import DType, ErnieIRError, Graph
from ernie_ir.runtime.interpreter import Interpreter


class SpmdError(ErnieIRError):
    """The rank graphs did not meet at the same collective."""


def run_spmd(graphs: Sequence[Graph | Interpreter],
             inputs: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]],
             *, emulate: DType | None = None) -> list[dict[str, np.ndarray]]:
    """Outputs of every rank (rank order). `inputs`: one feed for all ranks, or one per rank.
    A rank given as an `Interpreter` keeps its params and derived weights between calls."""
    feeds = [inputs] * len(graphs) if isinstance(inputs, Mapping) else list(inputs)
    if len(feeds) != len(graphs):
        raise SpmdError(f"{len(feeds)} feeds for {len(graphs)} rank graphs")
    runs = [(g if isinstance(g, Interpreter) else Interpreter(g, emulate=emulate)).steps(f)
            for g, f in zip(graphs, feeds, strict=True)]
    outputs: list[dict[str, np.ndarray] | None] = [None] * len(runs)
    pending = []
    for r, run in enumerate(runs):
        pending.append(_advance(run, None, r, outputs))
    while any(p is not None for p in pending):
        if any(p is None for p in pending):
            done = [r for r, p in enumerate(pending) if p is None]
            raise SpmdError(f"rank {done[0]} finished while rank(s) "
                            f"{[r for r, p in enumerate(pending) if p is not None]} wait at a collective")
        nodes = [p[0] for p in pending if p is not None]
        first = nodes[0]
        for r, node in enumerate(nodes):
            if node.op != first.op or node.attrs != first.attrs:
                raise SpmdError(f"rank {r} reached {node.op} at {node.scope or '<root>'} while rank 0 "
                                f"reached {first.op} at {first.scope or '<root>'}")
        results = first.opdef.collective([p[1] for p in pending if p is not None], first.attrs)
        pending = [_advance(runs[r], results[r], r, outputs) for r in range(len(runs))]
    return [o for o in outputs if o is not None]


def _advance(run, send, rank, outputs):  # type: ignore[no-untyped-def]
    try:
        return next(run) if send is None else run.send(send)
    except StopIteration as done:
        outputs[rank] = done.value
        return None


def run_pipeline_spmd(graphs: Sequence[Graph], pp: int, inputs: Mapping[str, np.ndarray],
                      *, emulate: DType | None = None) -> list[dict[str, np.ndarray]]:
    """Outputs of every model-parallel rank of the last stage of a pipelined artifact (`graphs`:
    pp x world rank graphs, stage-major): each stage's ranks in lockstep (`run_spmd`), every
    rank fed its own peer's outputs of the stage before, as the p2p sends of the runtime."""
    world = len(graphs) // pp
    feeds: list[Mapping[str, np.ndarray]] = [inputs] * world
    outputs: list[dict[str, np.ndarray]] = []
    for s in range(pp):
        outputs = run_spmd(graphs[s * world:(s + 1) * world], feeds, emulate=emulate)
        feeds = outputs
    return outputs
