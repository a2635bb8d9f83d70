"""What a pass is: a named, documented graph transformation with typed options.

A pass declares
- `name` (kebab-case, used in pipelines) and a one-line `description`;
- `Options`, a pydantic model (unknown or ill-typed options are errors);
- `requires` / `produces` / `invalidates`: graph properties such as
  `quantized`, `split` or `lowered:cuda`. The pipeline builder checks the
  order before anything runs; the pass manager records what each pass
  produced on the graph (`graph.metadata["properties"]`).

`run(graph, ctx)` mutates the graph in place and returns True if it changed
it. In debug mode the pass manager checks that claim against the printed IR
(a pass that says "unchanged" but changed the graph is a bug it reports).

Write a class, or decorate a function with `@function_pass(...)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from ernie_ir.ir import Graph
from ernie_ir.ir.mapping import Mapping as ParallelMapping

from .pipeline_syntax import PipelineError, format_pass_spec

if TYPE_CHECKING:
    import numpy as np

    from ernie_ir.ir import Node


class PassOptions(BaseModel):
    """Base of every pass's options: immutable, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class NoOptions(PassOptions):
    """For passes without options."""


class GraphRunner(Protocol):
    """A graph made runnable: outputs by input name, `observer(node, results)` after each node."""

    def run(self, inputs: Mapping[str, np.ndarray],
            observer: Callable[[Node, list[np.ndarray]], Any] | None = None) -> dict[str, np.ndarray]: ...


GraphEvaluator = Callable[[Graph], GraphRunner]
"""What runs a graph on concrete inputs for a pass that must (FP8 calibration). Passes sit below
`runtime`, so the caller supplies it: `compile_model`, the CLI and the golden harness pass
`ernie_ir.runtime.Interpreter` (the class itself fits)."""

AdapterReader = Callable[[Path], Any]
"""What reads a LoRA adapter folder for `lora-import`: folder -> `ernie_ir.passes.lora.adapter.
LoraAdapter` (typed loosely here: `infra` imports no pass family). Passes never read a checkpoint
format, so the caller supplies it: `compile_model`, the CLI, the planner, `export` and the golden
harness pass `ernie_ir.formats.paddleformers_adapter.read_adapter`."""


@dataclass
class PassContext:
    """What a running pass may use besides the graph: statistics, diagnostics, an evaluator, an
    adapter reader.

    `count(key)` feeds the rewrite-count instrument; `warn(msg)` collects
    warnings that the CLI prints (the library itself never prints);
    `evaluator` (None unless the caller of the pipeline gives one) runs a graph;
    `adapter_reader` (likewise) reads a LoRA adapter folder for `lora-import`;
    `mapping`: the parallel layout the graphs are laid out by, once a fan-out pass made rank
    graphs (the split sets it; None before, and for one rank), carried to every later pass and
    to the caller (`RankedResult.mapping`), so nobody derives it again.
    """

    stats: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    debug: bool = True
    evaluator: GraphEvaluator | None = None
    adapter_reader: AdapterReader | None = None
    mapping: ParallelMapping | None = None

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def warn(self, message: str) -> None:
        self.warnings.append(message)


class Pass(ABC):
    """Base class of passes. Subclasses set the class attributes and implement `run`."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Options: ClassVar[type[PassOptions]] = NoOptions
    requires: ClassVar[frozenset[str]] = frozenset()
    produces: ClassVar[frozenset[str]] = frozenset()
    invalidates: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, options: PassOptions | dict[str, Any] | None = None) -> None:
        self.options = self.make_options(options)

    @classmethod
    def make_options(cls, options: PassOptions | dict[str, Any] | None) -> PassOptions:
        if isinstance(options, cls.Options):
            return options
        try:
            return cls.Options.model_validate(options or {})
        except ValidationError as e:
            problems = []
            for err in e.errors():
                where = ".".join(str(p) for p in err["loc"]) or "options"
                where = where if where.isprintable() else repr(where)  # a YAML key may hold a newline
                problems.append(f"{where}: {err['msg']}")
            valid = ", ".join(cls.Options.model_fields) or "none"
            raise PipelineError(
                f"pass {cls.name}: bad option ({'; '.join(problems)}); valid options: {valid}"
            ) from None

    fans_out: ClassVar[bool] = False
    """A pass that turns one graph into several (the split into rank graphs, the pipeline cut into
    stage graphs): the pass manager's `run_ranks` calls `fan_out_ranks` with every graph it holds
    (the one graph, or the graphs an earlier fan-out pass made) and runs every later pass on each
    of the graphs it returns."""

    @abstractmethod
    def run(self, graph: Graph, ctx: PassContext) -> bool:
        """Transform `graph` in place; return True if it changed."""

    def fan_out(self, graph: Graph, ctx: PassContext) -> list[Graph]:
        """The graphs this pass makes of `graph` (default: `graph` itself, run in place)."""
        self.run(graph, ctx)
        return [graph]

    def fan_out_ranks(self, graphs: list[Graph], ctx: PassContext) -> list[Graph]:
        """The graphs this pass makes of `graphs` (one graph, or the rank graphs an earlier
        fan-out pass made, in rank order); default: each graph's `fan_out`, in order. A pass
        that must see every rank graph at once (the pipeline cut, which balances its stages on
        rank 0 and orders its graphs stage-major) overrides it."""
        return [out for graph in graphs for out in self.fan_out(graph, ctx)]

    def spec(self) -> str:
        """This pass and its non-default options, in pipeline syntax."""
        return format_pass_spec(self.name, self.options)

    def __repr__(self) -> str:
        return f"<Pass {self.spec()}>"


def function_pass(
    name: str,
    description: str,
    *,
    options: type[PassOptions] = NoOptions,
    requires: tuple[str, ...] = (),
    produces: tuple[str, ...] = (),
    invalidates: tuple[str, ...] = (),
) -> Callable[[Callable[[Graph, Any, PassContext], bool]], type[Pass]]:
    """Turn `fn(graph, options, ctx) -> changed` into a Pass class."""

    def wrap(fn: Callable[[Graph, Any, PassContext], bool]) -> type[Pass]:
        def run(self: Pass, graph: Graph, ctx: PassContext) -> bool:
            return bool(fn(graph, self.options, ctx))

        cls = type(
            fn.__name__,
            (Pass,),
            {
                "name": name,
                "description": description,
                "Options": options,
                "requires": frozenset(requires),
                "produces": frozenset(produces),
                "invalidates": frozenset(invalidates),
                "run": run,
                "__doc__": fn.__doc__ or description,
                "__module__": fn.__module__,
            },
        )
        return cls

    return wrap


def graph_properties(graph: Graph) -> set[str]:
    """The properties passes have recorded on this graph."""
    return set(graph.metadata.get("properties", []))


def set_graph_properties(graph: Graph, props: set[str]) -> None:
    if props:
        graph.metadata["properties"] = sorted(props)
    else:
        graph.metadata.pop("properties", None)
