"""The pass manager: runs a pipeline under instruments, verifying as it goes.

In debug mode (the default, and what tests and CI use) the manager
- verifies the IR after every pass and, on failure, raises
  `PassVerificationError` naming the pass and the passes that ran before it;
- checks each pass's "changed" claim against the printed IR, so a pass that
  modifies the graph but reports no change is caught.
Required properties are checked against the graph before each pass, and the
pass's produced properties are recorded on the graph afterwards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.verifier import verify_problems

from .base import PassContext, PipelineError, graph_properties, set_graph_properties
from .instruments import PassInstrument
from .pipeline import Pipeline


class PassVerificationError(ErnieIRError):
    """The IR was invalid after a pass: names the pass and what ran before it."""


class PassContractError(ErnieIRError):
    """A pass broke its own contract (e.g. changed the graph but said it did not)."""


@dataclass
class PipelineResult:
    changed: bool
    changed_by: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    stats: dict[str, dict[str, int]] = field(default_factory=dict)


def _fingerprint(graph: Graph) -> str:
    return hashlib.sha256(print_graph(graph).encode()).hexdigest()


class PassManager:
    def __init__(self, pipeline: Pipeline, *, instruments: Sequence[PassInstrument] = (),
                 debug: bool = True) -> None:
        self.pipeline = pipeline
        self.instruments = list(instruments)
        self.debug = debug

    def run(self, graph: Graph) -> PipelineResult:
        result = PipelineResult(changed=False)
        for inst in self.instruments:
            inst.enter_pipeline(self.pipeline, graph)
        ran: list[str] = []
        for index, p in enumerate(self.pipeline.passes, 1):
            props = graph_properties(graph)
            missing = sorted(p.requires - props)
            if missing:
                raise PipelineError(
                    f"pass {p.name} requires {', '.join(missing)}, which this graph does not have"
                )
            for inst in self.instruments:
                inst.before_pass(index, p, graph)
            before = _fingerprint(graph) if self.debug else ""
            ctx = PassContext(debug=self.debug)
            changed = bool(p.run(graph, ctx))
            if self.debug:
                problems = verify_problems(graph)
                if problems:
                    earlier = ", ".join(ran) if ran else "none"
                    raise PassVerificationError(
                        f"IR is invalid after pass {p.spec()} (pass {index}; ran before it: "
                        f"{earlier}): {problems[0]}"
                        + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                    )
                after = _fingerprint(graph)
                really = after != before
                if really and not changed:
                    raise PassContractError(
                        f"pass {p.name} changed the graph but returned False (report changes "
                        "truthfully: caches and instruments rely on it)"
                    )
                changed = really
            # Recorded after the "changed" check: the manager writes these, not the pass, so a
            # pass that only establishes a property (and says "unchanged") keeps its word.
            if p.produces or p.invalidates:
                set_graph_properties(graph, (graph_properties(graph) - p.invalidates) | p.produces)
            ran.append(p.spec())
            for inst in self.instruments:
                inst.after_pass(index, p, graph, changed, ctx)
            if changed:
                result.changed = True
                result.changed_by.append(p.name)
            result.warnings.extend(f"{p.name}: {w}" for w in ctx.warnings)
            if ctx.stats:
                result.stats[f"{index}:{p.name}"] = dict(ctx.stats)
        for inst in self.instruments:
            inst.exit_pipeline(graph)
        return result


def run_pipeline(graph: Graph, pipeline: Pipeline | str, *,
                 instruments: Sequence[PassInstrument] = (), debug: bool = True) -> PipelineResult:
    """Run a pipeline (object or text) on a graph in place."""
    if isinstance(pipeline, str):
        from .pipeline import load_pipeline

        pipeline = load_pipeline(pipeline, initial=graph_properties(graph))
    return PassManager(pipeline, instruments=instruments, debug=debug).run(graph)
