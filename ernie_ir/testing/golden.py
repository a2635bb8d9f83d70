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

Goldens pin values as well as structure: every param with data is written
with its content hash (`param @w : f32[4,8] hash "..."`), and a check fails
when a param's values differ, so a rewrite that builds the right graph from
the wrong numbers (weights concatenated in the wrong order) fails. Structure
(value names do not matter) is compared first; a mismatch reports a unified
diff of the canonical text. Optional header lines:

    // compare: structure        this golden pins structure only (no hashes)
    // no-hash: *.input_scale    params (globs) whose values are not portable

`no-hash` is for values computed from float activations (FP8 calibration),
which depend on the BLAS kernel's summation order and so on the machine.
Checks can also be asked for structure only (`structure_only=True`,
`ernie-ir golden check --structure-only`, `pytest --golden-structure-only`).
`update` rewrites only failing files.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.equality import structural_diff
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.weights import content_hash

MARKER = "// golden case"
UPDATE_ENV = "ERNIE_IR_UPDATE_GOLDENS"
VALUES = "values"
STRUCTURE = "structure"


def update_requested() -> bool:
    return os.environ.get(UPDATE_ENV, "") not in ("", "0", "false", "no")


@dataclass
class GoldenResult:
    case: GoldenCase
    ok: bool
    diff: str = ""
    reason: str = ""
    updated: bool = False
    unreadable: bool = False
    """The golden's IR does not parse: a broken file, not a difference (`update` rewrites it)."""


