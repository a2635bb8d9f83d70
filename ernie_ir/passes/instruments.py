"""Pass instruments: observers plugged into the pass manager, never into passes.

- `TimingInstrument`: seconds per pass (rows for a table).
- `PrintIRInstrument`: the IR before and/or after chosen passes, only when the
  pass changed the graph; text goes to a `sink` callable (the CLI prints it).
- `DumpInstrument`: every step into numbered `.ir` files whose header records
  the resolved pipeline and the remaining pipeline to replay from that step.
- `RewriteCountInstrument`: per-rule rewrite counts reported by rewrite passes.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ernie_ir.ir import Graph
from ernie_ir.ir.printer import print_graph

from .base import Pass, PassContext
from .pipeline import Pipeline


class PassInstrument:
    """Hooks around a pipeline run. Override what you need."""

    def enter_pipeline(self, pipeline: Pipeline, graph: Graph) -> None: ...

    def before_pass(self, index: int, p: Pass, graph: Graph) -> None: ...

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None: ...

    def exit_pipeline(self, graph: Graph) -> None: ...


@dataclass
class TimingRow:
    index: int
    spec: str
    seconds: float
    changed: bool


class TimingInstrument(PassInstrument):
    def __init__(self) -> None:
        self.rows: list[TimingRow] = []
        self._t0 = 0.0

    def before_pass(self, index: int, p: Pass, graph: Graph) -> None:
        self._t0 = time.perf_counter()

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None:
        self.rows.append(TimingRow(index, p.spec(), time.perf_counter() - self._t0, changed))

    @property
    def total(self) -> float:
        return sum(r.seconds for r in self.rows)


class PrintIRInstrument(PassInstrument):
    """Print the IR around passes named in `before` / `after` (or all with "*")."""

    def __init__(self, sink: Callable[[str], None], *, before: Iterable[str] = (),
                 after: Iterable[str] = ()) -> None:
        self.sink = sink
        self.before = set(before)
        self.after = set(after)
        self._pending: str | None = None

    def _wants(self, names: set[str], p: Pass) -> bool:
        return "*" in names or p.name in names

    def before_pass(self, index: int, p: Pass, graph: Graph) -> None:
        # Printed only if the pass turns out to change the graph.
        self._pending = print_graph(graph) if self._wants(self.before, p) else None

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None:
        if not changed:
            return
        if self._pending is not None:
            self.sink(f"// ----- IR before {p.spec()} (pass {index}) -----\n{self._pending}")
        if self._wants(self.after, p):
            self.sink(f"// ----- IR after {p.spec()} (pass {index}) -----\n{print_graph(graph)}")


class DumpInstrument(PassInstrument):
    """Write `000-input.ir`, `001-<pass>.ir`, ... into `folder`."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files: list[Path] = []
        self._pipeline: Pipeline | None = None

    def _write(self, step: int, label: str, graph: Graph, rest: list[Pass]) -> None:
        assert self._pipeline is not None
        replay = ",".join(p.spec() for p in rest)
        path = self.folder / f"{step:03d}-{label.replace(' ', '-').replace('/', '_')}.ir"
        header = (
            f"// ernie-ir dump, step {step}: {label}\n"
            f"// pipeline: {self._pipeline}\n"
            f"// replay from this step: ernie-ir show {shlex.quote(str(path))} "
            f"--pipeline {shlex.quote(replay)}\n"
        )
        path.write_text(header + print_graph(graph), encoding="utf-8")
        self.files.append(path)

    def enter_pipeline(self, pipeline: Pipeline, graph: Graph) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._pipeline = pipeline
        self._write(0, "input", graph, pipeline.passes)

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None:
        assert self._pipeline is not None
        self._write(index, p.name, graph, self._pipeline.passes[index:])


@dataclass
class RewriteCountInstrument(PassInstrument):
    """Counts that passes report through `ctx.count(...)`, per pass."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None:
        if ctx.stats:
            self.counts[f"{index}:{p.name}"] = dict(ctx.stats)
