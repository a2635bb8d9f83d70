"""Golden-graph testing: an input plus a pipeline must give the IR in a file.

A golden file is IR text with a header that says how to produce it:

    // golden case
    // input: ernie-4.5-21b-a3b@tiny
    // pipeline: canonicalize,cse,dce
    graph @... { ... }

`input` is a built-in model, a model or graph folder, or an `.ir` file
(relative paths are relative to the golden file); `pipeline` may be empty.
An input in angle brackets (`<test>`, what the pytest `golden` fixture
writes) names no loadable input: the test that wrote the file checks it, so
it is neither collected by pytest nor found in folders by `ernie-ir golden`.
Comparison is structural (value names do not matter); a mismatch reports a
unified diff of the canonical text. `update` rewrites only failing files.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.equality import structural_diff
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph

MARKER = "// golden case"
UPDATE_ENV = "ERNIE_IR_UPDATE_GOLDENS"


def update_requested() -> bool:
    return os.environ.get(UPDATE_ENV, "") not in ("", "0", "false", "no")


@dataclass
class GoldenResult:
    case: GoldenCase
    ok: bool
    diff: str = ""
    reason: str = ""
    updated: bool = False


@dataclass
class GoldenCase:
    path: Path
    input: str
    pipeline: str
    expected: str  # the IR text after the header

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> GoldenCase:
        p = Path(path)
        text = p.read_text(encoding="utf-8")
        lines = text.split("\n")
        if not lines or lines[0].strip() != MARKER:
            raise ErnieIRError(f"{p}: not a golden case (first line must be {MARKER!r})")
        fields: dict[str, str] = {}
        body_start = len(lines)  # a header without IR (and without a final newline)
        for i, line in enumerate(lines[1:], 1):
            if not line.startswith("//"):
                body_start = i
                break
            key, _, value = line[2:].strip().partition(":")
            fields[key.strip()] = value.strip()
        if "input" not in fields:
            raise ErnieIRError(f"{p}: golden header needs an '// input: MODEL' line")
        return cls(p, fields["input"], fields.get("pipeline", ""), "\n".join(lines[body_start:]))

    @classmethod
    def new(cls, path: str | os.PathLike[str], input: str, pipeline: str = "") -> GoldenCase:
        return cls(Path(path), input, pipeline, "")

    def header(self) -> str:
        return f"{MARKER}\n// input: {self.input}\n// pipeline: {self.pipeline}\n"

    def resolve_input(self) -> str:
        # Lexically normalised, so `../model.ir` works before the golden's folder exists.
        local = Path(os.path.normpath(self.path.parent / self.input))
        return str(local) if local.exists() else self.input

    def compute(self) -> Graph:
        """Load the input and run the pipeline (debug mode: verified after each pass)."""
        from ernie_ir.load import load_input
        from ernie_ir.passes import run_pipeline
        from ernie_ir.runtime import Interpreter

        graph = load_input(self.resolve_input())
        if self.pipeline:
            run_pipeline(graph, self.pipeline, evaluator=Interpreter)
        return graph

    def check(self, actual: Graph | None = None) -> GoldenResult:
        actual = actual if actual is not None else self.compute()
        actual_text = print_graph(actual)
        if not self.expected.strip():
            return GoldenResult(self, False, reason="golden file has no IR yet")
        try:
            expected = parse_graph(self.expected, source=str(self.path), check_types=False)
        except ErnieIRError as e:
            return GoldenResult(self, False, reason=f"golden IR does not parse: {e}")
        why = structural_diff(actual, expected)
        if why is None:
            return GoldenResult(self, True)
        diff = "".join(difflib.unified_diff(
            print_graph(expected).splitlines(keepends=True), actual_text.splitlines(keepends=True),
            fromfile=f"{self.path} (expected)", tofile=f"{self.input} | {self.pipeline} (actual)",
        ))
        return GoldenResult(self, False, diff=diff, reason=why)

    def write(self, actual: Graph) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = self.header() + print_graph(actual)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.path)
        self.expected = text.split("\n", 3)[3]


def find_goldens(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Golden files among `paths` (files, or folders searched recursively)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found.extend(sorted(f for f in p.rglob("*.ir") if _is_golden(f) and not _written_by_test(f)))
        elif p.is_file():
            if not _is_golden(p):
                raise ErnieIRError(f"{p}: not a golden case (first line must be {MARKER!r})")
            if _written_by_test(p):
                raise ErnieIRError(f"{p}: written by a test's `golden` fixture (its input is not "
                                   "loadable); run that test to check it")
            found.append(p)
        else:
            raise ErnieIRError(f"{p}: no such file or folder")
    return found


def _is_golden(p: Path) -> bool:
    try:
        with open(p, encoding="utf-8") as f:
            return f.readline().strip() == MARKER
    except (OSError, UnicodeDecodeError):
        return False


def _written_by_test(p: Path) -> bool:
    """A golden whose input is `<...>`: written and checked by a test, not computable here."""
    try:
        with open(p, encoding="utf-8") as f:
            head = [f.readline() for _ in range(3)]
    except (OSError, UnicodeDecodeError):
        return False
    return any(line.startswith("// input: <") for line in head)


def check_goldens(paths: Iterable[str | os.PathLike[str]], *, update: bool = False) -> list[GoldenResult]:
    """Check every golden case; with `update`, rewrite the failing ones (only those)."""
    results = []
    for path in find_goldens(paths):
        case = GoldenCase.read(path)
        actual = case.compute()
        result = case.check(actual)
        if not result.ok and update:
            case.write(actual)
            result.updated = True
        results.append(result)
    return results
