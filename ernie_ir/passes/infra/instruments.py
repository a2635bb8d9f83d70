"""Pass instruments: observers plugged into the pass manager, never into passes.

- `TimingInstrument`: seconds per pass (rows for a table): the pass alone, with
  verification and the instruments' own time (printing, dumping) apart; the
  manager measures them and hands them over through `pass_timed`.
- `PrintIRInstrument`: the IR before and/or after chosen passes, only when the
  pass changed the graph (after an unchanged pass: one line saying so); text
  goes to a `sink` callable (the CLI prints it).
- `DumpInstrument`: every step into numbered `.ir` files whose header records
  the resolved pipeline and the remaining pipeline to replay from that step;
  the folder must be new or empty, so that no older step is mistaken for one, and no other
  process may be writing it (its lock, as for artifacts and graph folders).
- `RewriteCountInstrument`: per-rule rewrite counts reported by rewrite passes.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.storage import folder_lock

from .base import Pass, PassContext
from .pipeline import Pipeline


class InstrumentError(ErnieIRError):
    """An instrument that cannot do its job (e.g. a dump folder that already holds files)."""


@dataclass
class PassTimes:
    """Where one pass's wall time went, in seconds, as the pass manager measured it."""

    seconds: float = 0.0
    """The pass's `run` (or `fan_out`) alone."""
    verify_seconds: float = 0.0
    """Debug-mode checks around it: the verifier and the printed-IR "changed" check."""
    instrument_seconds: float = 0.0
    """Every instrument's `before_pass` and `after_pass` (printing and dumping the IR)."""


class PassInstrument:
    """Hooks around a pipeline run. Override what you need."""

    def enter_pipeline(self, pipeline: Pipeline, graph: Graph) -> None: ...

    def before_pass(self, index: int, p: Pass, graph: Graph) -> None: ...

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None: ...

    def pass_timed(self, index: int, p: Pass, times: PassTimes) -> None:
        """Called after every instrument's `after_pass`, with the time the pass took."""

    def exit_pipeline(self, graph: Graph) -> None: ...


@dataclass
class TimingRow:
    index: int
    spec: str
    seconds: float
    """The pass alone."""
    changed: bool
    verify_seconds: float = 0.0
    instrument_seconds: float = 0.0


class TimingInstrument(PassInstrument):
    """One row per pass run, from the manager's measurements (not from its own clock, which
    would also count the verifier and the other instruments)."""

    def __init__(self) -> None:
        self.rows: list[TimingRow] = []
        self._changed = False

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None:
        self._changed = changed

    def pass_timed(self, index: int, p: Pass, times: PassTimes) -> None:
        self.rows.append(TimingRow(index, p.spec(), times.seconds, self._changed,
                                   times.verify_seconds, times.instrument_seconds))

    @property
    def total(self) -> float:
        """Seconds in the passes themselves."""
        return sum(r.seconds for r in self.rows)

    @property
    def total_verify(self) -> float:
        return sum(r.verify_seconds for r in self.rows)

    @property
    def total_instruments(self) -> float:
        return sum(r.instrument_seconds for r in self.rows)


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
            if self._wants(self.after, p):  # silence would read as "not run" or "not asked"
                self.sink(f"// ----- {p.spec()} (pass {index}) left the IR unchanged -----")
            return
        if self._pending is not None:
            self.sink(f"// ----- IR before {p.spec()} (pass {index}) -----\n{self._pending}")
        if self._wants(self.after, p):
            self.sink(f"// ----- IR after {p.spec()} (pass {index}) -----\n{print_graph(graph)}")


class DumpInstrument(PassInstrument):
    """Write `000-input.ir`, `001-<pass>.ir`, ... into `folder`.

    From `enter_pipeline` to `exit_pipeline` (or `close`) it holds the folder's lock
    (`ernie_ir.ir.storage.folder_lock`, the one artifact and graph-folder writers take): while
    another process writes the folder, InstrumentError (one line, the lock and its holder's PID)
    and nothing is written."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files: list[Path] = []
        self._pipeline: Pipeline | None = None
        self._lock = contextlib.ExitStack()
        self._check_folder()

    def _check_folder(self) -> None:
        if self.folder.exists() and not self.folder.is_dir():
            raise InstrumentError(f"dump folder {self.folder} is a file, not a folder: choose a new "
                                  "or empty folder")
        if self.folder.is_dir():
            entries = sorted(p.name for p in self.folder.iterdir())
            if entries:
                raise InstrumentError(
                    f"dump folder {self.folder} is not empty ({len(entries)} "
                    f"entr{'y' if len(entries) == 1 else 'ies'}, e.g. {entries[0]}): choose a new or "
                    "empty folder, so that no older step is taken for one of this run")

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
        try:
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            self._lock.enter_context(folder_lock(self.folder, what="dump folder", error=InstrumentError))
            self._check_folder()  # again, under the lock
            self.folder.mkdir(exist_ok=True)
        except OSError as e:
            self.close()
            raise InstrumentError(f"dump folder {self.folder}: cannot create it ({e.strerror or e}): "
                                  "choose a writable folder") from None
        except BaseException:
            self.close()
            raise
        self._pipeline = pipeline
        self._write(0, "input", graph, pipeline.passes)

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None:
        assert self._pipeline is not None
        self._write(index, p.name, graph, self._pipeline.passes[index:])

    def exit_pipeline(self, graph: Graph) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the folder's lock (the pass manager does not call `exit_pipeline` when a
        pass raises; a dropped instrument lets go too)."""
        self._lock.close()


@dataclass
class RewriteCountInstrument(PassInstrument):
    """Counts that passes report through `ctx.count(...)`, per pass."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None:
        if ctx.stats:
            self.counts[f"{index}:{p.name}"] = dict(ctx.stats)
