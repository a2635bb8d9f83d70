"""The pass manager: runs a pipeline under instruments, verifying as it goes.

In debug mode (the default, and what tests and CI use) the manager
- verifies the IR after every pass and, on failure, raises
  `PassVerificationError` naming the pass and the passes that ran before it;
- checks each pass's "changed" claim against the printed IR, so a pass that
  modifies the graph but reports no change is caught.
Required properties are checked against the graph before each pass, and the
pass's produced properties are recorded on the graph afterwards.

For bisecting, `disabled_passes` (names, as TVM's `PassContext(disabled_pass=...)`) and
`stop_after` (a name or a 1-based position, as LLVM's `-stop-after`) cut the pipeline
before anything runs; the cut pipeline's order is checked against the graph first.

The manager times each pass itself, so that `TimingInstrument` reports the pass alone:
verification and the debug "changed" check, and the time instruments spend in their hooks
(printing, dumping), are measured apart and handed to instruments as `PassTimes`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.mapping import Mapping as ParallelMapping
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.verifier import verify_problems

from .base import AdapterReader, GraphEvaluator, Pass, PassContext, graph_properties, set_graph_properties
from .instruments import PassInstrument, PassTimes
from .pipeline import Pipeline, load_pipeline
from .pipeline_syntax import PipelineError


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
                 debug: bool = True, disabled_passes: Iterable[str] = (),
                 stop_after: str | int | None = None, evaluator: GraphEvaluator | None = None,
                 adapter_reader: AdapterReader | None = None) -> None:
        disabled = list(disabled_passes)
        self._cut = bool(disabled) or stop_after is not None
        self.pipeline = pipeline.restricted(disabled, stop_after) if self._cut else pipeline
        self.instruments = list(instruments)
        self.debug = debug
        self.evaluator = evaluator  # handed to every pass's context (see PassContext)
        self.adapter_reader = adapter_reader  # likewise
        self.mapping: ParallelMapping | None = None  # set by a fan-out pass (the split)

    def _enter(self, graph: Graph) -> None:
        if self._cut:  # a cut pipeline may lose a pass that a later one requires
            self.pipeline.check_order(graph_properties(graph))
        for inst in self.instruments:
            inst.enter_pipeline(self.pipeline, graph)

    def run(self, graph: Graph) -> PipelineResult:
        """Run every pass on `graph` in place (a fan-out pass keeps one of its graphs, see
        `run_ranks` for all of them)."""
        result = PipelineResult(changed=False)
        self._enter(graph)
        ran: list[str] = []
        for index, p in enumerate(self.pipeline.passes, 1):
            self._run_pass(index, p, graph, ran, result)
        for inst in self.instruments:
            inst.exit_pipeline(graph)
        return result

    def run_ranks(self, graph: Graph) -> RankedResult:
        """Run the pipeline, fanning out at each fan-out pass (the split, then the pipeline cut):
        the passes before the first rewrite `graph`, the ones after it rewrite each of the graphs
        it made, and a later fan-out pass turns all of those into its own graphs."""
        result = PipelineResult(changed=False)
        self._enter(graph)
        ran: list[str] = []
        graphs = [graph]
        for index, p in enumerate(self.pipeline.passes, 1):
            if p.fans_out:
                graphs = self._fan_out(index, p, graphs, ran, result)
                continue
            for i, g in enumerate(graphs):  # ranks after the first report only new warnings
                scratch = result if i == 0 else PipelineResult(changed=False)
                self._run_pass(index, p, g, ran if i == len(graphs) - 1 else list(ran), scratch)
                result.warnings.extend(w for w in scratch.warnings if w not in result.warnings)
        for inst in self.instruments:
            inst.exit_pipeline(graphs[0])
        return RankedResult(graph, graphs, result, self.mapping)

    def _before(self, index: int, p: Pass, graph: Graph) -> float:
        """Run the instruments' before hooks; the seconds they took."""
        t0 = time.perf_counter()
        for inst in self.instruments:
            inst.before_pass(index, p, graph)
        return time.perf_counter() - t0

    def _check_requires(self, p: Pass, graph: Graph) -> None:
        missing = sorted(p.requires - graph_properties(graph))
        if missing:
            raise PipelineError(
                f"pass {p.name} requires {', '.join(missing)}, which this graph does not have"
            )

    def _verify(self, index: int, p: Pass, graph: Graph, ran: list[str]) -> None:
        problems = verify_problems(graph)
        if problems:
            earlier = ", ".join(ran) if ran else "none"
            raise PassVerificationError(
                f"IR is invalid after pass {p.spec()} (pass {index}; ran before it: "
                f"{earlier}): {problems[0]}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            )

    def _record(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext,
                ran: list[str], result: PipelineResult, times: PassTimes) -> None:
        # Recorded after the "changed" check: the manager writes these, not the pass, so a
        # pass that only establishes a property (and says "unchanged") keeps its word.
        if p.produces or p.invalidates:
            set_graph_properties(graph, (graph_properties(graph) - p.invalidates) | p.produces)
        t0 = time.perf_counter()
        for inst in self.instruments:
            inst.after_pass(index, p, graph, changed, ctx)
        times.instrument_seconds += time.perf_counter() - t0
        for inst in self.instruments:
            inst.pass_timed(index, p, times)
        if changed:
            result.changed = True
            result.changed_by.append(p.name)
        result.warnings.extend(f"{p.name}: {w}" for w in ctx.warnings)
        if ctx.stats:
            result.stats[f"{index}:{p.name}"] = dict(ctx.stats)

    def _fan_out(self, index: int, p: Pass, graphs: list[Graph], ran: list[str],
                 result: PipelineResult) -> list[Graph]:
        """Run a fan-out pass once over every graph held; instruments see the first graph it
        made, and each one it made is verified."""
        for g in graphs:
            self._check_requires(p, g)
        props = graph_properties(graphs[0])
        times = PassTimes(instrument_seconds=self._before(index, p, graphs[0]))
        ctx = self._context()
        t0 = time.perf_counter()
        made = p.fan_out_ranks(list(graphs), ctx)
        self.mapping = ctx.mapping
        times.seconds = time.perf_counter() - t0
        if not made:
            raise PassContractError(f"pass {p.name} made no graph of {len(graphs)} graph(s)")
        t0 = time.perf_counter()
        for g in made:
            if self.debug:
                self._verify(index, p, g, ran)
            set_graph_properties(g, (props - p.invalidates) | p.produces)
        times.verify_seconds = time.perf_counter() - t0
        ran.append(p.spec())
        self._record(index, p, made[0], made != graphs, ctx, [], result, times)
        return made

    def _context(self) -> PassContext:
        return PassContext(debug=self.debug, evaluator=self.evaluator, adapter_reader=self.adapter_reader,
                           mapping=self.mapping)

    def _run_pass(self, index: int, p: Pass, graph: Graph, ran: list[str],
                  result: PipelineResult) -> None:
        self._check_requires(p, graph)
        times = PassTimes(instrument_seconds=self._before(index, p, graph))
        t0 = time.perf_counter()
        before = _fingerprint(graph) if self.debug else ""
        times.verify_seconds = time.perf_counter() - t0
        ctx = self._context()
        t0 = time.perf_counter()
        changed = bool(p.run(graph, ctx))
        times.seconds = time.perf_counter() - t0
        if self.debug:
            t0 = time.perf_counter()
            self._verify(index, p, graph, ran)
            really = _fingerprint(graph) != before
            times.verify_seconds += time.perf_counter() - t0
            if really and not changed:
                raise PassContractError(
                    f"pass {p.name} changed the graph but returned False (report changes "
                    "truthfully: caches and instruments rely on it)"
                )
            changed = really
        ran.append(p.spec())
        self._record(index, p, graph, changed, ctx, ran, result, times)


@dataclass
class RankedResult:
    """What `run_ranks` made: the global graph as the first fan-out pass found it (the input
    graph, rewritten in place up to there), the graphs after the pipeline (one per rank, or with
    the pipeline cut one per stage and rank, stage-major; `[graph]` without a fan-out pass), and
    the pipeline result."""

    global_graph: Graph
    ranks: list[Graph]
    result: PipelineResult
    mapping: ParallelMapping | None = None
    """The layout of `ranks` as the split made it (pass context's `mapping`); None: one rank."""


def run_pipeline(graph: Graph, pipeline: Pipeline | str, *,
                 instruments: Sequence[PassInstrument] = (), debug: bool = True,
                 disabled_passes: Iterable[str] = (), stop_after: str | int | None = None,
                 evaluator: GraphEvaluator | None = None,
                 adapter_reader: AdapterReader | None = None) -> PipelineResult:
    """Run a pipeline (object or text) on a graph in place; `disabled_passes` / `stop_after`
    cut it first (see `Pipeline.restricted`); `evaluator`, `adapter_reader`: see `PassContext`."""
    if isinstance(pipeline, str):
        pipeline = load_pipeline(pipeline, initial=graph_properties(graph))
    return PassManager(pipeline, instruments=instruments, debug=debug,
                       disabled_passes=disabled_passes, stop_after=stop_after,
                       evaluator=evaluator, adapter_reader=adapter_reader).run(graph)


def run_pipeline_ranks(graph: Graph, pipeline: Pipeline | str, *,
                       instruments: Sequence[PassInstrument] = (), debug: bool = True,
                       disabled_passes: Iterable[str] = (), stop_after: str | int | None = None,
                       evaluator: GraphEvaluator | None = None,
                       adapter_reader: AdapterReader | None = None) -> RankedResult:
    """Run a pipeline that may split the graph into rank graphs (see `PassManager.run_ranks`)."""
    if isinstance(pipeline, str):
        pipeline = load_pipeline(pipeline, initial=graph_properties(graph))
    return PassManager(pipeline, instruments=instruments, debug=debug,
                       disabled_passes=disabled_passes, stop_after=stop_after,
                       evaluator=evaluator, adapter_reader=adapter_reader).run_ranks(graph)
