"""An artifact on the reference interpreter: every artifact offers it.

One rank: its graph in `Interpreter`. Several ranks run in lockstep as SPMD (ernie_ir.runtime
.spmd), rank 0 reports; a pipelined artifact runs its stages in order. Decoding steps every
rank's decoder graph, each rank keeping its own cache (its own KV heads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ernie_ir.backends.base import BackendSession, DecoderParts
from ernie_ir.ir import Graph
from ernie_ir.runtime.decoding import StepFn


class InterpreterSession(BackendSession):
    name = "interpreter"

    def logits(self, input_ids: np.ndarray, *, timeout_s: float | None = None) -> np.ndarray:
        from ernie_ir.artifacts import load_rank_graphs
        from ernie_ir.runtime.spmd import run_pipeline_spmd, run_spmd

        mapping, graphs = load_rank_graphs(self.root, verify=False)
        name = graphs[-1].output_names[0]
        feed = {graphs[0].inputs[0].name: np.asarray(input_ids)}
        if mapping.pp > 1:
            return run_pipeline_spmd(graphs, mapping.pp, feed)[0][name]
        return run_spmd(graphs, feed)[0][name]  # rank 0 reports

    def decoder(self, graphs: list[Graph], *, timeout_s: float | None = None) -> DecoderParts:
        return DecoderParts(interpreter_step(graphs))


def interpreter_step(graphs: list[Graph]) -> StepFn:
    """One decoder step over `graphs` (one rank, or several in lockstep), each rank's interpreter
    kept across steps (its params and dequantized weights are read once)."""
    from ernie_ir.runtime import Interpreter

    if len(graphs) == 1:
        return Interpreter(graphs[0]).run
    from ernie_ir.runtime.spmd import run_spmd

    ranks = [Interpreter(g) for g in graphs]

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, Any]:
        # Each rank keeps its own cache (its own KV heads): the loop carries them stacked on a
        # leading rank axis, and a first step's empty past serves every rank.
        per_rank = [{k: (v[r] if k.startswith("past_key_values.") and v.ndim == 5 else v)
                     for k, v in feeds.items()} for r in range(len(graphs))]
        outs = run_spmd(ranks, per_rank)
        result = dict(outs[0])
        for k in result:
            if k.startswith("present."):
                result[k] = np.stack([o[k] for o in outs])
        return result

    return step