@dataclass
class GoldenCase:
    path: Path
    input: str
    pipeline: str
    expected: str  # the IR text after the header
    compare: str = VALUES
    """`values` (structure and a content hash per param) or `structure`."""
    no_hash: tuple[str, ...] = ()
    """Globs of param names written and compared without a hash (values not portable)."""
    body_line: int = 1
    """The file's line number of the first line of `expected` (parse errors name file lines)."""

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
        compare = fields.get("compare", VALUES)
        if compare not in (VALUES, STRUCTURE):
            raise ErnieIRError(f"{p}: '// compare: {compare}': give 'values' (the default: structure "
                               "and a hash per param) or 'structure'")
        no_hash = tuple(g.strip() for g in fields.get("no-hash", "").split(",") if g.strip())
        return cls(p, fields["input"], fields.get("pipeline", ""), "\n".join(lines[body_start:]),
                   compare, no_hash, body_line=body_start + 1)

    @classmethod
    def new(cls, path: str | os.PathLike[str], input: str, pipeline: str = "", *,
            compare: str = VALUES, no_hash: tuple[str, ...] = ()) -> GoldenCase:
        return cls(Path(path), input, pipeline, "", compare, tuple(no_hash))

    def header(self) -> str:
        text = f"{MARKER}\n// input: {self.input}\n// pipeline: {self.pipeline}\n"
        if self.compare != VALUES:
            text += f"// compare: {self.compare}\n"
        if self.no_hash:
            text += f"// no-hash: {', '.join(self.no_hash)}\n"
        return text

    def exempt(self, param: str) -> bool:
        """Whether `param`'s values are left out (a `no-hash` glob matches its name)."""
        return any(fnmatch.fnmatchcase(param, g) for g in self.no_hash)

    def resolve_input(self) -> str:
        # Lexically normalised, so `../model.ir` works before the golden's folder exists.
        local = Path(os.path.normpath(self.path.parent / self.input))
        return str(local) if local.exists() else self.input

    def compute(self) -> Graph:
        """Load the input and run the pipeline (debug mode: verified after each pass)."""
        from ernie_ir.formats.paddleformers_adapter import read_adapter
        from ernie_ir.load import load_input
        from ernie_ir.passes import run_pipeline
        from ernie_ir.runtime import Interpreter

        graph = load_input(self.resolve_input())
        if self.pipeline:
            run_pipeline(graph, self.pipeline, evaluator=Interpreter, adapter_reader=read_adapter)
        return graph

    def _hashes(self, graph: Graph) -> dict[str, str]:
        """Content hash of every param with data that is not exempt."""
        return {name: content_hash(p.read()) for name, p in graph.params.items()
                if p.source is not None and not self.exempt(name)}

    def _text(self, graph: Graph, hashes: dict[str, str] | None) -> str:
        """The canonical text; with `hashes`, those params carry theirs (and no other does)."""
        if hashes is None:
            return print_graph(graph)
        saved = {name: p.digest for name, p in graph.params.items()}
        try:
            for name, p in graph.params.items():
                p.digest = hashes.get(name)
            return print_graph(graph)
        finally:
            for name, p in graph.params.items():
                p.digest = saved[name]

    def render(self, actual: Graph) -> str:
        """The file `write` would write for `actual`: header and IR (with hashes unless this
        golden compares structure only)."""
        hashes = self._hashes(actual) if self.compare == VALUES else None
        return self.header() + self._text(actual, hashes)

    def check(self, actual: Graph | None = None, *, structure_only: bool = False) -> GoldenResult:
        """Compare `actual` (default: computed) with the golden: structure, then (unless this
        golden or the caller asks for structure only) every param's content hash."""
        actual = actual if actual is not None else self.compute()
        if not self.expected.strip():
            return GoldenResult(self, False, reason="golden file has no IR yet")
        try:
            expected = parse_graph("\n" * (self.body_line - 1) + self.expected, source=str(self.path),
                                   check_types=False)
        except ErnieIRError as e:
            return GoldenResult(self, False, reason=f"golden IR does not parse: {e}", unreadable=True)
        values = self.compare == VALUES and not structure_only
        why = structural_diff(actual, expected)
        hashes = self._hashes(actual) if values else None
        if why is None and hashes is not None:
            why = self._value_diff(actual, expected, hashes)
        if why is None:
            return GoldenResult(self, True)
        if hashes is None:  # structure only: the hashes a golden records are not compared
            for p in expected.params.values():
                p.digest = None
        diff = "".join(difflib.unified_diff(
            print_graph(expected).splitlines(keepends=True),
            self._text(actual, hashes).splitlines(keepends=True),
            fromfile=f"{self.path} (expected)", tofile=f"{self.input} | {self.pipeline} (actual)",
        ))
        return GoldenResult(self, False, diff=diff, reason=why)

    def _value_diff(self, actual: Graph, expected: Graph, hashes: dict[str, str]) -> str | None:
        """The first param whose values differ from the golden's hash, in words."""
        for name in actual.params:
            if self.exempt(name):
                continue
            want = expected.params[name].digest
            have = hashes.get(name)
            if want == have:
                continue
            if have is None:
                return (f"param @{name}: the golden records hash {want} but the graph has no data "
                        "for it (a meta model?)")
            if want is None:
                return (f"param @{name}: the golden records no hash (written before goldens pinned "
                        "values, or structure-only): run `ernie-ir golden update` (pytest "
                        "--update-goldens) to record them, or add '// compare: structure'")
            return f"param @{name}: values differ (hash {have}, golden {want})"
        return None

    def write(self, actual: Graph) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = self.render(actual)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.path)
        self.expected = text[len(self.header()):]
        self.body_line = self.header().count("\n") + 1


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


def check_goldens(paths: Iterable[str | os.PathLike[str]], *, update: bool = False,
                  structure_only: bool = False) -> list[GoldenResult]:
    """Check every golden case; with `update`, rewrite the failing ones (only those). With
    `structure_only`, param values (hashes) are not compared. A golden whose IR does not parse
    is an ErnieIRError when checking (a broken file is no difference); `update` rewrites it."""
    results = []
    for path in find_goldens(paths):
        case = GoldenCase.read(path)
        actual = case.compute()
        result = case.check(actual, structure_only=structure_only)
        if result.unreadable and not update:
            raise ErnieIRError(f"{result.reason} (repair the file, or rewrite it with "
                               f"`ernie-ir golden update {path}`)")
        if not result.ok and update:
            case.write(actual)
            result.updated = True
        results.append(result)
    return results
